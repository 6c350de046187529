"""Triton, where it is installed, and whether the rollout's Triton kernels can run.

The kernels of `decode_attention`, `fused_ops` and `fused_sampling` run on CUDA devices,
and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, which the tests use); a CPU
install without Triton falls back to the torch code paths.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def triton_available(device: torch.device) -> bool:
    """Triton is installed and `device` is a CUDA device (or the interpreter is on)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
