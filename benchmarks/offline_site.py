"""An offline install tree for a GPU host that already has torch but no package index.

The H200 machine this project measures on has Python 3.12, torch 2.11.0+cu130, transformers
and peft, and no network. This script resolves, on a machine with PyPI, the packages the
product's GPU entry points import there (vLLM, DeepSpeed, flytekit with its plugins, pandera,
the MLflow client, gguf; TRL for the real-model benchmark with `--trl`) at the versions of
`containers/requirements-gpu.lock`, minus what the host image holds (`--image-list`, one
name per line or comma-separated) and minus the kernels a dense model on Hopper never loads.
It downloads cp312 manylinux wheels without their dependencies (walking `Requires-Dist`
itself, markers evaluated for Python 3.12 on Linux), builds DeepSpeed's wheel without ops,
installs the lot with `pip install --no-deps --target`, trims vLLM's unused kernel libraries
and writes `site.tar.xz` split into parts that fit one device call, with SHA256SUMS.

    python benchmarks/offline_site.py --image-list image.txt --out /tmp/devsite [--trl] [--real-model]

On the host: `bash benchmarks/vllm_h200.sh site` joins, checks and unpacks the parts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ["vllm", "deepspeed", "flytekit", "flytekitplugins-kfpytorch", "flytekitplugins-pandera", "pandera",
         "mlflow-skinny", "gguf", "optuna"]
TRL_ROOTS = ["trl"]
# Never carried: the host's own stack, and kernels/servers a dense bf16 model on Hopper does not load.
SKIP = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|cupy.*|flashinfer.*|tilelang|quack-kernels|humming-kernels|"
                  r"tokenspeed-.*|torchcodec|torchvision|torchaudio|pynvvideocodec|z3-solver|xformers|ray|"
                  r"opentelemetry-exporter-.*|anthropic|mcp|mcp-types|fastapi-cli|fastapi-cloud-cli|"
                  r"model-hosting-container-standards|mlflow|mlflow-tracing|opencv-.*|deepspeed)$")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 36)] + ["manylinux2014_x86_64", "manylinux1_x86_64",
                                                                  "linux_x86_64"]
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PART = 60_000_000
# vLLM files a dense model on Hopper never loads (FlashAttention 2, MoE and MLA kernels, Blackwell
# FMHA, the Rust server frontend, the OpenAI server's static files).
VLLM_TRIM = ["vllm/vllm_flash_attn/_vllm_fa2_C*.so", "vllm/_moe_C*.so", "vllm/third_party/deep_gemm",
             "vllm/*fmha_sm100*", "vllm/_flashmla*", "vllm/_qutlass_C*.so", "vllm/_rust_tool_parser*",
             "vllm/entrypoints/serve/static", "vllm/vllm-rs"]
# Left out of the real-model tree (`--real-model`): the tree's top-level packages over 5 MB that no
# process of `benchmarks/real_model.py` imports (vLLM and what only its server needs, the Flyte and
# Kubernetes clients, cloud SDKs), found by logging the imports of every process of a `--tiny` run;
# a gsm_symbolic seed with all three lanes then ran from it on an H100. It is about 19 MB packed
# (the whole tree 140 MB), so with the GGUF file it travels in two device calls instead of four.
REAL_MODEL_SKIP = ["vllm", "kubernetes", "mistral_common", "babel", "botocore", "pycountry", "sqlalchemy",
                   "cryptography", "fastsafetensors", "openai", "tvm_ffi", "great_tables", "openai_harmony",
                   "llguidance", "outlines_core"]


def lock_versions() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "containers" / "requirements-gpu.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def image_names(path: str) -> set[str]:
    text = Path(path).read_text() if path else ""
    return {canonicalize_name(x.strip().split("==")[0]) for x in re.split(r"[,\n]", text) if x.strip()}


def download(spec: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(dest)]
    for p in PLATFORMS + ["any"]:
        cmd += ["--platform", p]
    subprocess.run([*cmd, spec], check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(re.split(r"[=<>!~ ]", spec)[0])
    found = new or {w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name}
    return sorted(found)[0]


def requires(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's requirements for Python 3.12 on Linux, with those of the requested `extras`."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate(ENV | {"extra": e}) for e in {"", *extras}):
                out.append(r)
    return out


def _spec(r: Requirement) -> str:
    """A requirement as name[extras]: the version comes from the lock."""
    return r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "")


def build_deepspeed(dest: Path, version: str) -> None:
    if list(dest.glob("deepspeed-*.whl")):
        return
    env = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda", **os.environ}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    f"deepspeed=={version}", "-w", str(dest)], check=True, env=env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-list", required=True, help="packages the host already has (names)")
    p.add_argument("--out", required=True)
    p.add_argument("--trl", action="store_true", help="also TRL (the real-model benchmark's TRL lanes)")
    p.add_argument("--extra", nargs="*", default=[], help="more specs to carry (name==version)")
    p.add_argument("--pack-only", action="store_true", help="only trim, pack and split <out>/site again")
    p.add_argument("--gguf", default="", help="also this GGUF file, in parts gguf.NN (the real-model runs)")
    p.add_argument("--real-model", action="store_true",
                   help="also site_rm.tar.xz, the tree less what the real-model benchmark never imports")
    a = p.parse_args()
    out = Path(a.out)
    if a.pack_only:
        return pack(out, a.gguf, a.real_model)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins, have = lock_versions(), image_names(a.image_list)
    todo = [*ROOTS, *(TRL_ROOTS if a.trl else []), *a.extra]
    seen: dict[str, str] = {}
    walked: dict[str, set[str]] = {}  # the extras whose requirements were followed, per package
    while todo:
        spec = todo.pop()
        req = Requirement(spec)
        name, extras = canonicalize_name(req.name), set(req.extras)
        if name in seen:
            if extras - walked[name]:  # asked again with another extra (pydantic-extra-types[pycountry])
                walked[name] |= extras
                todo += [_spec(r) for r in requires(wheels / seen[name], extras)]
            continue
        if name in have and name not in ROOTS:
            continue
        pinned = str(req.specifier)
        version = pinned[2:] if pinned.startswith("==") else pins.get(name)
        if name == "deepspeed":
            build_deepspeed(wheels, version or "0.19.8")
            wheel = next(wheels.glob("deepspeed-*.whl"))
        elif SKIP.match(name):
            continue
        else:
            wheel = download(f"{name}=={version}" if version else name, wheels)
        seen[name], walked[name] = wheel.name, extras
        print(f"{name:40s} {wheel.name}", flush=True)
        todo += [_spec(r) for r in requires(wheel, extras)]
    site = out / "site"
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
           "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for p_ in PLATFORMS:
        cmd += ["--platform", p_]
    subprocess.run([*cmd, *map(str, sorted(wheels.glob("*.whl")))], check=True)
    print(f"{len(seen)} packages")
    pack(out, a.gguf, a.real_model)


def split(data: bytes, stem: Path) -> int:
    for old in stem.parent.glob(f"{stem.name}.*"):
        old.unlink()
    for i in range(0, len(data), PART):
        stem.with_name(f"{stem.name}.{i // PART:02d}").write_bytes(data[i:i + PART])
    return (len(data) + PART - 1) // PART


def pack(out: Path, gguf: str = "", real_model: bool = False) -> None:
    """Trim `<out>/site`, write site.tar.xz (and the GGUF file) in parts of PART bytes, and SHA256SUMS;
    with `real_model`, also site_rm.tar.xz in one piece, without REAL_MODEL_SKIP."""
    site = out / "site"
    for pattern in VLLM_TRIM:
        for f in site.glob(pattern):
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    tar = out / "site.tar.xz"
    subprocess.run(f"tar cf - -C {out} site | xz -T2 -6 > {tar}", shell=True, check=True)
    data = tar.read_bytes()
    sums = [f"{hashlib.sha256(data).hexdigest()}  site.tar.xz"]
    print(f"site.tar.xz {len(data) / 1e6:.1f} MB in {split(data, tar)} parts")
    if real_model:
        rm = out / "site_rm.tar.xz"
        skip = " ".join(f"--exclude=site/{n}" for n in REAL_MODEL_SKIP)
        subprocess.run(f"tar cf - -C {out} {skip} site | xz -T2 -6 > {rm}", shell=True, check=True)
        sums.append(f"{hashlib.sha256(rm.read_bytes()).hexdigest()}  site_rm.tar.xz")
        print(f"site_rm.tar.xz {rm.stat().st_size / 1e6:.1f} MB")
    if gguf:
        data = Path(gguf).read_bytes()
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {Path(gguf).name}")
        print(f"{Path(gguf).name} {len(data) / 1e6:.1f} MB in {split(data, out / 'gguf')} parts")
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")


if __name__ == "__main__":
    main()
