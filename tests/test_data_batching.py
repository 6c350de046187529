"""Token-budget micro-batches, sequence packing (checked against a padded forward), and padding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.data.batching import (
    block_causal_mask,
    dynamic_micro_batches,
    pack_sequences,
    packed_forward_kwargs,
    pad_sequences,
    unpack,
)

lengths_st = st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, max_tokens=st.integers(min_value=1, max_value=200))
def test_micro_batches_cover_each_index_once_within_budget(lengths, max_tokens):
    batches = dynamic_micro_batches(lengths, max_tokens)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert b, "no empty micro-batch"
        total = sum(lengths[i] for i in b)
        assert total <= max_tokens or (len(b) == 1 and lengths[b[0]] > max_tokens)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, max_tokens=st.integers(min_value=64, max_value=400))
def test_micro_batches_are_balanced_and_few(lengths, max_tokens):
    batches = dynamic_micro_batches(lengths, max_tokens)
    totals = [sum(lengths[i] for i in b) for b in batches]
    assert max(totals) - min(totals) <= max(lengths)  # longest-first into the lightest batch
    if max(lengths) * 2 <= max_tokens:  # then k never needs to pass ceil(2 * total / max_tokens)
        assert len(batches) <= max(1, math.ceil(2 * sum(lengths) / max_tokens))


def test_micro_batches_hand_case():
    batches = dynamic_micro_batches([8, 1, 7, 2, 6, 3, 5, 4], max_tokens=12)
    totals = sorted(sum([8, 1, 7, 2, 6, 3, 5, 4][i] for i in b) for b in batches)
    assert len(batches) == 3 and totals == [12, 12, 12]
    assert dynamic_micro_batches([50, 3, 4], max_tokens=10) == [[2, 1], [0]]  # oversize alone, last
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        dynamic_micro_batches([1], 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 99), min_size=0, max_size=12), min_size=1, max_size=8))
def test_pack_unpack_round_trip(seqs):
    packed = pack_sequences(seqs)
    total = sum(map(len, seqs))
    assert packed.input_ids.shape == packed.position_ids.shape == (1, total)
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist()[-1] == total
    assert packed.lengths == [len(s) for s in seqs]
    assert [t.tolist() for t in unpack(packed.input_ids, packed.cu_seqlens)] == seqs
    positions = [t.tolist() for t in unpack(packed.position_ids[0], packed.cu_seqlens)]
    assert positions == [list(range(len(s))) for s in seqs]
    per_token = torch.randn(1, total, 3)
    assert torch.equal(torch.cat(unpack(per_token, packed.cu_seqlens)), per_token[0])


def test_unpack_rejects_mismatched_shapes():
    packed = pack_sequences([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"expected \(1, 3, ...\)"):
        unpack(torch.zeros(1, 4), packed.cu_seqlens)


def test_pad_sequences_right_and_left():
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_sequences([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=9, side="left")
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def token_logprobs(logits, ids):
    """log p(ids[t+1] | ids[:t+1]) for each t: (len - 1,)."""
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_matches_padded_forward(attn):
    """Position ids restarting per sequence (no mask, no cache) isolate the packed sequences in
    transformers' Llama on CPU; with the KV cache on they do not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 50, (n,), generator=gen) for n in (6, 11, 1, 4)]

    with torch.no_grad():
        ids, mask = pad_sequences(seqs, pad_id=0)
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = [token_logprobs(padded[i, :len(s)], s) for i, s in enumerate(seqs)]

        packed = pack_sequences(seqs)
        logits = model(**packed_forward_kwargs(packed)).logits
        got = [token_logprobs(lg, s) for lg, s in zip(unpack(logits, packed.cu_seqlens), seqs)]

        explicit = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                         attention_mask=block_causal_mask(packed.cu_seqlens), use_cache=False).logits
        got_explicit = [token_logprobs(lg, s) for lg, s in zip(unpack(explicit, packed.cu_seqlens), seqs)]

        cached = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
        got_cached = [token_logprobs(lg, s) for lg, s in zip(unpack(cached, packed.cu_seqlens), seqs)]

    for e, g, x in zip(expected, got, got_explicit):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
        torch.testing.assert_close(x, e, atol=1e-5, rtol=0)
    worst_cached = max((c - e).abs().max().item() for c, e in zip(got_cached, expected) if e.numel())
    assert worst_cached > 1e-3, "with the cache on, packing is expected to leak across sequences"


def test_block_causal_mask_shape_and_blocks():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))[0, 0]
    allowed = (mask == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
