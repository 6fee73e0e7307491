"""Parameter schemas: how a node type declares the YAML ``params`` it accepts."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import attrs

from draftflow.core.yamlio import shorten

PARAM_TYPES = ("int", "float", "str", "bool", "path", "int_list", "str_list", "any")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # default of a parameter the YAML must give


@attrs.frozen
class ParamSpec:
    """One accepted parameter: its type, default (``REQUIRED`` if none) and help text."""

    name: str
    type: str = attrs.field(validator=attrs.validators.in_(PARAM_TYPES))
    default: Any = REQUIRED
    help: str = ""
    choices: tuple | None = None
    minimum: int | float | None = None  # int/float: the smallest value; int_list: of every entry

    def below_minimum(self, value) -> int | float | None:
        """The first value (or list entry) under ``minimum``, else None."""
        if self.minimum is None:
            return None
        values = value if isinstance(value, (tuple, list)) else (value,)
        return next((v for v in values if isinstance(v, (int, float)) and v < self.minimum), None)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def _convert(spec: ParamSpec, value: Any, base_dir: Path | None):
    """Return the converted value, or raise ValueError with what was expected."""
    t = spec.type
    if t == "bool":
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expected an integer")
        return value
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("expected a number")
        try:
            value = float(value)
        except OverflowError:  # an int past 1e308
            raise ValueError("expected a number below 1e308") from None
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    if t == "path":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("expected a path string")
        if "\0" in value:
            raise ValueError("a path cannot contain a NUL character")
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return str(path)
    if t == "int_list":
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError("expected a list of integers")
        return tuple(value)
    if t == "str_list":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("expected a list of strings")
        return tuple(value)
    return value


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(options)) or 'none'}"


def validate_params(schema: tuple[ParamSpec, ...], raw: dict, base_dir: Path | None, dirs: dict | None = None):
    """Check ``raw`` against ``schema``; return (params with defaults filled, [(field, problem, fix)]).

    Relative paths are taken relative to ``dirs[name]`` (the folder of the file that wrote the param) or ``base_dir``."""
    by_name = {p.name: p for p in schema}
    out: dict[str, Any] = {}
    problems: list[tuple[str, str, str]] = []
    for key, value in raw.items():
        spec = by_name.get(key)
        if spec is None:
            problems.append((key, f"unknown parameter {key!r}", f"remove it or rename it; {did_you_mean(key, by_name)}"))
            continue
        try:
            value = _convert(spec, value, (dirs or {}).get(key) or base_dir)
        except ValueError as exc:
            problems.append((key, f"parameter {key!r}: {exc}, got {shorten(repr(value))}", f"set {key} to a {spec.type} value"))
            continue
        low = spec.below_minimum(value)
        if low is not None:
            entry = "an entry " if isinstance(value, tuple) else ""
            problems.append((key, f"parameter {key!r}: {entry}{low!r} is below the minimum {spec.minimum}",
                             f"set {key} to {spec.minimum} or more"))
            continue
        if spec.choices is not None and value not in spec.choices:
            choices = ", ".join(map(str, spec.choices))
            problems.append((key, f"parameter {key!r} is {value!r}", f"use one of: {choices}"))
            continue
        out[key] = value
    for spec in schema:
        if spec.name in out:
            continue
        if spec.required and spec.name not in raw:  # a given but invalid value is already a problem
            problems.append((spec.name, f"missing required parameter {spec.name!r}", f"add params.{spec.name} ({spec.help or spec.type})"))
        elif spec.required:
            continue
        else:
            out[spec.name] = spec.default
    return out, problems
