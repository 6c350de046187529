"""The comment beside each field of a config dataclass, read from the class's source, and
the dotted-key table built from them (key, type, default, comment), for any dataclass tree.

`rlhf.config.doc` renders docs/CONFIG.md from the table of `PPOConfig`; `rlhf.config.ranges`
names a key's meaning in its range errors. This module imports no config class.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields, is_dataclass
from typing import get_type_hints

_FIELD = re.compile(r"^\s+(\w+):\s*[^=#]+(?:=[^#]*)?(?:#\s*(.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it in `cls`'s source ("" where there is none)."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD.match(line)
        if m:
            out[m.group(1)] = (m.group(2) or "").strip()
    return out


def _default(f) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        return "" if is_dataclass(v) else repr(v)
    return ""


def key_rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, comment) of every leaf field of the dataclass tree `cls`."""
    hints, notes = get_type_hints(cls), field_comments(cls)
    out = []
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            out += key_rows(t, f"{prefix}{f.name}.")
        else:
            name = getattr(t, "__name__", str(t)).replace("typing.", "")
            out.append((f"{prefix}{f.name}", name if "[" not in str(t) else str(t).replace("typing.", ""),
                        _default(f), notes.get(f.name, "")))
    return out
