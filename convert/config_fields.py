"""Strict reading of a checkpoint's JSON config: every field is handled or explicitly ignored, and every
handled field is type-checked, so a field this code does not understand is an error, never a silent
default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from .errors import CheckpointError

REQUIRED: Any = object()


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from ``path`` (bare ``Infinity``/``NaN`` accepted, as Python writes them)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable JSON ({err})", file=path.name) from err
    if not isinstance(data, dict):
        raise CheckpointError(
            "not a JSON object", file=path.name, expected="{...}", found=type(data).__name__
        )
    return data


def parse_float(value: Any) -> float:
    """A float from JSON: a number, ``"inf"``/``"Infinity"``, or ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, bool):
        raise ValueError(f"expected a number, found {value!r}")
    if isinstance(value, str):
        return float(value.replace("Infinity", "inf"))
    if isinstance(value, int | float):
        return float(value)
    raise ValueError(f"expected a number, found {value!r}")


class ConfigFields:
    """Typed, strict access to one JSON config object.

    ``handled`` fields are read through the typed getters; ``ignored`` fields are accepted and not
    read (each format module says why it ignores them). Any other field raises at construction.
    ``prefix`` names a nested object in messages (``"ssm_cfg."``).
    """

    def __init__(
        self,
        data: Any,
        *,
        file: str,
        handled: Collection[str],
        ignored: Collection[str] = (),
        prefix: str = "",
    ):
        self.file = file
        self.prefix = prefix
        if not isinstance(data, dict):
            raise CheckpointError(
                "config is not a JSON object",
                file=file,
                key=prefix.rstrip(".") or None,
                expected="{...}",
                found=data,
            )
        self.data = data
        unknown = sorted(set(data) - set(handled) - set(ignored))
        if unknown:
            raise CheckpointError(
                f"unknown config field(s) {[prefix + k for k in unknown]}: latim-jax does not know what "
                f"they do (it handles {sorted(handled)} and ignores {len(ignored)} fields that do not "
                "change the forward pass)",
                file=file,
                key=prefix + unknown[0],
                expected="a handled or ignored field",
                found=f"{unknown[0]}={data[unknown[0]]!r}",
            )

    def error(self, key: str, problem: str, expected: Any, found: Any) -> CheckpointError:
        """A :class:`CheckpointError` about field ``key`` of this config."""
        return CheckpointError(problem, file=self.file, key=self.prefix + key, expected=expected, found=found)

    def has(self, key: str) -> bool:
        """Whether the field is present."""
        return key in self.data

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The field as stored (``default`` when absent; absent and required is an error)."""
        if key in self.data:
            return self.data[key]
        if default is REQUIRED:
            raise self.error(key, "required config field missing", "the field", "nothing")
        return default

    def int(self, key: str, default: Any = REQUIRED) -> int:
        """An integer field (booleans refused)."""
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, "wrong type", "an integer", value)
        return value

    def bool(self, key: str, default: Any = REQUIRED) -> bool:
        """A boolean field."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, "wrong type", "true or false", value)
        return value

    def float(self, key: str, default: Any = REQUIRED) -> float:
        """A float field (numbers, "Infinity" strings and {"__float__": ...} accepted)."""
        value = self.raw(key, default)
        try:
            return parse_float(value)
        except ValueError:
            raise self.error(key, "wrong type", "a number", value) from None

    def str(self, key: str, default: Any = REQUIRED) -> str:
        """A string field."""
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.error(key, "wrong type", "a string", value)
        return value

    def float_pair(self, key: str, default: Any = REQUIRED) -> tuple[float, float]:
        """A two-element list of floats (e.g. a time-step limit, ``[0.0, Infinity]``)."""
        value = self.raw(key, default)
        try:
            low, high = (parse_float(x) for x in value)
        except (TypeError, ValueError):
            raise self.error(key, "wrong type", "a pair of numbers", value) from None
        if math.isnan(low) or math.isnan(high) or low > high:
            raise self.error(key, "not an interval", "low <= high", value)
        return low, high

    def require(self, key: str, allowed: Collection[Any], default: Any, why: str) -> Any:
        """A field whose only supported values are ``allowed``; anything else is an error saying ``why``."""
        value = self.raw(key, default)
        if not any(value == a and type(value) is type(a) for a in allowed):
            allowed = list(allowed)
            shown = allowed[0] if len(allowed) == 1 else f"one of {allowed}"
            raise self.error(key, f"unsupported value: {why}", shown, value)
        return value

    def same(self, key: str, other_value: Any, other_key: str) -> None:
        """A legacy duplicate field, checked equal to ``other_key`` when present."""
        if key in self.data and self.data[key] != other_value:
            raise self.error(key, f"disagrees with {other_key}", other_value, self.data[key])
