"""What every ``latim-jax`` subcommand shares: exit codes, the user-error exception, argument types
that reject bad values with one line, the check of output paths made before any computation, and
loading a model with its errors as usage errors."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from latim_jax.convert import CheckpointError
from latim_jax.io.loading import SHIPPED, load
from latim_jax.parallel.context import IMPLS

MODEL_HELP = f"shipped name ({', '.join(SHIPPED)}), directory or hub id"
DEFAULT_METHOD = "alti"  # attribute, attribute-dataset and latim_jax.attribute agree

EXIT_OK = 0  # the command did what was asked
EXIT_FAILED = 1  # it ran, and the check or run failed (check: FAIL; non-finite scores)
EXIT_USAGE = 2  # usage or input error: bad arguments, missing/unreadable files, unknown model

EXIT_CODES_HELP = """exit codes:
  0  success
  1  the check or run failed (`check` printed FAIL, non-finite scores)
  2  usage or input error (bad arguments, a missing or unwritable file, an unknown model)
Errors print one line 'error: ...' on stderr; paths are relative to the current directory."""


class UsageError(Exception):
    """A mistake in the command line or its inputs: printed as one ``error:`` line, exit code 2."""


class RunFailed(Exception):
    """The command ran but its check failed: printed as one ``error:`` line, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument prints one line (``error: ...``) instead of the usage block."""

    def error(self, message: str):
        """argparse's hook for a bad argument: print one line, exit with EXIT_USAGE."""
        self.exit(EXIT_USAGE, f"error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, found {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, found {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0 (NaN and inf are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, found {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, found {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    value = nonnegative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, found {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, found {text!r}") from None


def parse_ints(text: str, what: str) -> list[int]:
    """Integers separated by spaces or commas; UsageError naming ``what`` otherwise."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"{what} must be integers separated by spaces or commas, found {text!r}") from None


def add_impl_argument(parser) -> None:
    """``--impl``: which kernels run (one definition for every command that attributes)."""
    parser.add_argument(
        "--impl", default="auto", choices=IMPLS, help="kernels: auto (Pallas on TPU/GPU, else XLA; default)"
    )


def check_suffix(flag: str, value, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file whose extension is not one of ``suffixes`` (``--out s.txt`` would
    write an .npz under a name that says otherwise)."""
    if value is not None and Path(value).suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {str(value)!r} must end in {' or '.join(suffixes)}")


def check_outputs(outputs: dict[str, str | os.PathLike | None], force: bool = False) -> None:
    """Refuse, before any computation, output paths that cannot be written: a missing or non-directory
    parent, a path naming a directory, an existing file (unless ``force``), or two flags naming the
    same file. ``outputs`` maps a flag ("--out") to its path (None: not requested)."""
    seen: dict[Path, str] = {}
    for flag, value in outputs.items():
        if value is None:
            continue
        path = Path(value).expanduser()
        if str(value) == "" or path.name in ("", ".", ".."):
            raise UsageError(f"{flag} must name a file, found {str(value)!r}")
        full = path.absolute()
        if full in seen:
            raise UsageError(f"{seen[full]} and {flag} name the same file {str(value)!r}")
        seen[full] = flag
        parent = full.parent
        if path.is_dir():
            raise UsageError(f"{flag} {str(value)!r} is a directory; name a file inside it")
        if not parent.is_dir():
            what = "does not exist" if not parent.exists() else "is not a directory"
            raise UsageError(f"{flag} {str(value)!r}: the directory {str(parent)!r} {what}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {str(value)!r}: the directory {str(parent)!r} is not writable")
        if path.exists() and not force:
            raise UsageError(f"{flag} {str(value)!r} exists; pass --force to replace it")


def load_model(source):
    """``latim_jax.load(source)``; a source that cannot be found or read is a UsageError."""
    try:
        return load(source)
    except (CheckpointError, ValueError, OSError) as err:
        raise UsageError(str(err)) from err
