"""The memoized dataclass literal types (tasks.literal_types) equal flytekit's own."""

from __future__ import annotations

import tasks  # noqa: F401  (installs the memo)
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from rlhf.config.schema import PPOConfig
from tasks import literal_types
from rlhf.round.state import RoundState


def test_memoized_literal_types_equal_flytekits_own():
    assert DataclassTransformer.get_literal_type is literal_types._memoized
    transformer = TypeEngine.get_transformer(PPOConfig)
    for t in (PPOConfig, RoundState):
        first, again = TypeEngine.to_literal_type(t), TypeEngine.to_literal_type(t)
        own = literal_types._ORIGINAL(transformer, t)
        assert first.to_flyte_idl() == own.to_flyte_idl() == again.to_flyte_idl()
        assert first is not again  # a caller that changes its copy changes no other


def test_a_changed_copy_leaves_the_memo_intact():
    lt = TypeEngine.to_literal_type(PPOConfig)
    assert isinstance(lt.metadata, dict) and lt.metadata  # PPOConfig's JSON schema
    lt.metadata["title"] = "changed"
    assert TypeEngine.to_literal_type(PPOConfig).metadata.get("title") != "changed"
