"""The checkpoint step of a round, which the in-process driver and a colocated segment share
(`Run.checkpoint`): every metric goes to the sink once per step, and the writer's host
buffers are allocated before the first save, so that no save copies into fresh memory pages
while the next round's optimizer step waits for it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rlhf.round.state import RoundState
from rlhf.tracking.sinks import NullSink
from test_pipeline import MOVING
from test_trainer import tiny_cfg


class Recorder(NullSink):
    """A sink that keeps every (step, metric) it is given."""

    def __init__(self):
        self.logged: list[tuple[int, str]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged += [(step, k) for k in metrics]


def _cfg(two_rounds: Path, out: Path, *extra: str):
    return tiny_cfg(out, *MOVING, f"model.path={two_rounds / 'base_model'}", "trainer.val_before_train=false",
                    "trainer.test_freq=10", *extra)


def test_each_metric_is_logged_once_per_step(two_rounds, tmp_path):
    """Two in-process rounds, each ending in a checkpoint (before: `timing_s/checkpoint_wait`
    went out twice at every round's last step)."""
    from rlhf.train import Run
    from rlhf.train import stateless as P

    cfg = _cfg(two_rounds, tmp_path / "out", "trainer.total_rounds=2", "trainer.steps_per_round=2")
    data = P.prepare_dataset(cfg.data)
    sink = Recorder()
    run = Run.start(cfg, str(two_rounds / "base_model"), data.train, data.val, None, RoundState.initial(cfg),
                    tmp_path / "out", sink=sink)
    try:
        for _ in range(2):
            run.round()
        run.flush()
    finally:
        run.close()
    twice = [key for key, n in Counter(sink.logged).items() if n > 1]
    assert not twice, f"logged more than once at a step: {twice}"
    steps = {step for step, key in sink.logged if key == "timing_s/checkpoint_wait"}
    assert steps == {1, 2, 3, 4} and {s for s, k in sink.logged if k == "timing_s/save_checkpoint"} == {2, 4}


def test_a_segment_reserves_the_host_buffers_before_its_first_save(two_rounds, tmp_path):
    """A two-round segment whose only save is its closing one: its writer allocates the host
    buffers after round 1, and the closing save copies into those same buffers (before: a
    segment allocated them in its first save, and the next optimizer step waited for the page
    faults: 3.66 s at 1.5B on an H200)."""
    from rlhf.train import stateless as P
    from rlhf.train.segment import run_segment

    cfg = _cfg(two_rounds, tmp_path / "out", "trainer.total_rounds=2", "trainer.rounds_per_segment=2",
               "trainer.save_freq=-1")
    data = P.prepare_dataset(cfg.data)
    seen, sink = {}, Recorder()

    def on_round(run, result) -> None:
        if run.state.round == 1:
            run.writer.wait()  # the reservation runs in the writer's thread
            seen.update(run=run, buffers=dict(run.writer.pool._bufs))

    result = run_segment(cfg, str(two_rounds / "base_model"), data.train, data.val, None, RoundState.initial(cfg),
                         str(tmp_path / "segment"), sink=sink, on_round=on_round)
    assert Path(result.checkpoint).name == "round_000002"
    before, after = seen["buffers"], seen["run"].writer.pool._bufs
    assert before, "no host buffer was allocated before the segment's first save"
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), \
        "the save allocated new host buffers"
    assert not [key for key, n in Counter(sink.logged).items() if n > 1]
    assert {s for s, k in sink.logged if k == "timing_s/save_checkpoint"} == {1, 2}


def test_the_driver_warns_when_its_first_round_scores_nothing(two_rounds, tmp_path, caplog):
    """The answers stored as "N.0" text, which no `#### N` matches: round 1 warns, with examples."""
    import logging

    from rlhf.train import Run
    from rlhf.train import stateless as P

    cfg = _cfg(two_rounds, tmp_path / "out", "trainer.total_rounds=1")
    data = P.prepare_dataset(cfg.data)
    train = data.train.assign(ground_truth=data.train["ground_truth"] + ".0")
    run = Run.start(cfg, str(two_rounds / "base_model"), train, data.val, None, RoundState.initial(cfg),
                    tmp_path / "out")
    try:
        with caplog.at_level(logging.WARNING, logger="rlhf.train"):
            run.update_round()
    finally:
        run.close()
    assert "responses of the first round scored exactly 0" in caplog.text and ".0'" in caplog.text
