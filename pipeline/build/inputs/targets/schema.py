"""Frozen dataclasses from parsed TOML tables, with type, choice and range checks: what target files are parsed
with (`pipeline.build.inputs.targets`). Unknown keys, wrong types, values out of range and a `name` that is not a
safe file name
(`NAME_PATTERN`) are TargetErrors naming the file and the key."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

from pipeline.errors import TargetError


def _check_range(value, bounds, where: str) -> None:
    low, high = bounds
    for item in value if isinstance(value, tuple) else (value,):
        if item != item or (low is not None and item < low) or (high is not None and item > high):
            span = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise TargetError(f"{where}: {item!r} is out of range; it must be {span}")


# Names become folder and file names (a target's file, a candidate's scratch folder): no separators, no dot first.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def _check_name(value: str, where: str) -> None:
    if not NAME_PATTERN.fullmatch(value):
        raise TargetError(
            f"{where}: {value!r} is not a valid name; a name matches {NAME_PATTERN.pattern} (lower-case letters, "
            "digits, '.', '_' and '-', starting with a letter or digit, at most 64 characters)"
        )


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, where: str):
    """Check `value` against the field type `tp`; return it in the dataclass's form (lists become tuples)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise TargetError(f"{where}: expected a list of {_type_name(args[0])}, got {value!r}")
        try:
            return tuple(_coerce(v, args[0], where) for v in value)
        except TargetError:  # true is not a number here either
            raise TargetError(f"{where}: expected a list of {_type_name(args[0])}, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TargetError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TargetError(f"{where}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise TargetError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def dataclass_from_table(cls, table: dict, path: Path, prefix: tuple[str, ...] = (), choices=None, ranges=None):
    """`cls` (a frozen dataclass, nested ones as sub-tables and tuples of them as arrays of tables) from a parsed
    TOML `table`. `choices` maps (section, key) to the values allowed there and `ranges` to (lowest, highest),
    either side None for open; a candidate's sub-table falls back to the ranges of its last two keys. Every problem
    is a TargetError naming the file and the key."""
    choices, ranges = choices or {}, ranges or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        section = "[" + ".".join(prefix) + "]" if prefix else "the top level"
        raise TargetError(
            f"{path}: unknown key {'.'.join(prefix + (unknown[0],))!r} in {section}; known keys there: "
            f"{', '.join(sorted(fields))}. Fix the spelling or remove it."
        )
    values = {}
    for name, field in fields.items():
        where = f"{path}: key {'.'.join(prefix + (name,))!r}"
        if name not in table:
            if field.default is dataclasses.MISSING:
                raise TargetError(f"{where} is required and missing")
            continue
        tp = hints[name]
        if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            if not isinstance(table[name], list) or not all(isinstance(t, dict) for t in table[name]):
                raise TargetError(f"{where}: expected [[{name}]] tables, got {table[name]!r}")
            values[name] = tuple(
                dataclass_from_table(typing.get_args(tp)[0], t, path, prefix + (name,), choices, ranges)
                for t in table[name]
            )
            names = [item.name for item in values[name]]
            if len(set(names)) != len(names):
                raise TargetError(f"{where}: two [[{name}]] share a name; each needs its own")
            continue
        if dataclasses.is_dataclass(tp):
            if not isinstance(table[name], dict):
                raise TargetError(f"{where}: expected a [{name}] table, got {table[name]!r}")
            values[name] = dataclass_from_table(tp, table[name], path, prefix + (name,), choices, ranges)
            continue
        value = _coerce(table[name], tp, where)
        if name == "name":
            _check_name(value, where)
        # A candidate's [candidates.accuracy] thresholds have the ranges of the target's [accuracy].
        bounds = ranges.get(prefix + (name,)) or ranges.get((prefix + (name,))[-2:])
        if bounds:
            _check_range(value, bounds, where)
        allowed = choices.get(prefix + (name,))
        for item in value if isinstance(value, tuple) else (value,):
            if allowed and item not in allowed:
                raise TargetError(f"{where}: {item!r} is not one of {', '.join(map(str, allowed))}")
        values[name] = value
    return cls(**values)
