"""How the tasks move directories on a cluster, against an in-memory object store (fsspec's
`memory://`, which flytekit treats as remote): one download per pod for all its ranks, the
policy output referring into the uploaded checkpoint, older checkpoints removed."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
from flytekit import FlyteContextManager
from flytekit.core.context_manager import ExecutionState
from flytekit.core.data_persistence import FileAccessProvider
from flytekit.core.type_engine import TypeEngine
from flytekit.types.directory import FlyteDirectory

from rlhf.round.state import RoundState


@pytest.fixture
def store(tmp_path):
    """A task context whose raw outputs go to `memory://<test>/raw`, running as on a cluster."""
    fs = fsspec.filesystem("memory")
    root = f"memory://{tmp_path.name}"
    ctx = FlyteContextManager.current_context()
    fa = FileAccessProvider(local_sandbox_dir=str(tmp_path / "sandbox"), raw_output_prefix=f"{root}/raw")
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
    with FlyteContextManager.with_context(ctx.with_file_access(fa).with_execution_state(state)):
        yield fs, root
    fs.rm(f"/{tmp_path.name}", recursive=True)


def _put_tree(fs, root: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        with fs.open(f"{root}/{name}", "w") as f:
            f.write(text)


def test_ranks_of_a_pod_share_one_download(store, monkeypatch, tmp_path):
    """Four rank processes of one pod (forked, as torch elastic starts them) ask for the same
    checkpoint at once: one downloads it, all get the same complete copy."""
    import multiprocessing
    import tempfile

    from tasks import base

    (tmp_path / "pod").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "pod"))  # the pod's own disk

    fs, root = store
    _put_tree(fs, f"{root}/ckpt", {"actor/model.safetensors": "w" * 100, "state.json": "{}"})
    fa = FlyteContextManager.current_context().file_access
    real, log = fa.get_data, tmp_path / "downloads.log"

    def counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{args[0]}\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(fa, "get_data", counted)

    def rank(i: int) -> None:
        (tmp_path / f"rank{i}").write_text(base.local_copy(FlyteDirectory(path=f"{root}/ckpt")))

    ranks = [multiprocessing.get_context("fork").Process(target=rank, args=(i,)) for i in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0] * 4
    assert len(log.read_text().splitlines()) == 1, "more than one rank downloaded the checkpoint"
    paths = {(tmp_path / f"rank{i}").read_text() for i in range(4)}
    assert len(paths) == 1 and (Path(paths.pop()) / "actor" / "model.safetensors").read_text() == "w" * 100


def test_policy_output_refers_into_the_uploaded_checkpoint(store, tmp_path):
    from tasks.update import checkpoint_outputs

    fs, root = store
    local = tmp_path / "round_000002"
    (local / "actor").mkdir(parents=True)
    (local / "actor" / "model.safetensors").write_text("weights")
    (local / "state.json").write_text("{}")
    _put_tree(fs, f"{root}/older", {"state.json": "{}"})
    _put_tree(fs, f"{root}/previous", {"state.json": "{}"})
    state = RoundState(round=2, checkpoints=[f"{root}/older", f"{root}/previous"])

    checkpoint, policy, new = checkpoint_outputs(str(local), state, keep=2)
    ctx = FlyteContextManager.current_context()
    lt = TypeEngine.to_literal_type(FlyteDirectory)
    ckpt_uri = TypeEngine.to_literal(ctx, checkpoint, FlyteDirectory, lt).scalar.blob.uri
    policy_uri = TypeEngine.to_literal(ctx, policy, FlyteDirectory, lt).scalar.blob.uri
    assert policy_uri == f"{ckpt_uri}/actor" and ckpt_uri.endswith("/round_000002")
    weights = [p for p in fs.find(f"/{tmp_path.name}") if p.endswith("model.safetensors")]
    assert len(weights) == 1, f"the weights were stored {len(weights)} times"
    assert new.checkpoints == [f"{root}/previous", ckpt_uri]
    assert not fs.exists(f"{root}/older") and fs.exists(f"{root}/previous/state.json")
