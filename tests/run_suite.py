"""The whole suite on both cores: `make test` runs this.

Most tests run on one torch thread, so one pytest process leaves the second core of a
2-core machine idle. The files in `BESIDE` need no server, no shared model cache, no
PostgreSQL and no process group (hypothesis property tests, the Triton kernels under Triton's
interpreter, the SFT warm-start's phase change, and the local Flyte executions of segments,
workflows, the offline workflow, `--help` and the damaged-checkpoint launches): they run in a second pytest process beside the
rest, chosen so that both take about as long, and their report is printed after the main one.
The exit status is non-zero when either process fails.

    python tests/run_suite.py                 # the split run (what make test does)
    python tests/run_suite.py -k checkpoint   # any pytest arguments: one plain pytest run
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BESIDE = ["tests/test_properties.py", "tests/test_triton_kernels.py", "tests/test_sft.py", "tests/test_segment.py",
          "tests/test_tasks_workflows.py", "tests/test_offline.py", "tests/test_flyte_help.py",
          "tests/test_checkpoint_paths.py"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900"]


def main(argv: list[str]) -> int:
    if argv:  # a chosen selection: one process, as pytest itself would run it
        return subprocess.call([*PYTEST, *argv], cwd=ROOT)
    log = ROOT / ".cache" / "test-beside.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        beside = subprocess.Popen([*PYTEST, *BESIDE], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            main_rc, main_failures = _run_echoing([*PYTEST, *(f"--ignore={f}" for f in BESIDE)])
        finally:
            beside_rc = beside.wait()
    print(f"\n--- {' '.join(BESIDE)} (run beside the rest; log {log.relative_to(ROOT)}) ---", flush=True)
    beside_text = log.read_text()
    print(beside_text, end="", flush=True)
    failures = main_failures + _failure_lines(beside_text.splitlines())
    if failures:  # last, so that a log cut to its tail still names every failed test
        print(f"--- {len(failures)} failed or in error (both runs) ---", flush=True)
        print("\n".join(failures), flush=True)
    status = "passed" if main_rc == 0 and beside_rc == 0 else "FAILED"
    print(f"--- suite {status}: main run exit {main_rc}, beside run exit {beside_rc}, "
          f"{time.monotonic() - t0:.0f} s in all ---", flush=True)
    return 1 if main_rc or beside_rc else 0


def _failure_lines(lines) -> list[str]:
    """pytest's short summary lines of failed and erroring tests."""
    return [line.rstrip() for line in lines if line.startswith(("FAILED ", "ERROR "))]


def _run_echoing(cmd: list[str]) -> tuple[int, list[str]]:
    """Run pytest with its output passed straight through; return its exit status and failure lines."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), _failure_lines(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
