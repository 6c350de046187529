"""Round checkpoints: digests checked on resume, written in the background the same as in the
foreground, at `trainer.save_freq` and pruned to `trainer.max_ckpt_to_keep` by both drivers,
never sealed when the writer dies, and DeepSpeed's timer kept out of the rollout's forward."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rlhf.checkpoint import rounds as ckpt
from rlhf.checkpoint.writer import CheckpointWriter
from test_pipeline import MOVING, base_model, cfg_for  # noqa: F401  (base_model is a fixture)
from test_trainer import tiny_cfg


def _flip_a_byte(f: Path, at: int | None = None) -> None:
    """Change one byte in place: the file keeps its size."""
    data = bytearray(f.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _copy_run(src: Path, dest: Path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(src, dest)
    prev, last = sorted(ckpt.checkpoint_root(dest).glob("round_*"))
    return prev, last


# -- digests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["actor/model.safetensors", "engine/critic"])
def test_a_file_changed_in_place_at_the_same_size_is_rejected_and_resume_falls_back(two_rounds, tmp_path, caplog,
                                                                                    target):
    from rlhf.train import Run

    out = tmp_path / "out"
    prev, last = _copy_run(two_rounds, out)
    f = last / target
    if f.is_dir():  # the largest file of DeepSpeed's state
        f = max((p for p in f.rglob("*.pt")), key=lambda p: p.stat().st_size)
    size = f.stat().st_size
    _flip_a_byte(f)
    assert f.stat().st_size == size
    assert ckpt.is_complete(last, checksums=False), "sizes alone cannot see the change"
    name = str(f.relative_to(last))
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"{name} does not match its .* digest"):
        ckpt.verify(last)
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        assert ckpt.latest_checkpoint(out) == prev
    assert str(last) in caplog.text and name in caplog.text and "contents changed" in caplog.text
    r = Run(tiny_cfg(out, "trainer.total_rounds=2", *MOVING))
    try:
        assert r.resumed_from == str(prev) and r.state.round == 1
    finally:
        r.close()


def test_manifest_lists_every_file_with_size_and_digest(two_rounds):
    import json

    last = ckpt.latest_checkpoint(two_rounds)
    manifest = json.loads((last / ckpt.MANIFEST_FILE).read_text())
    files = {str(p.relative_to(last)) for p in last.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST_FILE}
    assert set(manifest["files"]) == files and not any(n.startswith(".") for n in files)  # no writer markers
    from rlhf.checkpoint.pieces import file_digest

    for name, entry in manifest["files"].items():
        assert entry["size"] == (last / name).stat().st_size
        assert entry["digest"] == file_digest(last / name, manifest["digest"])


def test_no_weight_is_stored_twice(two_rounds):
    """The safetensors hold the weights; DeepSpeed's model-states file holds none."""
    from rlhf.checkpoint.engine_state import load_weights_only

    last = ckpt.latest_checkpoint(two_rounds)
    for name in ("actor", "critic"):
        (states,) = (last / ckpt.ENGINE_DIR / name).rglob("*model_states.pt")
        assert load_weights_only(str(states))["module"] == {}
    from safetensors import safe_open

    keys = set(safe_open(str(last / "actor" / ckpt.WEIGHTS_FILE), "pt").keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # tied: stored once


# -- background and foreground saves ------------------------------------------------------------


@pytest.fixture(scope="module")
def live_run(two_rounds, tmp_path_factory):
    from rlhf.train import Run

    out = tmp_path_factory.mktemp("live") / "out"
    _copy_run(two_rounds, out)
    r = Run(tiny_cfg(out, "trainer.total_rounds=2", *MOVING))
    yield r
    r.close()


def test_background_save_writes_the_same_files_as_a_foreground_save(live_run, tmp_path):
    r = live_run
    fg = ckpt.save(tmp_path / "fg" / "round_000002", r.trainer, r.tokenizer, r.cfg, r.state)
    writer = CheckpointWriter()
    bg = ckpt.save(tmp_path / "bg" / "round_000002", r.trainer, r.tokenizer, r.cfg, r.state, writer=writer)
    writer.close()
    names = sorted(str(p.relative_to(fg)) for p in fg.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(bg)) for p in bg.rglob("*") if p.is_file())
    for n in names:
        assert (fg / n).read_bytes() == (bg / n).read_bytes(), n
    assert ckpt.is_complete(bg) and not list(bg.parent.glob(".tmp_*"))


def test_saved_models_load_as_save_pretrained_wrote_them(live_run, tmp_path):
    """The actor and critic directories read back with the project's loaders and equal the
    live modules; the actor's tensors are those `save_pretrained` keeps."""
    from safetensors.torch import load_file

    from rlhf.models.load import ValueModel, load_causal_lm

    r = live_run
    path = ckpt.save(tmp_path / "round_000002", r.trainer, r.tokenizer, r.cfg, r.state)
    r.trainer.actor.module.save_pretrained(str(tmp_path / "hf"))
    ours, theirs = load_file(str(path / "actor" / ckpt.WEIGHTS_FILE)), load_file(str(tmp_path / "hf" / ckpt.WEIGHTS_FILE))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    actor = load_causal_lm(str(path / "actor"))
    critic = ValueModel.from_pretrained(str(path / "critic"))
    for loaded, live in ((actor, r.trainer.actor.module), (critic, r.trainer.critic.module)):
        want = live.state_dict()
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, want[k]), k


def test_a_writer_that_dies_leaves_no_sealed_checkpoint(live_run, tmp_path, monkeypatch, caplog):
    """The writer thread fails after its first file: the error reaches the training thread,
    nothing is renamed into place, and resume takes the previous checkpoint."""
    import rlhf.checkpoint.writer as io

    r = live_run
    out = tmp_path / "out"
    prev, _ = _copy_run(r.out, out)
    final = ckpt.checkpoint_root(out) / "round_000003"
    written = []
    real_write = io._write

    def dying_write(path, kind, tree, digest):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        return real_write(path, kind, tree, digest)

    monkeypatch.setattr(io, "_write", dying_write)
    writer = CheckpointWriter()
    ckpt.save(final, r.trainer, r.tokenizer, r.cfg, r.state, writer=writer)
    with pytest.raises(RuntimeError, match="writing a checkpoint failed: OSError.*No space left"):
        writer.wait()
    writer.close()
    tmp = final.parent / f".tmp_{final.name}"
    assert not final.exists() and tmp.is_dir() and not (tmp / ckpt.MANIFEST_FILE).exists()
    assert (tmp / ".failed.rank0").is_file() and written
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        assert ckpt.latest_checkpoint(out).name == "round_000002"
    assert "half-written" in caplog.text


def test_an_optimizer_step_waits_for_the_copy_of_the_state(live_run, tmp_path, monkeypatch):
    """While the writer still copies, the next optimizer step blocks: the saved weights are
    those at save time although the step changed them right after `save` returned."""
    import threading

    import rlhf.checkpoint.writer as io

    r = live_run
    gate = threading.Event()
    real_copy = io.HostPool.copy

    def slow_copy(self, tree, key="", fill=True):
        gate.wait(timeout=30)
        return real_copy(self, tree, key, fill)

    monkeypatch.setattr(io.HostPool, "copy", slow_copy)
    before = {k: v.clone() for k, v in r.trainer.actor.module.state_dict().items()}
    writer = CheckpointWriter()
    final = ckpt.save(tmp_path / "round_000009", r.trainer, r.tokenizer, r.cfg, r.state, writer=writer)
    opt = torch.optim.SGD([p for p in r.trainer.actor.module.parameters()], lr=1.0)
    for p in r.trainer.actor.module.parameters():
        p.grad = torch.ones_like(p)
    threading.Timer(0.5, gate.set).start()
    opt.step()  # waits for the copy, then changes every weight
    for p in r.trainer.actor.module.parameters():
        p.grad = None
    writer.close()
    assert writer.stalled_s >= 0.3
    from safetensors.torch import load_file

    saved = load_file(str(final / "actor" / ckpt.WEIGHTS_FILE))
    for k, v in saved.items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():  # the module fixture's weights back as they were
        for k, p in r.trainer.actor.module.named_parameters():
            p.copy_(before[k])


# -- save_freq and max_ckpt_to_keep ------------------------------------------------------------


def test_save_points_follow_save_freq_and_the_last_round():
    from rlhf.config import TrainerConfig

    tc = TrainerConfig(total_rounds=12, save_freq=5)
    assert [r for r in range(1, 13) if ckpt.is_save_point(tc, r)] == [5, 10, 12]
    never = TrainerConfig(total_rounds=4, save_freq=-1)  # verl's -1: no checkpoint, not even the last
    assert not any(ckpt.is_save_point(never, r) or ckpt.should_save(never, r, stopping=True) for r in range(1, 5))
    assert ckpt.should_save(tc, 3, stopping=True) and not ckpt.should_save(tc, 3, stopping=False)


def test_prune_keeps_the_newest_save_points_and_the_newest_checkpoint(tmp_path):
    for r in range(1, 8):
        (tmp_path / ckpt.round_dir_name(r)).mkdir()
    ckpt.prune_dir(tmp_path, 2, lambda r: r % 3 == 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000003", "round_000006", "round_000007"]
    ckpt.prune_dir(tmp_path, 0)  # <= 0 keeps all
    assert len(list(tmp_path.iterdir())) == 3


def test_save_freq_value_is_checked():
    from rlhf.config import ConfigError, load_config

    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match=r"'trainer.save_freq' is -?\d+; it must be in -1 or \[1, inf\)"):
            load_config(None, [f"trainer.save_freq={bad}"])
    assert load_config(None, ["trainer.save_freq=-1"]).trainer.save_freq == -1


def test_in_process_driver_saves_at_save_freq_and_keeps_max_ckpt_to_keep(tmp_path, base_model):  # noqa: F811 (fixture)
    """5 rounds, save_freq 2, keep 2: checkpoints after rounds 2, 4 and 5 (the last); 4 and 5 stay."""
    from rlhf.train import Run

    cfg = cfg_for(tmp_path, base_model, "trainer.total_rounds=5", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=2",
                  "trainer.val_before_train=false", "trainer.test_freq=10")
    run, seen, buffers = Run(cfg), [], []
    try:
        for _ in range(5):
            run.round()
            run.flush()
            seen.append(sorted(p.name for p in ckpt.checkpoint_root(tmp_path).glob("round_*")))
            buffers.append({k: v.data_ptr() for k, v in run.writer.pool._bufs.items()})
    finally:
        run.close()
    assert seen == [[], ["round_000002"], ["round_000002"], ["round_000002", "round_000004"],
                    ["round_000004", "round_000005"]]
    # The host buffers, allocated after round 1 (before any save), are the ones every save copies into.
    assert len(buffers[0]) > 10 and all(b == buffers[0] for b in buffers)
    assert any(k.endswith("exp_avg_sq") for k in buffers[0]), "the optimizer moments have no buffers"
    assert not list(ckpt.checkpoint_root(tmp_path).glob(".tmp_*"))


def test_staged_driver_prunes_its_handoff_checkpoints(tmp_path, base_model):  # noqa: F811 (fixture)
    """The stateless update writes every round (the next one starts from it); under one
    out_dir the newest stays and, of the save points (save_freq 2), the newest one; the
    round's profiler trace lands inside the checkpoint it returns."""
    from rlhf.train import stateless as P
    from rlhf.round import stages
    from rlhf.round.state import RoundState

    cfg = cfg_for(tmp_path, base_model, "trainer.total_rounds=10", "trainer.save_freq=2",
                  "trainer.max_ckpt_to_keep=1", "trainer.profile_steps=[3]")
    data = P.prepare_dataset(cfg.data)
    state, checkpoint, kept = RoundState.initial(cfg), None, []
    out = tmp_path / "staged"
    for _ in range(3):
        prompts, state = stages.sample_prompts(data.train, state, cfg)
        scored = P.score_rollouts(cfg, P.rollout_policy(cfg, checkpoint and f"{checkpoint}/actor" or base_model,
                                                        prompts, state)[0])
        res = P.update_from_checkpoint(cfg, base_model, checkpoint, scored, state, str(out))
        state, checkpoint = res.state, res.checkpoint
        kept.append(sorted(p.name for p in out.iterdir()))
        assert {"timing_s/build_trainer", "timing_s/restore", "timing_s/update", "timing_s/save_checkpoint"} \
            <= res.timing.keys()
    assert kept == [["round_000001"], ["round_000002"], ["round_000002", "round_000003"]]
    trace = Path(checkpoint) / "profile" / "step_3"
    assert any(p.name.startswith("trace") for p in trace.iterdir()) and ckpt.is_complete(Path(checkpoint))
    _flip_a_byte(Path(checkpoint) / "critic" / ckpt.WEIGHTS_FILE)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"critic/model.safetensors does not match .*trainer.resume"):
        P.update_from_checkpoint(cfg, base_model, checkpoint, scored, state, str(out))


# -- DeepSpeed's throughput timer ---------------------------------------------------------------


def _syncs_in_a_plain_forward(monkeypatch, ds_cfg: dict) -> int:
    """Device synchronizations in a forward of the engine's module (what a rollout engine
    that shares it runs, e.g. inside CUDA-graph capture) after three training steps."""
    from deepspeed.accelerator import get_accelerator

    from rlhf.models.tiny import build_tiny_model
    from rlhf.trainer import dist as D
    from rlhf.trainer.engines import build_engine
    from tiny import SMALL

    D.init_distributed(torch.device("cpu"))
    model = build_tiny_model(SMALL, 40, 0, 1, 2, seed=0)
    engine = build_engine(model, ds_cfg)
    ids = torch.randint(3, 40, (2, 6))
    for _ in range(3):
        loss = engine(input_ids=ids).logits.float().mean()
        engine.backward(loss)
        engine.step()
    calls = []
    acc = get_accelerator()
    monkeypatch.setattr(acc, "synchronize", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        engine.module.eval()
        engine.module(input_ids=ids)
    return len(calls)


def test_the_trainer_module_forward_never_synchronizes_the_device(monkeypatch):
    from rlhf.config import load_config
    from rlhf.trainer.engines import ds_config

    cfg = load_config(None, ["trainer.device=cpu"])
    ours = ds_config(cfg, 1e-3, 0.0, 1.0, 2, torch.device("cpu"))
    assert _syncs_in_a_plain_forward(monkeypatch, ours) == 0
    # DeepSpeed's default (the timer on) synchronizes there from its second step: what broke
    # hf_fast's CUDA-graph capture on the GPU.
    default = {k: v for k, v in ours.items() if k != "timers"}
    assert _syncs_in_a_plain_forward(monkeypatch, default) >= 1


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_new_weights_in_rounds_without_a_checkpoint(tmp_path):
    """save_freq 5: round 1 writes no checkpoint, and vLLM still serves the updated policy
    (the actor's weights, handed to the engine in memory)."""
    pytest.importorskip("vllm")
    from rlhf.round import stages
    from rlhf.models.load import load_causal_lm
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.hf import HFRolloutEngine
    from rlhf.train import Run

    cfg = tiny_cfg(tmp_path, "rollout.name=vllm", "model.tiny.hidden_size=64", "actor.lr=2e-2",
                   "actor.entropy_coeff=0.05", "trainer.total_rounds=3", "trainer.save_freq=5")
    r = Run(cfg)
    try:
        r.round()
        r.flush()
        assert not list(ckpt.checkpoint_root(tmp_path).glob("round_*"))
        prompts = stages.tokenize(r.data.val.head(16), r.tokenizer, cfg)
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.data.max_response_length)
        served = r.engine.generate(prompts, greedy).response_ids
        live = HFRolloutEngine(r.trainer.actor.module, r.tokenizer).generate(prompts, greedy)
        base = HFRolloutEngine(load_causal_lm(r.base_dir), r.tokenizer).generate(prompts, greedy)
    finally:
        r.close()
    assert served == live.response_ids
    assert live.response_ids != base.response_ids, "the update did not change the greedy policy; test is vacuous"
