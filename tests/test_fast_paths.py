"""The fast forward and decode paths against the plain ones, on CPU with tiny models.

- `LinearLogProb` (chunked LM head, recomputed in backward) against autograd through full logits;
- log-probs, entropy, values and gradients of the packed (variable-length attention) and
  padded layouts against the model's own forward;
- `FastHFRolloutEngine` against `HFRolloutEngine`: same greedy tokens and log-probs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf import algos
from rlhf.models.attention import VARLEN_ATTENTION, use_varlen_attention
from rlhf.trainer import forward as F
from rlhf.trainer.batch import collate

torch.set_num_threads(1)


def _qwen(vocab: int = 61, seed: int = 0, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      attn_implementation="sdpa", **kw)
    return Qwen2ForCausalLM(cfg).eval()


def _batch(vocab: int, n: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 10, (n,), generator=g)]
    responses = [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 7, (n,), generator=g)]
    return collate(prompts, responses, [0.0] * n, list(range(n)), pad_id=0)


def _reference_log_probs(model, b, temperature: float):
    R = b.responses.shape[1]
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                   use_cache=False).logits[:, -R - 1:-1].float() / temperature
    m = b.response_mask
    return algos.logprobs_from_logits(logits, b.responses) * m, algos.entropy_from_logits(logits) * m


@pytest.mark.parametrize("with_entropy", [True, False])
def test_linear_log_probs_match_full_logits_forward_and_backward(with_entropy):
    torch.manual_seed(0)
    h = torch.randn(23, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(40, (23,))
    lp, ent = F.linear_log_probs(h, w, y, temperature=0.7, with_entropy=with_entropy, chunk=6)
    x = h @ w.t() / 0.7
    lp_ref, ent_ref = algos.logprobs_from_logits(x, y), algos.entropy_from_logits(x)
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    g1, g2 = torch.randn(23, dtype=torch.float64), torch.randn(23, dtype=torch.float64)
    loss = (lp * g1).sum() + ((ent * g2).sum() if with_entropy else 0.0)
    loss_ref = (lp_ref * g1).sum() + ((ent_ref * g2).sum() if with_entropy else 0.0)
    if with_entropy:
        assert torch.allclose(ent.double(), ent_ref, atol=1e-4)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(loss_ref, (h, w))):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("packed", [False, True])
def test_log_probs_and_grads_match_the_models_own_forward(packed):
    model, b = _qwen(), _batch(61)
    ref = copy.deepcopy(model)
    lp_ref, ent_ref = _reference_log_probs(ref, b, 0.8)
    lp, ent = F.log_probs(model, b, 0.8, packed, with_entropy=True)
    assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-5)
    assert lp[b.response_mask == 0].abs().max() == 0  # padding stays zero
    (lp.sum() + 0.3 * ent.sum()).backward()
    (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert model.config._attn_implementation == (VARLEN_ATTENTION if packed else "sdpa")


def test_packed_values_match_padded_values():
    from rlhf.models.load import ValueModel

    model, b = _qwen(), _batch(61, n=6, seed=3)
    critic = ValueModel(model.model)
    torch.nn.init.normal_(critic.value_head.weight)
    padded = F.values(copy.deepcopy(critic), b, packed=False)
    packed = F.values(copy.deepcopy(critic), b, packed=True)
    own = critic(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
    R = b.responses.shape[1]
    assert torch.allclose(padded, own[:, -R - 1:-1] * b.response_mask, atol=1e-5)
    assert torch.allclose(packed, padded, atol=1e-5)


def test_packed_rows_without_cu_seqlens_still_attend_within_their_sequence():
    """A packed forward that passes only restarting position ids gets the same logits."""
    model, b = _qwen(), _batch(61)
    lay = F.layout(b, packed=True)
    use_varlen_attention(model)
    with_cu = model(**lay.kwargs, use_cache=False).logits
    without = model(input_ids=lay.kwargs["input_ids"], position_ids=lay.kwargs["position_ids"],
                    use_cache=False).logits
    assert torch.allclose(with_cu, without, atol=1e-6)
    # and each sequence alone gives the same logits as inside the pack
    first = int(b.attention_mask[0].sum())
    alone = model(input_ids=lay.kwargs["input_ids"][:, :first], use_cache=False).logits
    assert torch.allclose(alone, with_cu[:, :first], atol=1e-5)


def test_batched_log_probs_with_a_token_budget_match_one_pass():
    model, b = _qwen(), _batch(61, n=7, seed=5)
    full, _ = F.log_probs(copy.deepcopy(model), b, 1.0, packed=False)
    budget = F.batched_log_probs(copy.deepcopy(model), b, micro=2, temperature=1.0, packed=True, dynamic=True,
                                 max_tokens=24)
    assert torch.allclose(budget, full, atol=1e-5)


def test_balanced_split_keeps_every_index_once_and_balances():
    lengths = [50, 7, 31, 12, 12, 40, 3, 25]
    groups = F.balanced_split(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    totals = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == 3 and max(totals) - min(totals) <= max(lengths)


@pytest.mark.parametrize("batch_size", [4, 64])
def test_fast_decode_matches_the_hf_engine_greedy(batch_size):
    from rlhf.models.tokenizer import build_char_tokenizer
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.fast_decode import FastHFRolloutEngine
    from rlhf.rollout.hf import HFRolloutEngine

    tok = build_char_tokenizer()
    model = _qwen(vocab=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, len(tok), (int(k),), generator=g).tolist() for k in torch.randint(1, 15, (5,), generator=g)]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=9)
    want = HFRolloutEngine(model, tok, batch_size=3).generate(prompts, params)
    got = FastHFRolloutEngine(model, tok, batch_size=batch_size, kv_window_step=4).generate(prompts, params)
    assert got.response_ids == want.response_ids
    assert got.group_ids == want.group_ids and got.finish_reason == want.finish_reason
    for a, b in zip(got.logprobs, want.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored after generate


def test_fast_decode_samples_n_per_prompt_and_is_seeded():
    from rlhf.models.tokenizer import build_char_tokenizer
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.fast_decode import FastHFRolloutEngine

    tok = build_char_tokenizer()
    model = _qwen(vocab=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=6, seed=11)
    engine = FastHFRolloutEngine(model, tok, batch_size=6)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert len(a) == 9 and a.group_ids == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert a.response_ids == b.response_ids
    assert all(len(r) == len(lp) and all(x <= 0 for x in lp) for r, lp in zip(a.response_ids, a.logprobs))


def _varlen_noncausal(q, k, v, cu_q, cu_k, max_q, max_k, scale, used):
    """What flash-attention's varlen kernel computes (non-causal, `seqused_k`), in plain torch."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[int(cu_q[i]):int(cu_q[i + 1])]  # (Tq, Hq, D)
        ks = k[int(cu_k[i]):int(cu_k[i]) + int(used[i])].repeat_interleave(rep, 1)  # (Tk, Hq, D)
        vs = v[int(cu_k[i]):int(cu_k[i]) + int(used[i])].repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        out[int(cu_q[i]):int(cu_q[i + 1])] = torch.einsum("hqk,khd->qhd", att.softmax(-1), vs)
    return out


@pytest.mark.parametrize("hq,hkv", [(12, 2), (4, 4), (8, 1)])
def test_grouped_decode_attention_equals_one_query_per_head(monkeypatch, hq, hkv):
    """Decode with the query heads of a KV head run as one block of queries gives the same
    output as one query per head, and as the SDPA path, row by row at each row's length."""
    from rlhf.rollout import fast_decode as FD

    monkeypatch.setattr(FD, "_flash_varlen", _varlen_noncausal)
    g = torch.Generator().manual_seed(0)
    rows, max_len, d = 5, 9, 8
    kc, vc = (torch.randn(rows * max_len, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(rows, hq, d, generator=g)
    used = torch.tensor([1, 9, 4, 7, 2], dtype=torch.int32)
    ar = torch.arange(rows + 1, dtype=torch.int32)
    step = FD._Step([kc], [vc], rows, max_len, prefill=False, cu_q=ar, cu_k=ar * max_len, used=used,
                    cu_group=ar * (hq // hkv))
    grouped = FD._decode_flash(q, kc, vc, step, 0.3)
    per_head = FD._decode_flash(q, kc, vc, FD._Step(**{**step.__dict__, "group": False}), 0.3)
    sdpa = FD._decode_sdpa(q, kc, vc, step, 0.3)
    assert grouped.shape == (rows, hq, d)
    assert torch.allclose(grouped, per_head, atol=1e-5) and torch.allclose(grouped, sdpa, atol=1e-5)
    # the layout is not trivially symmetric: a wrong head order changes the result
    if hkv > 1 and hq > hkv:
        wrong = FD.ungroup_queries(_varlen_noncausal(q.reshape(rows * (hq // hkv), hkv, d), kc, vc, ar * (hq // hkv),
                                                     ar * max_len, hq // hkv, max_len, 0.3, used), rows)
        assert not torch.allclose(wrong, grouped, atol=1e-3)
