"""DeepSpeed engine state read back without running pickled code.

DeepSpeed saves its engine state (optimizer moments, step counters, its config) with
`torch.save` and reads it back with `weights_only=False`, which unpickles any
object: a tampered `engine/*.pt` file in a checkpoint could run code when a run resumes.
`restrict_loading(engine)` gives the engine a checkpoint reader that loads with
`weights_only=True` (tensors, containers, plain scalars) and allows only the few DeepSpeed
types its own state holds; a file that needs anything else is refused with
`UnsafeCheckpointError`. The models themselves are read from safetensors (`rlhf.models.load`).
"""

from __future__ import annotations

import pickle

import torch


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file would need to unpickle objects outside the allowed types."""


def allowed_globals() -> list:
    """The DeepSpeed classes found in its ZeRO 0-3 optimizer state (loss scaler, ZeRO stage
    enum, parameter fragment addresses): plain value holders that run no code on load."""
    # deepspeed is heavy: loaded only when a checkpoint's engine state is read
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: str, map_location=None):
    """`torch.load(path, weights_only=True)` with `allowed_globals()`; anything else raises."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"refusing to load '{path}': it holds objects other than tensors and DeepSpeed's optimizer state "
            f"({str(e).splitlines()[-1][:300]}), and unpickling them could run code. Use a checkpoint this "
            "pipeline wrote, or start without it (trainer.resume=disable)") from e


def restrict_loading(engine) -> None:
    """Make `engine.load_checkpoint` read its files through `load_weights_only`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if current is not None and not isinstance(current, TorchCheckpointEngine):
        raise UnsafeCheckpointError(f"DeepSpeed checkpoint engine {type(current).__name__} cannot be restricted "
                                    "to weights-only loading; use the default (torch) checkpoint engine")
    reader = current if current is not None else TorchCheckpointEngine()
    reader.load = load_weights_only
    engine.checkpoint_engine = reader
