"""`benchmarks/real_scale.py --tiny`: the whole-round benchmark of both drivers runs on a CPU
and writes one results JSON with a section per driver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_real_scale_benchmark_writes_every_section(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer import _clean_env

    out = tmp_path / "real_scale.json"
    # Its own process: the benchmark replaces the drivers' tokenizer loader with its word-level one.
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_scale.py"), "--tiny", "--rounds", "3",
                          "--staged-rounds", "2", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(out)],
                         env=_clean_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"environment", "workload", "command", "in_process", "staged", "colocated"} <= res.keys()
    ip, st = res["in_process"], res["staged"]
    assert "error" not in ip and "error" not in st, (ip.get("traceback"), st.get("traceback"))
    assert [r["round"] for r in ip["per_round"]] == [1, 2, 3] and len(st["per_round"]) == 2
    # save_freq 2 of the tiny workload: round 2 and the last (3) save; one checkpoint is kept
    assert ip["checkpoints_kept"] == ["round_000003"] and ip["checkpoint_bytes"] > 0
    assert all("checkpoint_stall_s" in r for r in ip["per_round"])
    assert all(r["bytes_written"] > 0 for r in st["per_round"]) and st["per_round"][1]["parts_s"]["timing_s/restore"] > 0
    co = res["colocated"]
    assert ip["summary"]["wall_over_compute"] >= 1.0 and "error" not in co, co.get("traceback")
    assert [r["round"] for r in co["per_round"]] == [1, 2, 3] and co["summary"]["wall_over_compute"] >= 1.0
    # save_freq 2: round 2's checkpoint goes to the upload hook once sealed; round 3 closes the segment
    assert [name for name, _ in co["uploaded"]] == ["round_000002"] and co["closing_checkpoint"] == "round_000003"
    # the segment's stall counts its checkpoint step (round 1 reserves the host buffers) and the copy waits
    assert all("timing_s/save_checkpoint" in r["parts_s"] for r in co["per_round"])
    assert co["summary"]["checkpoint_stall_max_s"] == max(r["checkpoint_stall_s"] for r in co["per_round"]) > 0
    assert not (tmp_path / "ck" / "work").exists()
