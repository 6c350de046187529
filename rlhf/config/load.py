"""Reading a config: files, nested mappings and dotted `key=value` overrides.

`load_config` reads YAML or JSON and applies overrides; `from_dict` builds from a nested
mapping; `replace` is a config with overrides applied; `save_config` writes YAML. Every
path goes through `from_dict`: the data is copied to plain values (bounded by
`MAX_CONFIG_VALUES` and `MAX_CONFIG_DEPTH`), verl's keys are translated, each value is
coerced to its field's type, unknown keys raise with the closest valid name, and the
built tree is validated. The tree is frozen and never mutated afterwards.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import fields, is_dataclass
from typing import Any, get_args, get_origin

import yaml

from rlhf.config.checks import validate
from rlhf.config.correction import correction_settings
from rlhf.config.ranges import check_ranges, warn_repeated
from rlhf.config.schema import ConfigError, PPOConfig, _all_keys, _hints, _key_names, _unknown, flatten, to_dict
from rlhf.config.verl_defaults import resolve_defaults
from rlhf.config.verl_keys import is_verl_key, leaf_keys, translate_keys, translate_override

# libyaml's loader and dumper when PyYAML has them (6x faster), with the same safe types.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


_PATH_LISTS = ("data.train_files", "data.val_files")  # a path may hold a comma: never split


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = get_origin(tp)
    if origin is list:
        if isinstance(value, str) and key in _PATH_LISTS:
            value = [value] if value else []
        elif isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_coerce(key, v, item_tp) for v in value]
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is not None and args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            try:
                number = float(number)
            except OverflowError:
                raise ConfigError(f"config key '{key}' is too large for a float: {value!r}") from None
            if math.isnan(number):
                raise ConfigError(f"config key '{key}' is NaN; give a number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{key}' expects {getattr(tp, '__name__', tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise _unknown(f"{prefix}{k}", _key_names(), "")
        t = hints[k]
        if is_dataclass(t):
            kwargs[k] = _build(t, v if v is not None else {}, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(f"{prefix}{k}", v, t)
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    keys = _all_keys(PPOConfig, "")
    if key not in keys and not any(k.startswith(key + ".") for k in keys):
        raise _unknown(key, list(keys), " in override")
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed value); the value is parsed as YAML (`1e-3`, `true`, `[a,b]`)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value, e.g. actor.clip_ratio=0.3")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(raw):
        value = float(raw)
    _refuse_unquoted_bounds(key, raw, value)
    return key, value


_BOUND_KEYS = ("rollout_is_threshold", "rollout_rs_threshold")  # verl's 'lower_upper' strings


def _refuse_unquoted_bounds(key: str, raw: str, value: Any) -> None:
    """`rollout_is_threshold=0.5_2` reads as the number 0.52 (YAML and Hydra allow `_` in
    numbers), which no one means: the bounds 0.5 and 2 are the quoted string '0.5_2'."""
    if key.rsplit(".", 1)[-1] in _BOUND_KEYS and isinstance(value, (int, float)) and "_" in raw:
        raise ConfigError(f"override '{key}={raw}' reads as the number {value!r}; for the bounds lower_upper "
                          f"quote it ({key}='{raw.strip()}'), for a number write it without '_'")


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False



MAX_CONFIG_VALUES = 10_000  # a config has ~150 keys; more values means repeated YAML aliases
MAX_CONFIG_DEPTH = 16  # sections nest 3 deep


def _plain(value: Any, key: str, seen: tuple[int, ...], count: list[int]) -> Any:
    """A copy made of dicts, lists and plain scalars; anything else (dates, sets, bytes, aliases
    that refer to themselves or expand without bound) raises `ConfigError` naming the key."""
    count[0] += 1
    if count[0] > MAX_CONFIG_VALUES or len(seen) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"config data at '{key}' is nested too deeply or repeats YAML aliases beyond "
                          f"{MAX_CONFIG_VALUES} values; write the values out")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):  # YAML reads an unquoted 2024-01-01 as a date
        return value.isoformat()
    if not isinstance(value, (dict, list, tuple)):
        raise ConfigError(f"config key '{key}' holds a {type(value).__name__} ({str(value)[:40]}); "
                          "write it as a quoted string or a number")
    if id(value) in seen:
        raise ConfigError(f"config key '{key}' refers to itself (a recursive YAML alias)")
    inner = seen + (id(value),)
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k), inner, count) for k, v in value.items()}
    return [_plain(v, key, inner, count) for v in value]


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> PPOConfig:
    """Build and validate a config from a nested mapping plus dotted overrides. verl's key
    names are translated; when any is used (in the mapping or the overrides), the keys left
    unset take verl 0.9.1's defaults (`rlhf.config.verl_defaults`)."""
    plain = _plain(data or {}, "", (), [0])  # a deep copy of plain data
    tree, verl = translate_keys(plain)
    given = leaf_keys(plain)
    origin: dict[str, tuple[str, Any]] = {}
    for text in overrides:
        k, v = parse_override(text)
        v = _plain(v, k, (), [0])
        verl, given = verl or is_verl_key(k, v), given | {k}
        for key, value in translate_override(k, v):
            _refuse_two_spellings(origin, key, k, value)
            _set_dotted(tree, key, value)
    cfg = _build(PPOConfig, resolve_defaults(tree, verl, given))
    validate(cfg)
    correction_settings(cfg)  # raises on a bad preset, conflicting keys or a value verl refuses
    check_ranges(flatten(cfg))
    return cfg


def _refuse_two_spellings(origin: dict[str, tuple[str, Any]], target: str, key: str, value: Any) -> None:
    """Two overrides spelt differently (a verl name and this project's, or two verl names) that
    set one key to different values: refused, naming both (the same key given twice: the last wins)."""
    if target in origin and origin[target][0] != key and origin[target][1] != value:
        raise ConfigError(f"overrides '{origin[target][0]}' and '{key}' both set '{target}' "
                          f"({origin[target][1]!r} vs {value!r}); keep one")
    origin[target] = (key, value)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PPOConfig:
    """Load YAML or JSON (`path` may be None for the defaults) and apply overrides (a key
    given twice among them is warned about: the last one wins)."""
    warn_repeated(overrides)
    data = read_config_file(path) if path else {}
    try:
        return from_dict(data, overrides)
    except ConfigError as e:
        if path:
            raise ConfigError(f"{path}: {e}") from e
        raise


def read_config_file(path: str | os.PathLike) -> dict:
    """The mapping a YAML or JSON config file holds, as written (not yet checked against the config)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text ({e}); save it as UTF-8") from e
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.load(text, Loader=_YAML_LOADER)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid YAML/JSON: {e}") from e
    except RecursionError as e:
        raise ConfigError(f"config file '{path}' nests lists or mappings too deeply to parse") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    return data


def save_config(cfg: PPOConfig, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.dump(to_dict(cfg), f, Dumper=_YAML_DUMPER, sort_keys=False)


def replace(cfg: PPOConfig, overrides: list[str] | tuple[str, ...]) -> PPOConfig:
    """A new config: `cfg` with dotted overrides applied (the original is untouched)."""
    return from_dict(to_dict(cfg), overrides)

