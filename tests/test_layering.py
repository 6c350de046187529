"""Imports point down only: the engine (`rlhf/`) and the schemas never import flytekit,
and importing them does not load it (nor the heavy optional engines)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PACKAGES = ("rlhf", "schemas")
ORCHESTRATION = ("flytekit", "flytekitplugins", "tasks", "workflows", "sweeps", "containers")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import statement in a file, at any depth (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def engine_files() -> list[Path]:
    return sorted(p for pkg in ENGINE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_engine_files_exist():
    assert len(engine_files()) > 20, "the engine packages were not found where the layering test looks"


@pytest.mark.parametrize("path", engine_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_never_imports_orchestration(path: Path):
    bad = [(line, mod) for line, mod in imported_modules(path) if mod.split(".")[0] in ORCHESTRATION]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the engine must not depend on the Flyte layers"


def test_import_detector_sees_nested_imports(tmp_path: Path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef g():\n    from flytekit import task\n    import flytekitplugins.pandera\n")
    mods = [m for _, m in imported_modules(f)]
    assert mods == ["os", "flytekit", "flytekitplugins.pandera"]


def test_importing_the_engine_loads_no_flytekit_or_heavy_engines():
    code = ("import sys, rlhf, rlhf.train.stateless, rlhf.train, rlhf.round.stages, rlhf.tracking.plots, rlhf.tracking.model_registry, schemas;"
            "print(sorted(m for m in ('flytekit', 'vllm', 'deepspeed', 'mlflow', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
