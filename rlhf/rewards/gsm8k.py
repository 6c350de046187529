"""GSM8K's rule reward, with verl's semantics (`verl/utils/reward_score/gsm8k.py`).

Only the last 300 characters of a response are searched (an answer is expected at
the end, and regexes over long strings are slow). Two extraction methods:

- "strict": the last `#### <number>` (the GSM8K answer format); commas and `$` are
  removed from the number. The `$` must not sit between `#### ` and the number:
  `#### $18` is no answer, exactly as in verl.
- "flexible": the last run of digits, `.`, `,` (optionally with a leading `-`) that is
  not "" or "."; nothing is removed from it, so `1,000` does not equal `1000`.

The score is `score` when the extracted answer equals `ground_truth` as a string,
`format_score` when an answer was extracted but differs, 0 when none was found.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_NOT_A_NUMBER = ("", ".")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer a response commits to, or None when it has none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    # verl keeps the earliest match when every match is "" or "."
    return next((a for a in reversed(found) if a not in _NOT_A_NUMBER), found[0])


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if wrong, 0 if none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


def reward(response: str, ground_truth: str, extra_info: dict, cfg) -> float:
    """Registry entry: the rule with `cfg.gsm8k_method`, `cfg.format_score`, `cfg.score` (a RewardConfig)."""
    return compute_score(response, ground_truth, cfg.gsm8k_method, cfg.format_score, cfg.score)
