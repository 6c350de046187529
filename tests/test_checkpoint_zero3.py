"""ZeRO-3 with 2 gloo ranks: the checkpoint holds the gathered actor and critic (not the
partitioned placeholders a ZeRO-3 module holds on each rank), and a trainer built from it
with the optimizer state restored continues exactly as the one that wrote it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_zero3_checkpoint_saves_gathered_weights_and_restores_on_two_ranks(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer import _clean_env, _free_port

    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(ROOT / "tests" / "zero3_checkpoint.py"),
                          str(tmp_path)], env=_clean_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["world"] == r1["world"] == 2 and r0["complete"]
    assert r0["critic_numel"] == r0["critic_live_numel"] > 1000, "the critic was saved as empty placeholders"
    assert r0["saved_critic_vs_live"] == 0.0 and r0["saved_actor_vs_live"] == 0.0
    assert r0["after_restore"] == 0.0
    assert r0["next_update_moved"] > 0, "the second update changed nothing: the comparison below would be empty"
    assert r0["next_update_actor"] <= 1e-6 and r0["next_update_critic"] <= 1e-6
