"""What holds a shut-down vLLM engine's memory: the GPU memory free, torch's cache emptied, and
the Python objects that still refer to an object (its direct holders, or one chain of
referrers back to a module's globals, a class or a frame)."""

from __future__ import annotations

import collections
import gc
import sys
import types
import weakref
from typing import Any


def empty_torch_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_gpu_text() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    return f": {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the GPU"


def holders(obj: Any) -> list[str]:
    """What refers to `obj`, frames named by function and line (this call's own frames left out)."""
    mine = {id(sys._getframe()), id(sys._getframe(1))}
    out = []
    for r in gc.get_referrers(obj):
        if id(r) in mine:
            continue
        if isinstance(r, types.FrameType):
            out.append(f"the frame of {r.f_code.co_name} at {r.f_code.co_filename}:{r.f_lineno}")
        else:
            out.append(type(r).__name__)
    return sorted(set(out))


def referrer_chain(obj: Any, depth: int = 8, limit: int = 20000) -> str:
    """One chain of referrers from `obj` back to a module's globals, a class, a frame or a code
    object (searched breadth first), as `obj <- type <- ...`; else whether no Python object
    refers to it (it is held from C/C++) or the search gave up."""
    seen = {id(obj)}
    first = (obj, (type(obj).__name__,))
    queue = collections.deque([first])
    mine = {id(sys._getframe()), id(sys._getframe(1)), id(queue), id(first)}
    modules = {id(vars(m)): name for name, m in reversed(list(sys.modules.items())) if m is not None}
    longest = first[1]
    while queue:
        if len(seen) >= limit:
            return f"not found among {limit} objects; deepest: {' <- '.join(longest)}"
        o, path = queue.popleft()
        if len(path) > depth:
            continue
        for r in gc.get_referrers(o):
            if id(r) in seen or id(r) in mine:
                continue
            seen.add(id(r))
            if id(r) in modules:
                end = f"the globals of {modules[id(r)]}"
            elif isinstance(r, types.FrameType):
                end = f"the frame of {r.f_code.co_name} at {r.f_code.co_filename}:{r.f_lineno}"
            elif isinstance(r, type):
                end = f"class {r.__qualname__}"
            elif isinstance(r, types.CodeType):
                end = f"code {r.co_qualname}"
            else:
                entry = (r, path + (type(r).__name__,))
                mine.add(id(entry))
                queue.append(entry)
                longest = entry[1] if len(entry[1]) > len(longest) else longest
                continue
            return " <- ".join(path + (end,))
    if len(longest) == 1:
        return "no Python object refers to it: it is held from C/C++ code"
    return f"no root within {depth} steps; deepest: {' <- '.join(longest)} (held from C/C++ code)"


def worker_parts(llm) -> dict[str, weakref.ref]:
    """Weak references to what holds the device memory of an engine whose worker lives in this
    process: its model runner, the served model and the first KV cache tensor."""
    try:
        runner = llm.collective_rpc(_model_runner)[0]
    except Exception:  # noqa: BLE001 - a diagnosis only; an engine without these parts has nothing to check
        return {}
    parts = {"model runner": runner, "model": getattr(runner, "model", None)}
    caches = getattr(runner, "kv_caches", None)
    if isinstance(caches, (list, tuple)) and caches and not isinstance(caches[0], (list, tuple)):
        parts["KV cache"] = caches[0]
    refs = {}
    for name, obj in parts.items():
        try:
            refs[name] = weakref.ref(obj)
        except TypeError:
            pass
    return refs


def _model_runner(worker) -> Any:
    """Run on a vLLM worker: its model runner."""
    return worker.model_runner
