"""Read and atomically write prompt tables (validated by `rlhf.data.validation`).

`read_prompts` accepts the flat layout of `schemas.PromptSchema` and verl's nested
layout (as written by verl's `examples/data_preprocess/gsm8k.py`):

    data_source: str, prompt: list<struct{role, content}>, ability: str,
    reward_model: struct{style, ground_truth}, extra_info: struct{...}

and returns the flat one: the chat list becomes its JSON string, `reward_model` becomes
`reward_style` / `ground_truth`, `extra_info` becomes a JSON object string, and any other
column is kept inside `extra_info` under its own name. Ground truths of either layout get
one text form (`rlhf.data.ground_truth`: 86.0 is "86"; NaN is missing). Every row is validated; a bad row
raises `DataValidationError` naming the file, row and column, unless `drop_invalid`
drops it (the count is in `df.attrs["n_dropped"]`).
"""

from __future__ import annotations

import datetime
import json
import os
import posixpath
import tempfile
from typing import Any, Sequence

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import split_protocol
from fsspec.implementations.local import LocalFileSystem

from rlhf.data.ground_truth import ground_truth_texts
from rlhf.data.validation import DataValidationError, validate_prompts

FLAT_COLUMNS = ("prompt", "data_source", "ability", "reward_style", "ground_truth", "extra_info")
_LOCAL_PROTOCOLS = (None, "file", "local")
_LAYOUT_HINT = (
    "a prompt file needs columns prompt, data_source, ability and either reward_model "
    "{style, ground_truth} (verl layout) or reward_style + ground_truth (flat layout); extra_info is optional")


# ---------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------


def resolve_path(path: str, base_dir: str = "") -> str:
    """`path` checked against `base_dir` (if set): it may not resolve outside it.

    A relative local path is taken relative to `base_dir` when one is set.
    """
    if not path:
        raise DataValidationError("empty dataset path; set data.train_files / data.val_files to a parquet "
                                  "file, a directory of parquet files or an fsspec URI")
    if not base_dir:
        return path
    proto, rest = split_protocol(path)
    base_proto, base_rest = split_protocol(base_dir)
    local, base_local = proto in _LOCAL_PROTOCOLS, base_proto in _LOCAL_PROTOCOLS
    if local != base_local or (not local and proto != base_proto):
        raise DataValidationError(f"dataset path {path!r} is not on the same filesystem as data.base_dir "
                                  f"{base_dir!r}; move the data under data.base_dir or change it")
    if local:
        base = os.path.realpath(base_rest)
        resolved = os.path.realpath(os.path.join(base, rest))
        inside = os.path.commonpath([resolved, base]) == base
    else:
        base = posixpath.normpath("/" + base_rest)
        resolved = posixpath.normpath("/" + rest)
        inside = resolved == base or resolved.startswith(base.rstrip("/") + "/")
    if not inside:
        raise DataValidationError(f"dataset path {path!r} resolves to {resolved!r}, outside data.base_dir "
                                  f"{base_dir!r}; move the data under data.base_dir or change data.base_dir")
    return resolved if local else f"{proto}://{resolved.lstrip('/')}"


def list_parquet_files(path: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """A file, or the sorted `*.parquet` files of a directory, on any fsspec filesystem."""
    fs, root = fsspec.core.url_to_fs(path)
    if fs.isdir(root):
        files = sorted(fs.glob(posixpath.join(root.rstrip("/"), "*.parquet")))
        if not files:
            raise DataValidationError(f"{path}: directory has no *.parquet files; point the path at a parquet "
                                      "file or a directory holding some")
        return fs, files
    if not fs.exists(root):
        raise DataValidationError(f"{path}: no such file or directory; check data.train_files / data.val_files")
    return fs, [root]


def _display_name(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _read_table(fs: fsspec.AbstractFileSystem, path: str, name: str) -> pa.Table:
    try:
        with fs.open(path, "rb") as f:
            return pq.read_table(f)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataValidationError(
            f"{name}: cannot be read as parquet ({type(e).__name__}: {e}); check that the file is complete and "
            "really parquet (re-create it, e.g. with `python -m rlhf.data.gsm8k`)") from e


# ---------------------------------------------------------------------------------
# verl layout -> flat layout
# ---------------------------------------------------------------------------------


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    if isinstance(obj, (datetime.date, datetime.datetime, datetime.time)):
        return obj.isoformat()
    return str(obj)


def to_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=_json_default)


def _chat_to_json(messages: list[dict] | None) -> str | None:
    if messages is None:
        return None
    # A list<struct> column unifies message fields across rows; unset ones come back as None.
    # Anything but a message (e.g. a list of strings) is kept for validation to report.
    return to_json([{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                    for m in messages])


def _prompt_values(table: pa.Table) -> list[Any]:
    column = table.column("prompt")
    values = column.to_pylist()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return [_chat_to_json(v) for v in values]
    return values


def _reward_values(table: pa.Table, name: str) -> tuple[list[Any], list[Any]]:
    names = table.column_names
    if "reward_model" not in names:
        return table.column("reward_style").to_pylist(), table.column("ground_truth").to_pylist()
    if "reward_style" in names or "ground_truth" in names:
        raise DataValidationError(f"{name}: has both reward_model and reward_style/ground_truth columns; "
                                  "keep one layout (verl's reward_model struct or the flat columns)")
    column = table.column("reward_model")
    if not pa.types.is_struct(column.type) or column.type.get_field_index("style") < 0:
        raise DataValidationError(f"{name}: column 'reward_model' has type {column.type}, expected "
                                  "struct<style: string, ground_truth: ...> as verl writes it")
    rows = column.to_pylist()
    styles = [None if r is None else r.get("style") for r in rows]
    truths = [None if r is None else r.get("ground_truth") for r in rows]
    return styles, truths


def _extra_info_values(table: pa.Table, extra_columns: Sequence[str]) -> list[Any]:
    n = table.num_rows
    if "extra_info" in table.column_names:
        column = table.column("extra_info")
        values = column.to_pylist()
        if pa.types.is_map(column.type):
            values = [None if v is None else dict(v) for v in values]
    else:
        values = [None] * n
    values = [{} if v is None else v for v in values]
    if extra_columns:
        extras = {c: table.column(c).to_pylist() for c in extra_columns}
        values = [_merge_extra(v, {c: extras[c][i] for c in extra_columns}) for i, v in enumerate(values)]
    return [v if isinstance(v, str) else to_json(v) for v in values]


def _merge_extra(info: Any, extra: dict) -> Any:
    if isinstance(info, str):
        try:
            parsed = json.loads(info)
        except ValueError:
            return info  # left for validation to report
        if not isinstance(parsed, dict):
            return info
        info = parsed
    if not isinstance(info, dict):
        return info
    return {**extra, **info}


def flatten_verl(table: pa.Table, name: str = "<table>") -> pd.DataFrame:
    """verl's nested layout (or the flat one) -> a DataFrame with the flat columns, unvalidated.

    Text that is not valid UTF-8 (parquet strings must be) raises naming the column and row.
    """
    try:
        return _flatten_verl(table, name)
    except UnicodeDecodeError as e:
        raise DataValidationError(f"{name}: {_where_not_utf8(table)} holds bytes that are not valid UTF-8 ({e}); "
                                  "parquet text must be UTF-8: decode the source text with its real encoding "
                                  "and write the file again") from e


def _where_not_utf8(table: pa.Table) -> str:
    """'column 'x', row 3' for the first value (or column name) that does not decode."""
    for i in range(table.num_columns):
        try:
            column = repr(table.field(i).name)
        except UnicodeDecodeError:
            return f"the name of column #{i}"
        values = table.column(i)
        for row in range(len(values)):
            try:
                values[row].as_py()
            except UnicodeDecodeError:
                return f"column {column}, row {row},"
    return "a value"


def _flatten_verl(table: pa.Table, name: str) -> pd.DataFrame:
    names = table.column_names
    has_flat_reward = "reward_style" in names and "ground_truth" in names
    missing = [c for c in ("prompt", "data_source", "ability") if c not in names]
    if "reward_model" not in names and not has_flat_reward:
        missing.append("reward_model (or reward_style + ground_truth)")
    if missing:
        raise DataValidationError(f"{name}: missing column(s) {', '.join(missing)}; {_LAYOUT_HINT}; "
                                  f"found columns {', '.join(names) or '(none)'}")
    styles, truths = _reward_values(table, name)  # ground truths as stored: text, numbers, JSON values
    known = set(FLAT_COLUMNS) | {"reward_model"}
    extra_columns = [c for c in names if c not in known and not c.startswith("__index_level_")]
    return pd.DataFrame({
        "prompt": _prompt_values(table),
        "data_source": table.column("data_source").to_pylist(),
        "ability": table.column("ability").to_pylist(),
        "reward_style": styles,
        "ground_truth": ground_truth_texts(truths),  # one text form for both layouts
        "extra_info": _extra_info_values(table, extra_columns),
    })


# ---------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------


def read_prompts(path: str | Sequence[str], drop_invalid: bool = False, base_dir: str = "") -> pd.DataFrame:
    """Prompt table(s) at `path` (file, directory of *.parquet, fsspec URI, or a list of them), flat and validated.

    `df.attrs`: `n_dropped` (rows dropped by `drop_invalid`), `source` (the path(s) given).
    """
    paths = [path] if isinstance(path, str) else list(path)
    if not paths:
        raise DataValidationError("no dataset path given; set data.train_files / data.val_files")
    frames, n_dropped = [], 0
    for p in paths:
        fs, files = list_parquet_files(resolve_path(p, base_dir))
        for f in files:
            name = _display_name(fs, f)
            if base_dir and isinstance(fs, LocalFileSystem):  # a listed file may link to elsewhere
                resolve_path(name, base_dir)
            df = validate_prompts(flatten_verl(_read_table(fs, f, name), name), name, drop_invalid)
            n_dropped += df.attrs["n_dropped"]
            frames.append(df)
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    out.attrs = {"n_dropped": n_dropped, "source": path if isinstance(path, str) else ",".join(paths)}
    return out


def write_table_atomic(table: pa.Table, path: str) -> None:
    """Write parquet so that readers see the old file or the new one, never a partial one.

    Local paths: a temp file in the same directory, fsynced, then `os.replace`. Object
    stores (s3://, gs://, ...): one whole-object put, which those stores make atomic.
    """
    fs, target = fsspec.core.url_to_fs(path)
    if not isinstance(fs, LocalFileSystem):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        fs.pipe_file(target, sink.getvalue().to_pybytes())
        return
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_parquet_atomic(df: pd.DataFrame, path: str) -> None:
    """`df` (index dropped) to parquet at `path`, atomically (see `write_table_atomic`)."""
    write_table_atomic(pa.Table.from_pandas(df, preserve_index=False), path)
