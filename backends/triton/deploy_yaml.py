"""A deployment file's YAML (``backends.triton.deploy_config``) read into its dataclasses: a key given twice in one
mapping is refused (PyYAML would keep the last), unknown and missing keys too, and each value is checked against its
field's type; every error is a :class:`ConfigError` naming the dotted key.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A deployment file that cannot be served; ``key`` is the dotted key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def build(cls: type, data: object, where: str = ""):
    """``cls`` (a dataclass of ``deploy_config``) from parsed YAML ``data`` (a mapping, or None for the defaults),
    checking keys and types. Raises ConfigError naming the dotted key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where or "the file", f"must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in data if key not in names]
    if unknown:
        raise ConfigError(_key(where, unknown[0]), f"unknown key; known here: {', '.join(names)}")
    values = {}
    for f in dataclasses.fields(cls):
        key = _key(where, f.name)
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(key, "missing")
            continue
        values[f.name] = _value(data[f.name], hints[f.name], key)
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(_key(where, exc.key), exc.message) from None


def _value(value: object, hint: object, key: str):
    """``value`` checked against a field's type: a section (dataclass), or a union of int, float, str, bool, None
    and tuple[int, ...] (a YAML list)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option) and (value is None or isinstance(value, dict)):
            return None if value is None and type(None) in options else build(option, value, key)
        if option is type(None) and value is None:
            return None
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if option is bool and isinstance(value, bool):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    kinds = {int: "an integer", float: "a number", str: "a string", bool: "on/off", type(None): "null"}
    wanted = " or ".join(kinds.get(o, "a list of integers" if typing.get_origin(o) is tuple else "a mapping")
                         for o in options)
    raise ConfigError(key, f"must be {wanted}, got {value!r}")


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def read_yaml(path: Path) -> object:
    """The parsed YAML of the file ``path`` (None when empty). Raises ConfigError naming the file when it cannot be
    read or parsed, and naming the file and the dotted key that one mapping gives twice (with the lines of both)."""
    try:
        loader = yaml.SafeLoader(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read it: {exc}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicate_keys(node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"cannot read it: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.key}", exc.message) from None
    finally:
        loader.dispose()


def _no_duplicate_keys(node: yaml.Node, where: str = "", seen: set[int] | None = None) -> None:
    """Raises ConfigError naming a key that a mapping under ``node`` (a composed YAML node) gives twice. A node met
    again through an alias (``*name``) is not walked again: ``seen`` holds the ids of those walked, so a file whose
    aliases nest deep, or refer to themselves, costs no more than its nodes."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            name, line = str(key_node.value), key_node.start_mark.line + 1
            if name in lines:
                raise ConfigError(_key(where, name), f"given twice (lines {lines[name]} and {line}); give it once")
            lines[name] = line
            _no_duplicate_keys(value_node, _key(where, name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicate_keys(item, where, seen)
