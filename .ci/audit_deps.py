"""Audit the pinned dependencies (`requirements.lock`) for known vulnerabilities with pip-audit.

    python .ci/audit_deps.py [--lock requirements.lock] [--ignore .pip-audit-ignore] [--require-service]

Fails (exit 1) on a known vulnerability unless its ID is listed in the ignore file with a
reason (`ID  # reason`, one per line; an entry without a reason fails too). Packages the
service does not know (local builds) are listed as not audited. When the service answers for
no package at all (no network, or an index mirror without PyPI's JSON API), the audit proves
nothing: that is printed loudly, and it fails only with `--require-service`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_ignores(path: Path) -> dict[str, str]:
    """`{vulnerability id: reason}`; a line without a reason is an error."""
    ignores = {}
    if not path.exists():
        return ignores
    for n, line in enumerate(path.read_text().splitlines(), 1):
        entry, _, reason = line.partition("#")
        if not entry.strip():
            continue
        if not reason.strip():
            sys.exit(f"{path}:{n}: {entry.strip()} has no reason; write `ID  # why it does not apply`")
        ignores[entry.strip()] = reason.strip()
    return ignores


def public_versions(lock: Path, out: Path) -> None:
    """The lock with local version labels dropped (`torch==2.13.0+cpu` is torch 2.13.0 to PyPI)."""
    lines = [re.sub(r"^([A-Za-z0-9_.\-\[\]]+==[^+\s;]+)\+\S+", r"\1", line) for line in lock.read_text().splitlines()]
    out.write_text("\n".join(lines) + "\n")


def audit(requirements: Path, ignores: dict[str, str], service: str) -> dict:
    cmd = [sys.executable, "-m", "pip_audit", "-r", str(requirements), "--no-deps", "--disable-pip",
           "--vulnerability-service", service, "--format", "json", "--progress-spinner", "off"]
    for vid in ignores:
        cmd += ["--ignore-vuln", vid]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        sys.exit(f"pip-audit failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lock", default=str(ROOT / "requirements.lock"))
    p.add_argument("--ignore", default=str(ROOT / ".pip-audit-ignore"))
    p.add_argument("--service", default="pypi", choices=["pypi", "osv"])
    p.add_argument("--require-service", action="store_true",
                   help="fail when the vulnerability service answers for no package")
    args = p.parse_args()
    ignores = read_ignores(Path(args.ignore))
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        public_versions(Path(args.lock), req)
        report = audit(req, ignores, args.service)
    deps = report.get("dependencies", [])
    skipped = [d for d in deps if "skip_reason" in d]
    found = [(d["name"], d["version"], v) for d in deps for v in d.get("vulns", [])]
    audited = len(deps) - len(skipped)
    for vid, reason in ignores.items():
        print(f"ignored {vid}: {reason}")
    if found:
        for name, version, v in found:
            fix = ", ".join(v.get("fix_versions") or []) or "no fixed version"
            print(f"VULNERABLE {name} {version}: {v['id']} ({fix}) {v.get('description', '')[:200]}")
        print(f"{len(found)} known vulnerabilities; upgrade the package in requirements.lock, or list the ID "
              f"in {args.ignore} with the reason it does not apply")
        return 1
    if audited == 0 and deps:
        print(f"WARNING: NOTHING WAS AUDITED: the '{args.service}' vulnerability service answered for none of the "
              f"{len(deps)} locked packages (first: {skipped[0]['skip_reason']}). This machine cannot reach it; "
              "run this audit where it can.", file=sys.stderr)
        return 1 if args.require_service else 0
    for d in skipped:
        print(f"not audited: {d['name']} {d['version']}: {d['skip_reason']}")
    print(f"{audited} of {len(deps)} locked packages audited: no known vulnerability"
          + (f" ({len(ignores)} ignored with a reason)" if ignores else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
