"""The embedded arithmetic task: short prompts ("23+45=") answered in GSM8K's format ("#### 68").

Built for a tiny character-level model: with the defaults (2 digits, "+", one step) a
prompt plus its answer is at most 14 characters. Difficulty knobs: `digits` (operands
are drawn uniformly from 0 .. 10**digits - 1), `operators` (any of "+-*", with the usual
precedence) and `n_steps` (binary operations per problem: 2 gives "a+b*c").

Problems are distinct within a table as long as the problem space allows; beyond that
(e.g. 20000 rows of 2-digit additions, of which only 10000 exist) the table repeats
problems in shuffled rounds. `make_splits` never shares a problem between splits.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from rlhf.config.schema import SyntheticDataConfig

DATA_SOURCE = "synthetic/arithmetic"
ALLOWED_OPERATORS = "+-*"
_ENUMERATE_LIMIT = 2_000_000  # problem spaces up to this size are sampled without replacement exactly

Problem = tuple[tuple[int, ...], tuple[str, ...]]  # (operands, operators)


def _check_knobs(digits: int, operators: str, n_steps: int) -> str:
    ops = "".join(dict.fromkeys(operators))
    if not ops or any(o not in ALLOWED_OPERATORS for o in ops):
        raise ValueError(f"operators must be a non-empty string of {ALLOWED_OPERATORS!r}, got {operators!r} "
                         "(data.synthetic.operators)")
    if digits < 1 or n_steps < 1:
        raise ValueError(f"digits and n_steps must be >= 1, got digits={digits}, n_steps={n_steps} "
                         "(data.synthetic.digits / data.synthetic.n_steps)")
    return ops


def problem_space_size(digits: int, operators: str, n_steps: int) -> int:
    """How many distinct problems the knobs allow."""
    ops = _check_knobs(digits, operators, n_steps)
    return len(ops) ** n_steps * (10**digits) ** (n_steps + 1)


def expression(problem: Problem) -> str:
    """((23, 45), ("+",)) -> "23+45"."""
    operands, ops = problem
    return str(operands[0]) + "".join(f"{o}{b}" for o, b in zip(ops, operands[1:]))


def evaluate(problem: Problem) -> int:
    """The value of the expression, "*" binding tighter than "+" and "-"."""
    operands, ops = problem
    terms, signs = [operands[0]], [1]
    for op, b in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= b
        else:
            terms.append(b)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _decode(code: int, base: int, ops: str, n_steps: int) -> Problem:
    """Mixed-radix code -> problem (operators first, then operands)."""
    chosen = []
    for _ in range(n_steps):
        code, k = divmod(code, len(ops))
        chosen.append(ops[k])
    operands = []
    for _ in range(n_steps + 1):
        code, a = divmod(code, base)
        operands.append(a)
    return tuple(operands), tuple(chosen)


def sample_problems(rng: np.random.Generator, count: int, digits: int, operators: str, n_steps: int) -> list[Problem]:
    """`min(count, space)` distinct problems in random order."""
    ops = _check_knobs(digits, operators, n_steps)
    base, space = 10**digits, problem_space_size(digits, ops, n_steps)
    count = min(count, space)
    if space <= _ENUMERATE_LIMIT:
        return [_decode(int(c), base, ops, n_steps) for c in rng.permutation(space)[:count]]
    seen: dict[Problem, None] = {}
    while len(seen) < count:  # the space is large: collisions are rare
        operands = rng.integers(0, base, size=(count, n_steps + 1))
        chosen = rng.integers(0, len(ops), size=(count, n_steps))
        for a, k in zip(operands.tolist(), chosen.tolist()):
            seen.setdefault((tuple(a), tuple(ops[i] for i in k)), None)
            if len(seen) == count:
                break
    return list(seen)


def _repeat_to(problems: list[Problem], n: int, rng: np.random.Generator) -> list[Problem]:
    """`problems` followed by shuffled copies until there are `n` (used when the space is exhausted)."""
    out = list(problems[:n])
    while len(out) < n:
        out += [problems[i] for i in rng.permutation(len(problems))[: n - len(out)]]
    return out


def solution_text(ground_truth: str) -> str:
    """The SFT target response in GSM8K's answer format: "68" -> "#### 68"."""
    return f"#### {ground_truth}"


def to_frame(problems: list[Problem], split: str | None = None) -> pd.DataFrame:
    """Problems -> a `PromptSchema` table (prompt "23+45=", ground truth "68")."""
    info = [{"index": i, "expression": expression(p)} | ({"split": split} if split else {})
            for i, p in enumerate(problems)]
    return pd.DataFrame({
        "prompt": [expression(p) + "=" for p in problems],
        "data_source": [DATA_SOURCE] * len(problems),
        "ability": ["math"] * len(problems),
        "reward_style": ["rule"] * len(problems),
        "ground_truth": [str(evaluate(p)) for p in problems],
        "extra_info": [json.dumps(x) for x in info],
    }, columns=["prompt", "data_source", "ability", "reward_style", "ground_truth", "extra_info"])


def make_arithmetic(n: int, digits: int = 2, operators: str = "+", n_steps: int = 1, seed: int = 0) -> pd.DataFrame:
    """`n` arithmetic prompts, distinct while the problem space allows; same seed, same table."""
    rng = np.random.default_rng(seed)
    return to_frame(_repeat_to(sample_problems(rng, n, digits, operators, n_steps), n, rng))


def make_splits(cfg: SyntheticDataConfig) -> dict[str, pd.DataFrame]:
    """{"sft", "train", "val"} tables with no problem shared between splits.

    val and sft are drawn first and are always distinct; train takes the rest of the
    sampled problems (repeating them only if the space is smaller than n_train).
    """
    space = problem_space_size(cfg.digits, cfg.operators, cfg.n_steps)
    held_out = cfg.n_val + cfg.n_sft
    if space <= held_out and cfg.n_train > 0:
        raise ValueError(f"only {space} distinct problems exist for digits={cfg.digits}, operators="
                         f"{cfg.operators!r}, n_steps={cfg.n_steps}, fewer than n_val + n_sft + 1 = {held_out + 1}; "
                         "raise data.synthetic.digits or n_steps, add operators, or lower n_val / n_sft")
    if space < held_out:
        raise ValueError(f"only {space} distinct problems exist, fewer than n_val + n_sft = {held_out}; "
                         "raise data.synthetic.digits or lower n_val / n_sft")
    rng = np.random.default_rng(cfg.seed)
    problems = sample_problems(rng, held_out + cfg.n_train, cfg.digits, cfg.operators, cfg.n_steps)
    val, sft, rest = problems[: cfg.n_val], problems[cfg.n_val: held_out], problems[held_out:]
    train = _repeat_to(rest, cfg.n_train, rng) if cfg.n_train else []
    return {"sft": to_frame(sft, "sft"), "train": to_frame(train, "train"), "val": to_frame(val, "val")}
