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


# -- the house: no import circle, and every import points down ------------------------------------

# Low to high. A module imports only from its own part or the parts before it.
TOP_LAYERS = ("schemas", "rlhf", "tasks", "workflows", "sweeps")
RLHF_LAYERS = ("config", "data", "algos", "models", "rewards", "rollout", "trainer", "round", "checkpoint", "tracking",
               "train")


def module_files(root: Path, packages=TOP_LAYERS) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(root: Path, packages=TOP_LAYERS) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth (lazy imports included).
    `from pkg import name` counts as importing `pkg.name` when that is a module, else `pkg`."""
    files = module_files(root, packages)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in files else known(base))
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower part to a higher one: between the top-level packages, and
    between the subpackages of `rlhf/`."""
    def rank(mod: str) -> tuple[int, int]:
        parts = mod.split(".")
        top = TOP_LAYERS.index(parts[0])
        sub = RLHF_LAYERS.index(parts[1]) if parts[0] == "rlhf" and len(parts) > 1 and parts[1] in RLHF_LAYERS else -1
        return top, sub

    bad = []
    for mod, targets in graph.items():
        (top, sub) = rank(mod)
        for t in sorted(targets):
            t_top, t_sub = rank(t)
            if t_top > top or (t_top == top == TOP_LAYERS.index("rlhf") and t_sub > sub >= 0):
                bad.append(f"{mod} -> {t}")
    return bad


def test_every_rlhf_subpackage_has_a_layer():
    subs = sorted(p.name for p in (ROOT / "rlhf").iterdir() if (p / "__init__.py").exists())
    assert subs == sorted(RLHF_LAYERS), "a subpackage of rlhf/ is missing from RLHF_LAYERS (or gone)"
    loose = sorted(p.name for p in (ROOT / "rlhf").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules loose at the top of rlhf/: {loose}; put each in the part it belongs to"


def test_no_import_cycle():
    cycles = import_cycles(import_graph(ROOT))
    assert not cycles, f"import circles: {cycles}"


def test_imports_point_down():
    bad = upward_imports(import_graph(ROOT))
    assert not bad, f"imports from a lower part to a higher one: {bad}"


def test_layer_checks_see_a_circle_and_an_upward_import(tmp_path: Path):
    """The detectors on a small tree with both faults: a circle through a lazy import and a
    subpackage-level climb, and a top-level climb (tasks -> sweeps)."""
    files = {
        "rlhf/__init__.py": "",
        "rlhf/config/__init__.py": "from rlhf.config.a import X\n",
        "rlhf/config/a.py": "def f():\n    from rlhf.config import X\n",
        "rlhf/data/__init__.py": "",
        "rlhf/data/io.py": "from rlhf.round import stages\n",
        "rlhf/round/__init__.py": "",
        "rlhf/round/stages.py": "from . import helpers\nfrom rlhf.data.io import read\n",
        "rlhf/round/helpers.py": "",
        "tasks/__init__.py": "",
        "tasks/t.py": "import sweeps.s\n",
        "sweeps/__init__.py": "",
        "sweeps/s.py": "from tasks import t\n",
        "schemas/__init__.py": "", "workflows/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["rlhf.round.stages"] == {"rlhf.round.helpers", "rlhf.data.io"}
    assert sorted(map(tuple, import_cycles(graph))) == [
        ("rlhf.config", "rlhf.config.a"), ("rlhf.data.io", "rlhf.round.stages"), ("sweeps.s", "tasks.t")]
    assert upward_imports(graph) == ["rlhf.data.io -> rlhf.round.stages", "tasks.t -> sweeps.s"]


# -- the depth: a workflow reaches the lowest module through few others ------------------------

# Modules on the longest import chain from a `workflows.*` or `sweeps.*` module, both ends
# counted (lazy imports included, as everywhere in this file). A longer chain is a seam to
# cut: import from the defining module, or move the shared piece down.
MAX_CHAIN = 10


def longest_chain(graph: dict[str, set[str]], start: str) -> list[str]:
    """The longest import chain from `start` ([start] when it imports nothing); a module
    already on the chain is not entered again, so a circle cannot loop."""
    memo: dict[str, list[str]] = {}

    def walk(mod: str, path: frozenset[str]) -> list[str]:
        if mod not in memo:
            below = [walk(t, path | {mod}) for t in sorted(graph.get(mod, ())) if t not in path]
            memo[mod] = [mod] + max(below, key=len, default=[])
        return memo[mod]

    return walk(start, frozenset())


def long_chains(graph: dict[str, set[str]], limit: int = MAX_CHAIN, tops=("workflows", "sweeps")) -> list[list[str]]:
    """The longest chain from each module of `tops` that is longer than `limit`, longest first."""
    chains = [longest_chain(graph, m) for m in sorted(graph) if m.split(".")[0] in tops]
    return sorted((c for c in chains if len(c) > limit), key=len, reverse=True)


def test_import_chains_from_workflows_are_short():
    bad = long_chains(import_graph(ROOT))
    assert not bad, f"import chains longer than {MAX_CHAIN} modules:\n" + "\n".join(
        f"{len(c)}: {' -> '.join(c)}" for c in bad)


def test_chain_check_sees_a_long_chain(tmp_path: Path):
    """A workflow four modules above its lowest module, through a package `__init__` and a
    lazy import: over a limit of 3, within a limit of 4."""
    files = {
        "workflows/__init__.py": "", "workflows/w.py": "from tasks.t import task\n",
        "tasks/__init__.py": "", "tasks/t.py": "def task():\n    from rlhf.data import read\n",
        "rlhf/__init__.py": "", "rlhf/data/__init__.py": "from rlhf.data.io import read\n", "rlhf/data/io.py": "",
        "schemas/__init__.py": "", "sweeps/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert longest_chain(graph, "workflows.w") == ["workflows.w", "tasks.t", "rlhf.data", "rlhf.data.io"]
    assert long_chains(graph, limit=3) == [["workflows.w", "tasks.t", "rlhf.data", "rlhf.data.io"]]
    assert long_chains(graph, limit=4) == []
