"""Progress bars on stderr for long work (evaluation batches, training steps, layer loops).

One switch for the whole library: bars are drawn only when stderr is a terminal and quiet mode is off
(:func:`set_quiet`, the CLI's ``--quiet``). Otherwise every helper here is a plain pass-through, so
library code can wrap any loop without changing what it computes or prints. Built on tqdm.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator

_QUIET = False


def set_quiet(quiet: bool = True) -> None:
    """Turn every progress bar off (True) or back on where stderr is a terminal (False)."""
    global _QUIET
    _QUIET = bool(quiet)


def is_quiet() -> bool:
    """Whether :func:`set_quiet` turned the bars off."""
    return _QUIET


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """Context manager: no progress bars inside (when ``enabled``); the previous setting after."""
    before = _QUIET
    set_quiet(before or enabled)
    try:
        yield
    finally:
        set_quiet(before)


def bars_enabled(enabled: bool | None = None) -> bool:
    """Whether a bar would be drawn: ``enabled`` if given, else not quiet and stderr is a terminal."""
    if enabled is not None:
        return bool(enabled)
    if _QUIET:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    enabled: bool | None = None,
    leave: bool = False,
):
    """``iterable`` wrapped in a tqdm bar on stderr (or returned unwrapped when bars are off).

    ``enabled``: None (default) draws the bar when stderr is a terminal and quiet mode is off; True
    or False forces it. With ``iterable=None`` returns a manual bar (``.update(n)``, ``.close()``,
    usable as a context manager) that does nothing when bars are off. ``leave`` keeps the finished bar.
    """
    on = bars_enabled(enabled)
    if not on:
        return _NullBar() if iterable is None else iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True)


def write(message: str, file=None) -> None:
    """Print ``message`` (stdout by default) without breaking an active progress bar."""
    from tqdm import tqdm

    tqdm.write(message, file=file if file is not None else sys.stdout)


class _NullBar:
    """A stand-in for a tqdm bar when bars are off: accepts the calls, draws nothing."""

    def update(self, n: int = 1) -> None:
        """Ignored."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Ignored."""

    def close(self) -> None:
        """Ignored."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None
