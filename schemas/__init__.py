"""Pandera models of every table that crosses a task boundary."""

from schemas.prompts import (
    DATAFRAME_CHECK_COLUMNS,
    FINISH_REASONS,
    REWARD_STYLES,
    PromptSchema,
    RolloutSchema,
    ScoredRolloutSchema,
    dump_json_column,
    load_json_column,
)
from schemas.rollouts import StoredRolloutSchema

__all__ = [
    "DATAFRAME_CHECK_COLUMNS",
    "FINISH_REASONS",
    "REWARD_STYLES",
    "PromptSchema",
    "RolloutSchema",
    "ScoredRolloutSchema",
    "StoredRolloutSchema",
    "dump_json_column",
    "load_json_column",
]
