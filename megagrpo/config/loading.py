"""Loading a configuration: the YAML file, TRL-style names, `key.sub=value` overrides, and
type checking of every value against the schema (schema.py). The checks of the values come
after, from megagrpo/validation.py. Every error names the key, the value and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
import types
import typing
from typing import Any, Literal, Optional

import yaml

from megagrpo.config.aliases import ALIASES, RENAMED
from megagrpo.config.schema import SINKS, Config, ConfigError


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is {child!r}, not a section")
        node = child
    node[parts[-1]] = value


def _canonical(key: str, value: Any) -> tuple[str, Any]:
    """A TRL-style name -> its dotted place; use_vllm -> rollout.engine; TRL's
    max_tool_calling_iterations (tool rounds) -> rollout.max_turns (model turns, one more)."""
    if key == "max_tool_calling_iterations":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"max_tool_calling_iterations: expected an integer >= 0, got {value!r}")
        return "rollout.max_turns", value + 1
    if key == "use_vllm":
        if not isinstance(value, bool):
            raise ConfigError(f"use_vllm: expected true or false, got {value!r}")
        return "rollout.engine", "vllm" if value else "hf"
    if key == "use_peft":  # LoRA at TRL's default rank, 16
        if not isinstance(value, bool):
            raise ConfigError(f"use_peft: expected true or false, got {value!r}")
        return "model.lora.r", 16 if value else 0
    return ALIASES.get(key, key), value


def _apply_aliases(raw: dict) -> dict:
    out: dict = {}
    raw = dict(raw)
    use_peft = raw.pop("use_peft", None)
    for key, value in raw.items():
        dotted, value = _canonical(key, value)
        if dotted == key and isinstance(value, dict):  # a section: merge with aliases seen so far
            out.setdefault(key, {}).update(value)
        else:
            _set_dotted(out, dotted, value)
    if use_peft is not None:  # TRL's switch, after the loop: a lora_r beside it keeps its rank
        _, rank = _canonical("use_peft", use_peft)
        lora = out.setdefault("model", {}).setdefault("lora", {})
        lora["r"] = lora.get("r", rank) if rank else 0
    return out


def _apply_renames(raw: dict) -> None:
    """Former setting names (aliases.RENAMED) moved to their new places, with a line saying so."""
    for old, new in RENAMED.items():  # both "section.key"
        section, name = old.split(".")
        node = raw.get(section)
        if not isinstance(node, dict) or name not in node:
            continue
        new_section, new_name = new.split(".")
        target = raw.setdefault(new_section, {})
        if new_name in target:
            raise ConfigError(f"{old} and {new} are both set; {old} is the former name of {new}: keep only {new}")
        target[new_name] = node.pop(name)
        print(f"megagrpo: warning: {old} is now {new}; the old name still works", file=sys.stderr)


def parse_override(text: str) -> tuple[str, Any]:
    """`grpo.kl_coef=0.1` -> ("grpo.kl_coef", 0.1); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value (example: grpo.kl_coef=0.1)")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("-")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def _check_type(path: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(path, value, inner[0])
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(args)}{hint_text}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint in (list, dict) or origin in (list, dict):
        base = origin or hint
        if not isinstance(value, base):
            raise ConfigError(f"{path}: expected a {base.__name__}, got {value!r}")
        if base is list and args:
            return [_check_type(f"{path}[{i}]", _shorthand(item, args[0]), args[0]) for i, item in enumerate(value)]
        return value
    raise ConfigError(f"{path}: unsupported type {hint}")


def _shorthand(item: Any, hint: Any) -> Any:
    """In a list of dataclasses a bare value names the first field: `[answer_match]` is
    `[{name: answer_match}]`."""
    if dataclasses.is_dataclass(hint) and not isinstance(item, dict):
        return {dataclasses.fields(hint)[0].name: item}
    return item


def _build(cls, raw: Any, path: str):
    """An instance of dataclass `cls` from a mapping, every value type-checked."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            candidates = names + ([a for a in ALIASES] + ["use_vllm", "use_peft", "max_tool_calling_iterations"]
                                  if not path else [])
            close = difflib.get_close_matches(key, candidates, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{where}' ({fix})")
        kwargs[key] = _check_type(where, value, hints[key])
    return cls(**kwargs)


def read_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """Read a YAML file, apply `key.sub=value` overrides and build the Config, every value
    type-checked; megagrpo.validation.load_config also checks the values."""
    raw: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    raw = _apply_aliases(raw)
    for text in overrides:
        _set_dotted(raw, *_canonical(*parse_override(text)))
    _apply_renames(raw)
    cfg = _build(Config, raw, "")
    _expand_shorthands(cfg)
    return cfg


def _expand_shorthands(cfg: Config) -> None:
    """The values that stand for others, written out as they are meant, once, while the config
    is built (validation then only checks): importance_sampling_correction true/false (TRL's
    switch) as token_truncate/none; logging.report_to's single name as a list of one, `all` as
    every sink, `none` as none."""
    g, logging = cfg.grpo, cfg.logging
    if isinstance(g.importance_sampling_correction, bool):
        g.importance_sampling_correction = "token_truncate" if g.importance_sampling_correction else "none"
    names = [logging.report_to] if isinstance(logging.report_to, str) else logging.report_to
    if isinstance(names, list) and all(isinstance(n, str) for n in names):  # anything else is refused later
        names = list(SINKS) if "all" in names else names
        logging.report_to = [n for n in dict.fromkeys(names) if n != "none"]


def resolve_dotted(name: str, what: str, error: type[Exception] = ConfigError):
    """The object a `package.module:attribute` setting names (a reward, a tool, a parser, an
    environment class); `error` naming `what` when it does not resolve."""
    if ":" not in name:
        raise error(f"{what}: '{name}' is not a dotted path module:name")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{what}: cannot import module '{module_name}': {e}") from None
    if not hasattr(module, attr):
        raise error(f"{what}: module '{module_name}' has no '{attr}'")
    return getattr(module, attr)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
