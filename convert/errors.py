"""The one error type checkpoint conversion raises: what file, what key, what was expected, what was found."""

from __future__ import annotations

from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be read faithfully.

    The message names the file, the key (a tensor name or a config field), what was expected and what
    was found, e.g. ``model.safetensors: key 'backbone.norm_f.weight': wrong shape (expected (16,),
    found (32,))``. The parts are kept as attributes for callers that want them.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: Any = None,
        key: str | None = None,
        expected: Any = None,
        found: Any = None,
    ):
        self.problem = problem
        self.file = None if file is None else str(file)
        self.key = key
        self.expected = expected
        self.found = found
        super().__init__(_format(problem, self.file, key, expected, found))


class SourceUnavailableError(CheckpointError):
    """A checkpoint source (a hub id or a path) that could not be found or fetched."""


def _format(problem: str, file: str | None, key: str | None, expected: Any, found: Any) -> str:
    parts = []
    if file is not None:
        parts.append(f"{file}:")
    if key is not None:
        parts.append(f"key {key!r}:")
    parts.append(problem)
    message = " ".join(parts)
    if expected is not None and found is not None:
        message += f" (expected {_show(expected)}, found {_show(found)})"
    elif expected is not None:  # nothing found to show: "found None" would say nothing
        message += f" (expected {_show(expected)})"
    elif found is not None:
        message += f" (found {_show(found)})"
    return message


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return repr(value)
