"""HFRolloutEngine: grouping, greedy against a reference decode, EOS/max_tokens, log-probs, weights."""

import pytest
import torch

from rlhf.config import RolloutConfig, SFTConfig
from rlhf.trainer.sft import sft_warm_start
from rlhf.rollout import ENGINES, make_engine
from rlhf.rollout.base import RolloutEngine, SamplingParams
from rlhf.rollout.hf import HFRolloutEngine, filter_logits, plan_batches

from tests.tiny import small_model
PROMPTS = ["1+2=", "37+45=", "9+9=", "12+3=", "5+60=", "1+1=", "88+7="]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tok):
    """Briefly trained to copy the first operand ("37+45=" -> "#### 37"): varied answers, then EOS."""
    torch.set_num_threads(1)
    m = small_model(tok, seed=0)
    prompts = [f"{a}+{b}=" for a in range(0, 40, 3) for b in range(0, 40, 7)]
    sft_warm_start(m, tok, prompts, [f"#### {p.split('+')[0]}" for p in prompts],
                   SFTConfig(max_steps=60, batch_size=16, lr=2e-2, warmup_steps=5, stop_at_accuracy=0.0),
                   seed=0, progress=False)
    return m


def ids_of(tok, texts=PROMPTS):
    return [tok(t)["input_ids"] for t in texts]


def reference_greedy(model, prompt, max_tokens, eos_id):
    """Step-by-step argmax over the full sequence, no cache, no padding."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt == eos_id:
                break
    return out


def test_engine_meets_the_protocol_and_groups_n_responses_per_prompt(model, tok):
    engine = HFRolloutEngine(model, tok, batch_size=5)
    assert isinstance(engine, RolloutEngine)
    prompts = ids_of(tok)[:3]
    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=0))
    assert len(batch) == 12
    assert batch.group_ids == [0] * 4 + [1] * 4 + [2] * 4 == batch.prompt_index
    assert batch.prompt_ids == [p for p in prompts for _ in range(4)]
    assert [len(x) for x in batch.logprobs] == [len(r) for r in batch.response_ids]
    assert batch.response_text == [tok.decode(r, skip_special_tokens=True) for r in batch.response_ids]


def test_greedy_equals_reference_argmax_decode_and_is_deterministic(model, tok):
    engine = HFRolloutEngine(model, tok, batch_size=3)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    first = engine.generate(ids_of(tok), params)
    again = engine.generate(ids_of(tok), params)
    assert first.response_ids == again.response_ids
    want = [reference_greedy(model, p, 10, tok.eos_token_id) for p in ids_of(tok)]
    assert first.response_ids == want
    assert len(set(map(tuple, want))) > 2  # the reference is not trivial


def test_stops_at_eos_per_sequence_and_respects_max_tokens(model, tok):
    engine = HFRolloutEngine(model, tok, batch_size=8)
    batch = engine.generate(ids_of(tok), SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3))
    assert "stop" in batch.finish_reason
    for ids, reason in zip(batch.response_ids, batch.finish_reason):
        assert ids.count(tok.eos_token_id) == (reason == "stop")
        assert reason == "length" and len(ids) == 12 or reason == "stop" and ids[-1] == tok.eos_token_id
    short = engine.generate(ids_of(tok), SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=3))
    assert all(len(r) <= 3 for r in short.response_ids)
    assert all(len(r) == 3 for r, f in zip(short.response_ids, short.finish_reason) if f == "length")


def teacher_forced_logprobs(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1: len(prompt) - 1 + len(response)]
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9), (0.0, -1, 1.0)])
def test_logprobs_match_teacher_forced_log_softmax(model, tok, temperature, top_k, top_p):
    engine = HFRolloutEngine(model, tok, batch_size=4)
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10, seed=7)
    batch = engine.generate(ids_of(tok), params)
    for p, r, lp in zip(batch.prompt_ids, batch.response_ids, batch.logprobs):
        want = teacher_forced_logprobs(model, p, r, temperature or 1.0)
        assert torch.allclose(torch.tensor(lp), want, atol=1e-5)


def test_length_sorted_batches_give_the_same_greedy_results(model, tok):
    prompts = ids_of(tok)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    sorted_ = HFRolloutEngine(model, tok, batch_size=3, sort_by_length=True).generate(prompts, params)
    unsorted = HFRolloutEngine(model, tok, batch_size=3, sort_by_length=False).generate(prompts, params)
    one_by_one = HFRolloutEngine(model, tok, batch_size=1).generate(prompts, params)
    assert sorted_.response_ids == unsorted.response_ids == one_by_one.response_ids
    assert plan_batches([2, 5, 3, 5], 2) == [[1, 3], [2, 0]]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model, tok):
    engine = HFRolloutEngine(model, tok, batch_size=4)
    run = lambda seed: engine.generate(ids_of(tok), SamplingParams(n=3, temperature=1.5, max_tokens=8,
                                                                   seed=seed)).response_ids
    assert run(11) == run(11)
    assert run(11) != run(12)


def test_top_k_one_samples_the_greedy_tokens(model, tok):
    engine = HFRolloutEngine(model, tok, batch_size=4)
    greedy = engine.generate(ids_of(tok), SamplingParams(temperature=0.0, max_tokens=8))
    top1 = engine.generate(ids_of(tok), SamplingParams(temperature=1.3, top_k=1, max_tokens=8, seed=0))
    assert greedy.response_ids == top1.response_ids


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    # nucleus 0.7: 0.5 alone is below it, 0.5 + 0.3 reaches it, so two tokens stay
    assert torch.isinf(filter_logits(logits, top_k=-1, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=-1, top_p=0.01)).tolist() == [[False, True, True, True]]


def test_update_weights_and_set_model_switch_the_policy(model, tok, tmp_path):
    other = small_model(tok, seed=5)
    other.save_pretrained(tmp_path / "other")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine = HFRolloutEngine(small_model(tok, seed=0), tok, batch_size=4)
    engine.set_model(model)
    before = engine.generate(ids_of(tok), params).response_ids
    assert before == HFRolloutEngine(model, tok).generate(ids_of(tok), params).response_ids
    engine.set_model(small_model(tok, seed=0))  # keep the shared fixture's weights untouched
    engine.update_weights(str(tmp_path / "other"))
    after = engine.generate(ids_of(tok), params).response_ids
    assert after == [reference_greedy(other, p, 8, tok.eos_token_id) for p in ids_of(tok)]
    assert after != before


def test_make_engine_builds_hf_from_a_dir_and_names_the_known_engines(model, tok, tmp_path):
    model.save_pretrained(tmp_path / "policy")
    engine = make_engine("hf", str(tmp_path / "policy"), tok, RolloutConfig(generate_batch_size=2), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert engine.generate(ids_of(tok), params).response_ids == \
        HFRolloutEngine(model, tok).generate(ids_of(tok), params).response_ids
    assert ENGINES.names() == ["hf", "hf_fast", "vllm"]
    with pytest.raises(KeyError, match="known: hf, hf_fast, vllm"):
        make_engine("sglang", str(tmp_path / "policy"), tok, RolloutConfig())


def test_generate_leaves_a_shared_training_module_in_train_mode(tok):
    policy = small_model(tok).train()
    HFRolloutEngine(policy, tok).generate([[1, 5, 6]], SamplingParams(max_tokens=3, seed=0))
    assert policy.training
    loss = policy(torch.tensor([[1, 5, 6, 7]])).logits.sum()
    loss.backward()  # the module still trains after generating with it
    assert policy.model.embed_tokens.weight.grad is not None


def test_generate_refuses_empty_prompts_and_bad_params(model, tok):
    engine = HFRolloutEngine(model, tok)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 5], []], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 5]], SamplingParams(top_p=0.0))


def test_score_metrics_by_source_and_overall():
    from rlhf.round.evaluate import score_metrics

    m = score_metrics(["a", "b", "a", "a"], [1.0, 0.0, 0.0, 0.1], [3, 4, 5, 4], full_score=1.0)
    assert m["val-core/a/reward/mean@1"] == pytest.approx(1.1 / 3)
    assert m["val-core/b/reward/mean@1"] == 0.0
    assert m["val/reward/mean"] == pytest.approx(1.1 / 4)
    assert m["val/accuracy"] == 0.25  # a format-only score is not a correct answer
    assert m["val/response_length/mean"] == 4.0 and m["val/n"] == 4


def test_evaluate_greedy_scores_greedy_answers_with_the_reward_rules(model, tok):
    import json
    import re

    import pandas as pd

    from rlhf.config import RewardConfig
    from rlhf.round.evaluate import evaluate_greedy

    engine = HFRolloutEngine(model, tok, batch_size=4)
    prompts = [f"{a}+{b}=" for a in range(1, 60, 4) for b in (2, 9)]
    texts = engine.generate(ids_of(tok, prompts), SamplingParams(temperature=0.0, max_tokens=8)).response_text
    answers = [re.fullmatch(r"#### (\d+)", t) for t in texts]
    rows = [(p, m.group(1)) for p, m in zip(prompts, answers) if m][:8]
    assert len(rows) == 8, texts
    # half the rows are labeled with the model's own answer, half with a wrong one
    truths = [ans if i % 2 == 0 else str(int(ans) + 1) for i, (_, ans) in enumerate(rows)]
    sources = ["synthetic/arithmetic"] * 4 + ["openai/gsm8k"] * 4
    df = pd.DataFrame({"prompt": [p for p, _ in rows], "data_source": sources, "ability": "math",
                       "reward_style": "rule", "ground_truth": truths,
                       "extra_info": [json.dumps({"index": i}) for i in range(8)]})
    metrics = evaluate_greedy(engine, tok, df, max_prompt_length=16, max_response_length=8,
                              reward_cfg=RewardConfig())
    assert metrics["val/accuracy"] == 0.5
    assert metrics["val-core/synthetic/arithmetic/reward/mean@1"] == 0.5
    assert metrics["val-core/openai/gsm8k/reward/mean@1"] == 0.5
    assert metrics["val/n"] == 8


def test_stop_tokens_include_the_generation_config_eos_ids(tok):
    from rlhf.rollout.hf import cut_at_stop, stop_token_ids

    policy = small_model(tok)
    policy.generation_config.eos_token_id = [2, 7]
    assert stop_token_ids(policy, 2) == [2, 7]
    rows = cut_at_stop([[5, 7, 2, 0], [5, 5, 5, 5]], [[-1.0, -2.0, -3.0, -4.0]] * 2, [2, 7])
    assert rows == [([5, 7], [-1.0, -2.0], "stop"), ([5, 5, 5, 5], [-1.0, -2.0, -3.0, -4.0], "length")]
