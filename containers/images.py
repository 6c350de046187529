"""The task images, declared in code and pinned (the pins live in requirements-*.txt, which
`containers/Dockerfile` installs too, so both ways of building give the same image).

- `CPU_IMAGE`: data preparation, sampling, scoring, decisions, reports, registry calls.
- `GPU_IMAGE`: rollout (vLLM, CUDA), the DeepSpeed update, evaluation.

`pyflyte run --remote` / `pyflyte register` build and push them to `REGISTRY`; to use
images built elsewhere (e.g. from the Dockerfile), pass `--image <ImageSpec id>=<uri>`
or point `REGISTRY` at your registry and tag them accordingly.
"""

from __future__ import annotations

from pathlib import Path

from flytekit import ImageSpec

HERE = Path(__file__).resolve().parent
REGISTRY = "localhost:30000"  # the Flyte sandbox's registry; set your own for a cluster
PYTHON = "3.11"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYTORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

CPU_IMAGE = ImageSpec(
    name="flyte-rlhf-cpu",
    registry=REGISTRY,
    python_version=PYTHON,
    requirements=str(HERE / "requirements-cpu.txt"),
    pip_extra_index_url=[PYTORCH_CPU_INDEX],
    env=ENV,
)

GPU_IMAGE = ImageSpec(
    name="flyte-rlhf-gpu",
    registry=REGISTRY,
    base_image="nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04",
    python_version=PYTHON,
    requirements=str(HERE / "requirements-gpu.txt"),
    pip_extra_index_url=[PYTORCH_CUDA_INDEX],
    apt_packages=["build-essential", "git"],
    env={**ENV, "DS_BUILD_OPS": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
)
