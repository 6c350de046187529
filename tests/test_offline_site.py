"""benchmarks/offline_site.py: which requirements of a wheel the offline install tree follows."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline_site as O  # noqa: E402

METADATA = """Metadata-Version: 2.1
Name: demo
Version: 1.0
Requires-Dist: pydantic>=2
Requires-Dist: pycountry>=23; extra == "pycountry"
Requires-Dist: tzdata; sys_platform == "win32"
Requires-Dist: numpy<3; python_version >= "3.12"
Requires-Dist: mistral-common[image]>=1.0
"""


def _wheel(tmp_path: Path) -> Path:
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", METADATA)
    return path


def test_requirements_for_linux_python_312_and_the_requested_extras(tmp_path):
    wheel = _wheel(tmp_path)
    plain = [O._spec(r) for r in O.requires(wheel, set())]
    assert plain == ["pydantic", "numpy", "mistral-common[image]"]  # no Windows-only, no extra-only
    assert "pycountry" in [O._spec(r) for r in O.requires(wheel, {"pycountry"})]


def test_a_requirement_names_its_extras_for_the_walk():
    assert O._spec(Requirement('pydantic-extra-types[pycountry]>=2; python_version >= "3.8"')) == \
        "pydantic-extra-types[pycountry]"


def test_the_real_model_tree_leaves_out_what_the_benchmark_never_imports(tmp_path):
    import hashlib
    import tarfile

    site = tmp_path / "site"
    for name in ("vllm", "kubernetes", "trl", "deepspeed"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"NAME = {name!r}\n")
    (site / "trl-1.16.0.dist-info").mkdir()
    O.pack(tmp_path, real_model=True)
    with tarfile.open(tmp_path / "site_rm.tar.xz") as t:
        tops = {Path(m.name).parts[1] for m in t.getmembers() if len(Path(m.name).parts) > 1}
    assert tops == {"trl", "deepspeed", "trl-1.16.0.dist-info"}
    with tarfile.open(tmp_path / "site.tar.xz.00") as t:  # the whole tree still holds everything
        assert {"vllm", "kubernetes"} <= {Path(m.name).parts[1] for m in t.getmembers() if len(Path(m.name).parts) > 1}
    sums = dict(line.split()[::-1] for line in (tmp_path / "SHA256SUMS").read_text().splitlines())
    assert sums["site_rm.tar.xz"] == hashlib.sha256((tmp_path / "site_rm.tar.xz").read_bytes()).hexdigest()
