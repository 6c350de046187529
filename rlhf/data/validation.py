"""Validation of tables against the pandera models of `schemas`: `validate_frame` raises
`DataValidationError` with one readable line per problem (column, rows, what was
expected), or drops the rows that fail row-wise checks when asked to.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import pandera.errors

from schemas.prompts import DATAFRAME_CHECK_COLUMNS, PromptSchema

_MAX_ROWS_SHOWN = 5


class DataValidationError(ValueError):
    """A dataset file or row is invalid; the message names the file, row, column and what to do."""


def _short(value: Any) -> str:
    text = repr(value.item() if hasattr(value, "item") else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _cell(df: pd.DataFrame, row: int, column: str) -> str:
    return _short(df.at[row, column]) if column in df.columns and row in df.index else "?"


def _problems(failures: pd.DataFrame, df: pd.DataFrame, schema: type) -> tuple[list[str], set[int], bool]:
    """Readable lines, the bad row indices, and whether some problem is not about single rows."""
    name = getattr(schema.Config, "name", schema.__name__)
    missing = failures[failures["check"] == "column_in_dataframe"]
    if len(missing):  # the other checks cannot run without these columns
        cols = ", ".join(repr(c) for c in missing["failure_case"])
        return [f"missing column(s) {cols}; expected columns {', '.join(schema.to_schema().columns)}"], set(), True
    failures = failures.assign(column=[DATAFRAME_CHECK_COLUMNS.get(k, c)
                                       for c, k in zip(failures["column"], failures["check"])])
    is_dtype = failures["check"].astype(str).str.startswith("dtype(")
    bad_dtype_columns = set(failures.loc[is_dtype, "column"])
    lines: list[str] = []
    bad_rows: set[int] = set()
    table_level = False
    for (column, check), group in failures.groupby(["column", "check"], sort=False, dropna=False):
        rows = sorted({int(i) for i in group["index"] if i is not None and not pd.isna(i)})
        if check == "column_in_schema":
            table_level = True
            lines.append(f"unexpected column(s) {', '.join(repr(c) for c in group['failure_case'])}: "
                         f"{name} is strict; drop or rename them")
        elif str(check).startswith("dtype("):
            table_level = True
            want = schema.to_schema().columns[column].dtype.type
            shown = "; ".join(f"row {r}: {_cell(df, r, column)}" for r in rows[:_MAX_ROWS_SHOWN])
            lines.append(f"column {column!r} has dtype {df[column].dtype}, expected "
                         f"{getattr(want, '__name__', want)} values ({shown})")
        elif not rows:
            if column not in bad_dtype_columns:  # a check that crashed on a wrongly typed column is noise
                table_level = True
                lines.append(f"column {column!r} failed check {check!r}: {_short(group['failure_case'].iloc[0])}")
        else:
            bad_rows.update(rows)
            expected = "a value (not null)" if check == "not_nullable" else check
            shown = "; ".join(f"row {r}: got {_cell(df, r, column)}" for r in rows[:_MAX_ROWS_SHOWN])
            more = f" (and {len(rows) - _MAX_ROWS_SHOWN} more rows)" if len(rows) > _MAX_ROWS_SHOWN else ""
            lines.append(f"column {column!r}, expected {expected}: {shown}{more}")
    return lines, bad_rows, table_level


def validate_frame(df: pd.DataFrame, schema: type = PromptSchema, source: str = "<dataframe>",
                   drop_invalid: bool = False) -> pd.DataFrame:
    """Validate `df` against a pandera model; returns it with a fresh RangeIndex.

    Row indices in messages are positions in `df` (rows of the file it came from).
    `drop_invalid` drops rows that fail row-wise checks and sets `attrs["n_dropped"]`;
    missing/extra columns and wrong dtypes always raise.
    """
    name = getattr(schema.Config, "name", schema.__name__)
    if len(df) == 0:
        raise DataValidationError(f"{source}: the dataset has no rows; point the path at a non-empty dataset")
    df = df.reset_index(drop=True)
    try:
        out = schema.validate(df, lazy=True)
        out.attrs["n_dropped"] = 0
        return out
    except pandera.errors.SchemaErrors as e:
        lines, bad_rows, table_level = _problems(e.failure_cases, df, schema)
    if table_level or not drop_invalid:
        fix = ("fix the columns in the file (or in the code that built the table)" if table_level else
               "fix these rows, or set data.drop_invalid=true to drop invalid rows (they are counted)")
        raise DataValidationError(f"{source}: {len(lines)} problem(s) against {name}:\n  - "
                                  + "\n  - ".join(lines) + f"\n{fix}")
    if len(bad_rows) == len(df):
        raise DataValidationError(f"{source}: all {len(df)} rows are invalid against {name}:\n  - "
                                  + "\n  - ".join(lines))
    kept = df.drop(index=sorted(bad_rows)).reset_index(drop=True)
    out = schema.validate(kept, lazy=True)
    out.attrs["n_dropped"] = len(bad_rows)
    return out


def validate_prompts(df: pd.DataFrame, source: str = "<dataframe>", drop_invalid: bool = False) -> pd.DataFrame:
    """`validate_frame` against `PromptSchema`."""
    return validate_frame(df, PromptSchema, source, drop_invalid)
