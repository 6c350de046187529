"""The task images, declared in code and pinned. The direct pins live in requirements-*.txt;
requirements-*.lock (`make lock-images`, uv's resolution for the image's Python and
manylinux_2_28) pins every transitive package, and both these specs and
`containers/Dockerfile` install the lock, so both ways of building give the same image.

- `CPU_IMAGE`: data preparation, sampling, scoring, decisions, reports, registry calls
  (Python 3.11, torch's CPU build).
- `GPU_IMAGE`: rollout (vLLM), the DeepSpeed update, evaluation: Python 3.12 on a CUDA 13
  base, the stack that ran on an H200 (vLLM 0.26.0, torch 2.11.0, whose PyPI wheels link
  CUDA 13).

`pyflyte run --remote` / `pyflyte register` build and push them to `REGISTRY`; to use
images built elsewhere (e.g. from the Dockerfile), pass `--image <ImageSpec id>=<uri>`
or point `REGISTRY` at your registry and tag them accordingly.
"""

from __future__ import annotations

from pathlib import Path

from flytekit import ImageSpec

HERE = Path(__file__).resolve().parent
REGISTRY = "localhost:30000"  # the Flyte sandbox's registry; set your own for a cluster
CPU_PYTHON = "3.11"
GPU_PYTHON = "3.12"
GPU_BASE = "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"  # the toolkit DeepSpeed and FlashInfer JIT-build with
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

CPU_IMAGE = ImageSpec(
    name="flyte-rlhf-cpu",
    registry=REGISTRY,
    python_version=CPU_PYTHON,
    requirements=str(HERE / "requirements-cpu.lock"),
    pip_extra_index_url=[PYTORCH_CPU_INDEX],
    pip_extra_args="--index-strategy unsafe-best-match",  # torch from that index, the rest from PyPI
    env=ENV,
)

GPU_IMAGE = ImageSpec(
    name="flyte-rlhf-gpu",
    registry=REGISTRY,
    base_image=GPU_BASE,
    python_version=GPU_PYTHON,
    requirements=str(HERE / "requirements-gpu.lock"),
    apt_packages=["build-essential", "git"],
    env={**ENV, "DS_BUILD_OPS": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
)
