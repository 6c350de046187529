"""One text form for ground truths, whichever layout and column type a file stores them in.

The rule rewards compare strings, as verl's do: `#### 86` is right only when the ground
truth is the text "86". A parquet column of answers is often not text: pandas writes an
integer column that held a missing value as float64 (`86.0`), and verl's nested
`reward_model.ground_truth` may hold any JSON value. `ground_truth_text` turns every value
into the text a scorer compares with, the same for the flat and the nested layout:

- text stays as it is;
- an integer, or a float or decimal with an integral value, is its integer's digits
  (`86.0` -> "86", `-3.0` -> "-3");
- another finite number is its shortest text (`0.5` -> "0.5");
- NaN, infinity and None are missing (None): a rule-scored row without a ground truth is
  then refused by the prompt schema naming the row, or dropped and counted with
  `data.drop_invalid`, never scored against the text "nan";
- anything else (a list, a mapping, a boolean) is its JSON text, as verl keeps it.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from numbers import Integral, Real
from typing import Any, Iterable, Optional


def ground_truth_text(value: Any) -> Optional[str]:
    """The text a scorer compares responses with, or None when `value` holds no ground truth."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, Integral):
        return str(int(value))
    if isinstance(value, Decimal):
        if not value.is_finite():
            return None
        return str(int(value)) if value == value.to_integral_value() else str(value.normalize())
    if isinstance(value, Real):
        x = float(value)
        if not math.isfinite(x):
            return None
        return str(int(x)) if x.is_integer() else repr(x)
    return json.dumps(value, ensure_ascii=False, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def ground_truth_texts(values: Iterable[Any]) -> list[Optional[str]]:
    """`ground_truth_text` of every value of a ground-truth column, in order."""
    return [ground_truth_text(v) for v in values]
