"""Property-based tests of everything that reads user input: the dataset reader, the answer
parsers, the config loader and the dotted overrides.

The contract under test: every input either works or raises the documented error
(`DataValidationError`, `RewardError`, `ConfigError`), never another exception, and never
hangs (each example runs under an alarm). Each target runs 10,000 examples; inputs are small
and cheap to generate, and examples are written to /dev/shm where there is one, so most of
the time goes to the code under test (for the reader, mostly pandera's validation).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import signal
import string
import tempfile
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlhf.config import ConfigError, PPOConfig, RewardConfig, all_keys, flatten, load_config, save_config
from rlhf.config import to_dict as config_to_dict
from rlhf.data.io import FLAT_COLUMNS, DataValidationError, read_prompts
from rlhf.rewards import RewardError, compute_scores
from rlhf.rewards import arithmetic as arithmetic_reward
from rlhf.rewards import gsm8k as gsm8k_reward

EXAMPLES = 10_000
PER_EXAMPLE_S = 10  # a hang shows up as a failure, not as a stuck CI job
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@contextmanager
def time_limit(seconds: float = PER_EXAMPLE_S):
    """Fail the example (TimeoutError) if it runs longer than `seconds`."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"example ran longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------
# Dataset reader: random tables, column types, rows and byte-level corruption
# ---------------------------------------------------------------------------------

# Small pools of values per arrow type; a table is a few cheap draws (which columns, of
# which type, which pool entries), so that generating one costs well under a millisecond.
TEXT = [None, "", " ", "1+1=", "What is 2+3?", "#### 5", "é\u2028\x00", "{}", '{"a": 1}', "[]", "not json", "null",
        '[{"role": "user", "content": "hi"}]', '[{"role": "user"}]', "rule", "model", "openai/gsm8k",
        "synthetic/arithmetic", "unknown/src"]
CHATS = [None, [], [{"role": "user", "content": "1+2="}], [{"role": "user", "content": None}],
         [{"role": None, "content": "x"}], [{"role": "user", "content": " "}]]
POOLS = {
    "string": (pa.string(), TEXT),
    "large_string": (pa.large_string(), TEXT),
    "binary": (pa.binary(), [None, b"\xff", b"ok", b""]),
    "bad_utf8": (None, [None, b"\xff", b"a\xc3", b"\xed\xa0\x80", b"ok"]),
    "int64": (pa.int64(), [None, 0, -1, 2**63 - 1]),
    "float64": (pa.float64(), [None, 0.5, float("nan"), float("inf")]),
    "bool": (pa.bool_(), [None, True, False]),
    "null": (pa.null(), [None]),
    "list_string": (pa.list_(pa.string()), [None, [], ["a"], ["user", None]]),
    "chat": (pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])), CHATS),
    "reward_struct": (pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
                      [None, {"style": "rule", "ground_truth": "3"}, {"style": "model", "ground_truth": None},
                       {"style": "rule", "ground_truth": None}, {"style": None, "ground_truth": "1"},
                       {"style": "human", "ground_truth": "2"}]),
    "reward_struct_int": (pa.struct([("style", pa.string()), ("ground_truth", pa.int64())]),
                          [None, {"style": "rule", "ground_truth": 3}, {"style": "rule", "ground_truth": None}]),
    "struct_no_style": (pa.struct([("kind", pa.string())]), [None, {"kind": "rule"}]),
    "map": (pa.map_(pa.string(), pa.string()), [None, [], [("a", "1")], [("split", "train"), ("b", None)]]),
    "timestamp": (pa.timestamp("us"), [None, datetime.datetime(2024, 1, 1)]),
    "dictionary": (None, [None, "rule", "model", "x", ""]),
}
KINDS = sorted(POOLS)
# The type each column usually has, so that many tables get past the layout checks.
USUAL = {"prompt": ["string", "chat"], "data_source": ["string"], "ability": ["string"],
         "reward_style": ["string"], "ground_truth": ["string"], "extra_info": ["string", "map"],
         "reward_model": ["reward_struct"], "difficulty": ["int64"]}
# Realistic cells for the usual types: mostly valid values, some bad ones.
GOOD = {"prompt": ["1+1=", "What is 2+3?", "", None], "data_source": ["synthetic/arithmetic", "openai/gsm8k", " "],
        "ability": ["math", None], "reward_style": ["rule", "model", "human"], "ground_truth": ["2", None, "x"],
        "extra_info": ["{}", '{"a": 1}', "[]", "not json"]}


def _array(kind: str, values: list) -> pa.Array:
    if kind == "bad_utf8":  # a string column whose bytes are not UTF-8 (pyarrow does not check on view)
        return pa.array(values, pa.binary()).view(pa.string())
    if kind == "dictionary":
        return pa.array(values, pa.string()).dictionary_encode()
    return pa.array(values, POOLS[kind][0])


def _valid_columns(n: int, verl: bool) -> dict[str, pa.Array]:
    """A table that reads: verl's nested layout or the flat one."""
    rows = range(n)
    if verl:
        return {"data_source": _array("string", ["openai/gsm8k"] * n),
                "prompt": _array("chat", [[{"role": "user", "content": f"{i}+1="}] for i in rows]),
                "ability": _array("string", ["math"] * n),
                "reward_model": _array("reward_struct", [{"style": "rule", "ground_truth": str(i + 1)} for i in rows]),
                "extra_info": _array("map", [[("index", str(i))] for i in rows])}
    return {"prompt": _array("string", [f"{i}+1=" for i in rows]),
            "data_source": _array("string", ["synthetic/arithmetic"] * n), "ability": _array("string", ["math"] * n),
            "reward_style": _array("string", ["rule"] * n), "ground_truth": _array("string", [str(i) for i in rows]),
            "extra_info": _array("string", ["{}"] * n)}


@st.composite
def tables(draw) -> pa.Table:
    """Random tables: a valid one (1 in 16), a valid one with one change (3 in 16), or columns
    of random presence, type and cells (12 in 16)."""
    mode = draw(st.integers(0, 15))
    n = draw(st.integers(0 if mode else 1, 3))
    if mode < 4:
        columns = _valid_columns(n, draw(st.booleans()))
        if mode:
            name = draw(st.sampled_from(sorted(columns) + ["difficulty"]))
            change = draw(st.sampled_from(["drop", "retype", "cell"]))
            kind = draw(st.sampled_from(KINDS))
            if change == "drop":
                columns.pop(name, None)
            elif change == "retype" or name not in columns:
                columns[name] = _array(kind, [draw(st.sampled_from(POOLS[kind][1])) for _ in range(n)])
            elif n:
                pool = GOOD.get(name, TEXT) if pa.types.is_string(columns[name].type) else [None]
                cells = columns[name].to_pylist()
                cells[draw(st.integers(0, n - 1))] = draw(st.sampled_from(pool))
                columns[name] = pa.array(cells, columns[name].type)
        return pa.table(columns)
    picks = draw(st.binary(min_size=8 * 4, max_size=8 * 4))  # cell choices, 4 per column
    columns = {}
    for c, (name, usual) in enumerate(USUAL.items()):
        how = draw(st.integers(0, 9))
        if how == 0 or (name in ("reward_style", "ground_truth", "reward_model", "difficulty") and how < 4):
            continue  # column absent
        kind = usual[how % len(usual)] if how < 8 else draw(st.sampled_from(KINDS))
        pool = GOOD[name] if kind == "string" and name in GOOD and how < 7 else POOLS[kind][1]
        cells = [pool[picks[4 * c + r] % len(pool)] for r in range(n)]
        columns[name] = _array(kind, cells)
    return pa.table(columns) if columns else pa.table({"x": pa.array([], pa.int64())})


@st.composite
def parquet_files(draw) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(draw(tables()), sink)
    data = sink.getvalue().to_pybytes()
    damage = draw(st.integers(0, 5))  # 1 in 6 truncated, 1 in 6 with one byte changed
    if damage == 4:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif damage == 5:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


@pytest.fixture(scope="module")
def data_dir():
    """Where examples are written: memory-backed when the machine has /dev/shm (an open() on
    an overlay filesystem costs about a millisecond, more than most examples)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="rlhf-prop-", dir=shm) as d:
        yield d


@PROPERTY
@given(data=parquet_files(), drop_invalid=st.booleans())
def test_dataset_reader_reads_or_names_the_problem(data_dir, data, drop_invalid):
    path = os.path.join(data_dir, "train.parquet")
    with open(path, "wb") as f:
        f.write(data)
    try:
        with time_limit():
            df = read_prompts(path, drop_invalid=drop_invalid)
    except DataValidationError as e:
        assert path in str(e), f"the message does not name the file: {e}"
        return
    assert list(df.columns) == list(FLAT_COLUMNS) and len(df) > 0
    for column in ("prompt", "data_source", "ability", "reward_style", "extra_info"):
        assert all(isinstance(v, str) for v in df[column]), column
    assert set(df["reward_style"]) <= {"rule", "model"}
    assert all(isinstance(json.loads(v), dict) for v in df["extra_info"])
    assert df.attrs["n_dropped"] == 0 or drop_invalid


# ---------------------------------------------------------------------------------
# Answer parsers
# ---------------------------------------------------------------------------------


def texts(alphabet: str, max_size: int) -> st.SearchStrategy[str]:
    """Text over `alphabet` from raw bytes: much cheaper to generate than `st.text`."""
    return st.binary(max_size=max_size).map(lambda b: "".join(alphabet[x % len(alphabet)] for x in b))


SHORT_TEXT = texts(" ab1#{}[]\":,\n\x00é", 6)
JSON_OBJECTS = st.sampled_from(["{}", '{"a": 1}', "[]", "not json", "", "null", '{"split": "train"}'])
# Arabic-Indic digits and a fullwidth one are digits to str.isdigit but not to [0-9].
ANSWER_ALPHABET = string.digits + "#$,.- \n\tabcxyz=+*/" + "٣٤۵１\u2028é\x00"
RESPONSES = texts(ANSWER_ALPHABET, 40) | st.builds(
    lambda a, n, b: f"{a}#### {n}{b}", texts(ANSWER_ALPHABET, 20),
    st.integers(-10**6, 10**6), texts(" \n.abc", 3))
LONG_RESPONSES = st.builds(lambda body, reps: body * reps, texts("#1, -.", 4), st.integers(0, 400))
NUMBERS = st.integers(-10**9, 10**9)
METHODS = st.sampled_from(["strict", "flexible"])
ANSWER = re.compile(r"-?[0-9.,]*")


@PROPERTY
@given(text=RESPONSES | LONG_RESPONSES, method=METHODS, n=NUMBERS, prefix=texts(ANSWER_ALPHABET, 30))
@example(text="#" * 100_000 + " 1", method="strict", n=1, prefix="")
def test_gsm8k_parser_total_and_finds_final_answer(text, method, n, prefix):
    with time_limit():
        answer = gsm8k_reward.extract_solution(text, method)
        score = gsm8k_reward.compute_score(text, "7", method, format_score=0.1, score=1.0)
        stated = gsm8k_reward.extract_solution(f"{prefix}\n#### {n:,}", "strict")
    assert answer is None or (isinstance(answer, str) and ANSWER.fullmatch(answer))
    if answer in ("", "."):  # verl's flexible rule falls back to its first match when none has a digit
        assert method == "flexible" and not re.search("[0-9]", text[-gsm8k_reward.CLIP_CHARS:])
    if method == "strict" and answer is not None:
        assert "," not in answer and "$" not in answer
    assert score in (0.0, 0.1, 1.0) and (score == 0.0) == (answer is None)
    assert stated == str(n)  # the final `#### N` is the answer, whatever comes before it
    assert gsm8k_reward.compute_score(f"{prefix} so {n}", str(n), "flexible") == 1.0


@PROPERTY
@given(rows=st.lists(st.tuples(
    st.sampled_from(["synthetic/arithmetic", "openai/gsm8k", "nope/source"]),
    RESPONSES, st.none() | st.integers(-99, 99).map(str) | SHORT_TEXT,
    st.none() | JSON_OBJECTS, st.sampled_from(["rule", "rule", "model", "other"])), min_size=1, max_size=3),
    method=METHODS)
def test_arithmetic_reward_scores_or_names_the_row(rows, method):
    cfg = RewardConfig(gsm8k_method=method, format_score=0.25, score=1.0)
    sources, responses, truths, extras, styles = map(list, zip(*rows))
    try:
        with time_limit():
            scores = compute_scores(sources, responses, truths, extras, styles, cfg)
    except RewardError as e:
        assert re.search(r"row \d+|reward_style 'model'|data_source", str(e)), str(e)
        return
    assert len(scores) == len(rows)
    for (source, response, truth, _, _), s in zip(rows, scores):
        assert s in (0.0, 0.25, 1.0)
        if source == "synthetic/arithmetic":
            assert s == arithmetic_reward.compute_score(response, truth, method, 0.25, 1.0)
    for row, (source, *_, style) in enumerate(rows):  # what succeeded was scorable
        assert style == "rule" and source != "nope/source", row


# ---------------------------------------------------------------------------------
# Config loader: random text, random trees, random overrides
# ---------------------------------------------------------------------------------

SECTIONS = [k.split(".")[0] for k in all_keys()]
LEAVES = all_keys()
YAML_TEXT = st.text(alphabet=" \n\t-:{}[],&*!|>'\"#?%@`.0123456789abcdetnrulxyz_", max_size=60)
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
           | st.dates() | st.sampled_from(["[console,mlflow]", "1e-3", "null", "true", "hf", "gae", "1"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(LEAVES + ["x", 1]), inner, max_size=3), max_leaves=6)


def _tree(draw_keys: list[tuple[str, object]]) -> dict:
    tree: dict = {}
    for key, value in draw_keys:
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[parts[-1]] = value
    return tree


TREES = st.lists(st.tuples(st.sampled_from(LEAVES + SECTIONS + ["nope", "actor.nope"]), VALUES),
                 max_size=5).map(_tree)


def _config_text(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["yaml-text", "tree-yaml", "tree-json", "bytes", "deep"]))
    if kind == "yaml-text":
        return ".yaml", draw(YAML_TEXT | st.text(max_size=40)).encode("utf-8", "surrogatepass")
    if kind == "bytes":
        return draw(st.sampled_from([".yaml", ".json"])), draw(st.binary(max_size=40))
    if kind == "deep":
        depth = draw(st.integers(1, 300))
        return draw(st.sampled_from([".yaml", ".json"])), ("[" * depth + "]" * draw(st.integers(0, depth))).encode()
    tree = draw(TREES)
    if kind == "tree-json":
        return ".json", json.dumps(tree, default=str).encode()
    return ".yaml", yaml.dump(tree, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), allow_unicode=True).encode()


@st.composite
def config_files(draw) -> tuple[str, bytes]:
    return _config_text(draw)


BILLION_LAUGHS = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(8)]) + "\n"


@PROPERTY
@given(file=config_files())
@example(file=(".yaml", BILLION_LAUGHS.encode()))
@example(file=(".yaml", b"trainer: {experiment_name: 2024-01-01}\n"))
@example(file=(".yaml", b"a: &r [*r]\n"))
@example(file=(".json", b"\xff\xfe{}"))
@example(file=(".yaml", b"[" * 3000))
@example(file=(".json", b"[" * 3000 + b"]" * 3000))
def test_config_loader_loads_or_raises_config_error(data_dir, file):
    suffix, data = file
    path = os.path.join(data_dir, "cfg" + suffix)
    with open(path, "wb") as f:
        f.write(data)
    try:
        with time_limit():
            cfg = load_config(path)
    except ConfigError as e:
        assert path in str(e), f"the message does not name the file: {e}"
        return
    assert isinstance(cfg, PPOConfig)
    saved = os.path.join(data_dir, "saved.yaml")
    save_config(cfg, saved)
    assert load_config(saved) == cfg  # what loads can be saved and loads back the same


def _typed(value) -> str:
    """A config value as a user writes it on the command line."""
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


OVERRIDE_KEYS = st.sampled_from(LEAVES + SECTIONS + ["nope", "actor.nope", "actor..clip_ratio", "", " rollout.n ",
                                                     "+rollout.n", "data.synthetic.n_sft.x"])
OVERRIDE_VALUES = (st.text(alphabet="0123456789.-+e_xabnul[],{}: '\"!&*#", max_size=12) | st.text(max_size=8)
                   | st.sampled_from(["1e-3", "nan", "inf", "-inf", ".inf", "0x10", "1_000", "yes", "~", "null",
                                      "[console,mlflow]", "2024-01-01", "!!binary aGk=", "&a [*a]", "{a: 1}"]))
OVERRIDES = st.lists(st.builds(lambda k, sep, v: f"{k}{sep}{v}", OVERRIDE_KEYS, st.sampled_from(["=", "=", ":"]),
                               OVERRIDE_VALUES), max_size=3)
DEFAULTS = flatten(PPOConfig())


@PROPERTY
@given(overrides=OVERRIDES, key=st.sampled_from(sorted(DEFAULTS)))
@example(overrides=["trainer.experiment_name=2024-01-01"], key="rollout.n")
@example(overrides=["data=&a [*a]"], key="rollout.n")
def test_overrides_apply_or_raise_config_error(overrides, key):
    try:
        with time_limit():
            cfg = load_config(None, overrides)
    except ConfigError as e:
        assert str(e), "empty message"
    else:
        assert isinstance(cfg, PPOConfig)
    # A default value typed back as an override is accepted and gives the same value.
    with time_limit():
        same = load_config(None, [f"{key}={_typed(DEFAULTS[key])}"])
    assert flatten(same)[key] == DEFAULTS[key] and same == PPOConfig()


def test_saved_config_loads_back_identically(data_dir):
    cfg = load_config(None, ["actor.clip_ratio=0.3", "trainer.logger=[console,mlflow]", "actor.clip_ratio_low=0.1",
                             "trainer.experiment_name=2024-01-01", "trainer.profile_steps=[1,2]"])
    path = os.path.join(data_dir, "saved.yaml")
    save_config(cfg, path)
    assert load_config(path) == cfg and config_to_dict(load_config(path)) == config_to_dict(cfg)
    assert not math.isnan(load_config(path).actor.clip_ratio)
