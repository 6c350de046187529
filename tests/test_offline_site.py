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
