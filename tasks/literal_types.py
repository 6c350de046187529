"""One Flyte literal type per dataclass, built once per process.

flytekit's `DataclassTransformer.get_literal_type` builds the dataclass's JSON schema with
mashumaro on every call, and mashumaro compiles a serializer class for every nested
dataclass while it does. The tasks here take and return `PPOConfig` (about 20 nested
dataclasses) and a few other dataclasses, so declaring the workflows asked for the same
literal types about 570 times and spent some 40 s of CPU in it on every `pyflyte run`, in
every task process, and in every test process that imports a workflow. A dataclass's literal
type depends on the class alone, so `install()` keeps the first one built for each class
and hands out copies (callers may set fields on what they get).
"""

from __future__ import annotations

import copy
from typing import Any

from flytekit.core.type_engine import DataclassTransformer

_BUILT: dict[Any, Any] = {}
_ORIGINAL = DataclassTransformer.get_literal_type


def _memoized(self: DataclassTransformer, t: Any):
    try:
        hit = _BUILT.get(t)
    except TypeError:  # an unhashable annotation: build it every time, as flytekit does
        return _ORIGINAL(self, t)
    if hit is None:
        hit = _BUILT[t] = _ORIGINAL(self, t)
    return copy.deepcopy(hit)


def install() -> None:
    """Memoize flytekit's dataclass literal types for this process (idempotent)."""
    if DataclassTransformer.get_literal_type is not _memoized:
        DataclassTransformer.get_literal_type = _memoized
