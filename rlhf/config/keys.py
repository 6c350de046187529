"""Config inputs decoded outside `load_config` held to their dataclass's keys.

flytekit builds a dataclass input (`pyflyte run ... --cfg FILE`, a console or flytectl
launch) with dataclasses_json or mashumaro, which drop keys they do not know. The configs'
`from_json` and `__pre_deserialize__` hooks (`PPOConfig` has them from
`rlhf.config.decoding`) call `from_json_checked` / `check_keys`, so a misspelled key
stops the launch with its dotted path and the closest valid name instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import fields, is_dataclass
from typing import Any, get_args, get_origin

from rlhf.config.schema import ConfigError, PPOConfig, _hint, _hints, _key_names
from rlhf.config.verl_defaults import resolve_defaults
from rlhf.config.verl_keys import leaf_keys, translate_keys


def _list_item_class(tp: Any) -> type | None:
    """The dataclass of a `list[SomeDataclass]` field, else None."""
    if get_origin(tp) is list:
        args = get_args(tp)
        if len(args) == 1 and is_dataclass(args[0]):
            return args[0]
    return None


@functools.lru_cache(maxsize=None)
def _shape(cls: type) -> tuple[frozenset[str], tuple[tuple[str, type], ...], tuple[tuple[str, type], ...]]:
    """The field names of a section, its nested sections and its lists of sections (name, class)."""
    hints = _hints(cls)
    return (frozenset(f.name for f in fields(cls)),
            tuple((f.name, hints[f.name]) for f in fields(cls) if is_dataclass(hints[f.name])),
            tuple((f.name, item) for f in fields(cls) if (item := _list_item_class(hints[f.name])) is not None))


def _first_unknown(cls: type, data: dict, prefix: str) -> tuple[str, list[str]] | None:
    """(dotted path of the first key of `data` that is no field of `cls`, the valid names at
    its level), looking into nested sections and list entries (`space[2].name`)."""
    names, nested, lists = _shape(cls)
    for k in data:
        if k not in names:
            return f"{prefix}{k}", [f"{prefix}{n}" for n in sorted(names)]
    for name, sub in nested:
        section = data.get(name)
        if isinstance(section, dict):
            found = _first_unknown(sub, section, f"{prefix}{name}.")
            if found is not None:
                return found
    for name, item in lists:
        entries = data.get(name)
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    found = _first_unknown(item, entry, f"{prefix}{name}[{i}].")
                    if found is not None:
                        return found
    return None


def check_keys(data: Any, source: str = "", cls: type | None = None) -> None:
    """Raise `ConfigError` when the nested mapping `data` holds a key that is no field of
    `cls` (default `PPOConfig`; at any depth, list entries included), naming its dotted path
    and the closest valid key; `source`, if given, says where the mapping came from."""
    cls = cls or PPOConfig
    where = f"{source}: " if source else ""
    if not isinstance(data, dict):
        sections = ", ".join(f.name for f in fields(cls)[:2])
        raise ConfigError(f"{where}a config must be a mapping of sections ({sections}, ...), "
                          f"got {type(data).__name__}")
    found = _first_unknown(cls, data, "")
    if found is not None:
        key, level = found
        what = "rlhf.config.PPOConfig, verl's dotted names" if cls is PPOConfig else f"{cls.__module__}.{cls.__name__}"
        raise ConfigError(f"{where}unknown config key '{key}'{_hint(key, [*level, *_key_names(cls)])} Correct or "
                          f"remove it (the keys are the fields of {what}).")


def from_json_checked(cls: type, text: str):
    """`cls` from JSON text as flytekit's click type for a dataclass input builds it (values
    converted by dataclasses_json, as flytekit's own decoding converts them), after
    `check_keys`: an unknown key is a usage error of the option, not silently dropped."""
    data = json.loads(text)
    try:
        if cls is PPOConfig:
            data = launch_tree(data)
        check_keys(data, cls=cls)
    except ConfigError as e:
        raise _option_error(str(e)) from None
    return _decode_as_flytekit(cls, data)



def pre_deserialize_checked(cls: type, data: dict) -> dict:
    """`data` with verl's keys translated and the defaults chosen, after the unknown-key
    check: what mashumaro decodes a config input of a task from."""
    data = launch_tree(data)
    check_keys(data, "cfg input", cls=cls)
    return data


def launch_tree(data: Any) -> Any:
    """A config mapping as a launch gave it, made this project's: verl's key names translated,
    the defaults chosen (verl 0.9.1's for the keys left unset when a verl name is used, as
    `load_config` chooses them) and a dataset path given as one string made a list of one (the
    decoders would read a string as a list of characters)."""
    if not isinstance(data, dict):
        return data
    tree, verl = translate_keys(data)
    tree = resolve_defaults(tree, verl, leaf_keys(data))
    section = tree.get("data")
    if isinstance(section, dict):
        lists = {k: [section[k]] if section[k] else [] for k in ("train_files", "val_files")
                 if isinstance(section.get(k), str)}
        tree = {**tree, "data": {**section, **lists}}
    return tree

def _decode_as_flytekit(cls: type, data: dict):
    """`cls` built from `data` by dataclasses_json, the decoder flytekit's click type uses for
    a dataclass input, so each value converts exactly as it would without the key check.
    The config classes do not inherit `DataClassJsonMixin`; its `from_dict` is called unbound
    on `cls`, the one use of that library's internals here."""
    from dataclasses_json import DataClassJsonMixin  # present wherever flytekit is

    return DataClassJsonMixin.from_dict.__func__(cls, data)


@functools.lru_cache(maxsize=None)
def _option_error_class() -> type[ConfigError]:
    try:
        import click
    except ImportError:
        return ConfigError

    class OptionConfigError(click.BadParameter, ConfigError):
        """Shown by click as a usage error of the option ("Invalid value for '--cfg': ...")."""

    return OptionConfigError


def _option_error(message: str) -> ConfigError:
    """A `ConfigError` that click, when it parses the option, reports without a traceback."""
    return _option_error_class()(message)
