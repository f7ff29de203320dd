"""latim-jax's own checkpoint directory: an orbax checkpoint of the parameter tree, the model config,
and the tokenizer files, written atomically.

Layout of a checkpoint directory::

    latim_config.json   {"format": "latim-jax", "format_version": 1, "config": MambaConfig.to_dict()}
    params/             orbax PyTree checkpoint of the parameter tree (dtypes kept: fp32, bf16, ...)
    tokenizer.json ...  copied from the source checkpoint when present

Everything is written into a hidden temporary directory beside the destination and renamed into place
at the end, so a failure leaves nothing at the destination.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from latim_jax.model.config import MambaConfig, param_shapes

from .errors import CheckpointError
from .layout import path_str

CONFIG_FILE = "latim_config.json"
PARAMS_DIR = "params"
FORMAT_NAME = "latim-jax"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",  # sentencepiece tokenizers
    "tokenizer.model.v3",  # mistral-inference's (Codestral)
)
TASK_FILE = "task.json"  # a shipped task model's task and training record (evaluate reads it)
COMPANION_FILES = (*TOKENIZER_FILES, TASK_FILE)  # copied beside the parameters


def save_checkpoint(
    dest: str | Path,
    config: MambaConfig,
    params: dict[str, Any],
    tokenizer_dir: str | Path | None = None,
    *,
    overwrite: bool = False,
    source: str | Path | None = None,
) -> Path:
    """Write ``params`` (checked against ``param_shapes(config)``), the config and tokenizer files.

    The tokenizer files of :data:`TOKENIZER_FILES` and the task file found in ``tokenizer_dir`` are
    copied (:data:`COMPANION_FILES`). The write is
    atomic: into a temporary directory beside ``dest``, renamed at the end; on any failure nothing is
    left at ``dest``, and nothing is removed before the new checkpoint is complete. An existing
    non-empty ``dest`` is refused unless ``overwrite=True``, and even then only a latim-jax checkpoint
    (a directory holding latim_config.json) is replaced: any other non-empty directory is refused, so
    an overwrite never deletes files latim-jax did not write. ``dest`` must not be, lie inside or
    contain ``source`` (the checkpoint the params were read from) or ``tokenizer_dir``: that would
    delete or mix with the input. Relative paths are relative to the current directory. Returns the
    absolute destination path.
    """
    dest = Path(dest).expanduser().absolute()
    check_params(config, params, source="params to save")
    tokenizer_files = _tokenizer_files(tokenizer_dir)
    check_destination(dest, overwrite, source=source, tokenizer_dir=tokenizer_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_config(tmp, config)
        _write_params(tmp / PARAMS_DIR, params)
        _copy_tokenizer(tokenizer_files, tmp)
        _publish(tmp, dest)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):  # name the user's destination, not the temporary directory
            raise OSError(err.errno, f"cannot write the checkpoint {dest}: {err.strerror or err}") from None
        raise
    return dest


def load_checkpoint(path: str | Path) -> tuple[MambaConfig, dict[str, Any]]:
    """``(config, params)`` from a directory written by :func:`save_checkpoint`, bit-exact.

    Arrays come back as numpy arrays in their saved dtypes; the tree is checked against the config.
    """
    path = Path(path).expanduser().absolute()  # orbax needs an absolute path
    config = _read_config(path / CONFIG_FILE)
    params = _restore_params(path / PARAMS_DIR, config)
    check_params(config, params, source=f"{path.name}/{PARAMS_DIR}")
    return config, params


def is_latim_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like a directory written by :func:`save_checkpoint`."""
    return (Path(path) / CONFIG_FILE).is_file()


def check_params(config: MambaConfig, params: Any, *, source: str) -> None:
    """Check that ``params`` has exactly the structure and shapes of ``param_shapes(config)``."""
    _check_node(param_shapes(config), params, (), source)


def _check_node(expected: Any, found: Any, path: tuple[str | int, ...], source: str) -> None:
    key = path_str(path) or "<root>"
    if isinstance(expected, dict):
        if not isinstance(found, dict) or set(found) != set(expected):
            keys = sorted(found) if isinstance(found, dict) else type(found).__name__
            raise CheckpointError(
                "wrong parameter tree", file=source, key=key, expected=sorted(expected), found=keys
            )
        for name in expected:
            _check_node(expected[name], found[name], (*path, name), source)
    elif isinstance(expected, list):
        if not isinstance(found, list | tuple) or len(found) != len(expected):
            n = len(found) if isinstance(found, list | tuple) else type(found).__name__
            raise CheckpointError(
                "wrong number of layers", file=source, key=key, expected=len(expected), found=n
            )
        for i, (e, f) in enumerate(zip(expected, found, strict=True)):
            _check_node(e, f, (*path, i), source)
    elif tuple(getattr(found, "shape", ())) != expected or not hasattr(found, "dtype"):
        raise CheckpointError(
            "wrong shape", file=source, key=key, expected=expected, found=getattr(found, "shape", found)
        )


def check_destination(
    dest: str | Path,
    overwrite: bool = False,
    *,
    source: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
) -> None:
    """Raise unless :func:`save_checkpoint` may write ``dest`` (see its docstring): ValueError when
    ``dest`` overlaps ``source`` or ``tokenizer_dir``, FileExistsError when it holds something that
    must not be replaced. Callers run it before reading a large source."""
    dest = Path(dest).expanduser().absolute()
    for other in (source, tokenizer_dir):
        _check_not_overlapping(dest, other)
    if not dest.exists():
        return
    if not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a directory")
    if not any(dest.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"{dest} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it"
        )
    if not is_latim_checkpoint(dest):
        raise FileExistsError(
            f"{dest} is not a latim-jax checkpoint (no {CONFIG_FILE}); refusing to replace a directory "
            "latim-jax did not write, even with overwrite: remove it yourself or pick another destination"
        )


def _check_not_overlapping(dest: Path, other: str | Path | None) -> None:
    """Refuse a destination that is ``other``, lies inside it or contains it."""
    if other is None:
        return
    a, b = dest.resolve(), Path(other).expanduser().resolve()
    if a == b or a.is_relative_to(b) or b.is_relative_to(a):
        how = "is" if a == b else ("lies inside" if a.is_relative_to(b) else "contains")
        raise ValueError(
            f"the destination {dest} {how} the source {other}: writing there would delete or mix with "
            "the source checkpoint; pick a destination outside it"
        )


def _tokenizer_files(tokenizer_dir: str | Path | None) -> list[Path]:
    if tokenizer_dir is None:
        return []
    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} does not exist")
    return [tokenizer_dir / name for name in COMPANION_FILES if (tokenizer_dir / name).is_file()]


def _write_config(directory: Path, config: MambaConfig) -> None:
    payload = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "config": config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _write_params(directory: Path, params: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save(directory, params)


def _copy_tokenizer(files: list[Path], directory: Path) -> None:
    for file in files:
        shutil.copy2(file, directory / file.name)


def _publish(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` (already allowed) is replaced."""
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _read_config(file: Path) -> MambaConfig:
    try:
        payload = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable latim-jax config ({err})", file=file) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
        found = payload.get("format") if isinstance(payload, dict) else payload
        raise CheckpointError(
            "not a latim-jax checkpoint config", file=file, key="format", expected=FORMAT_NAME, found=found
        )
    if payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            "unsupported checkpoint format version",
            file=file,
            key="format_version",
            expected=FORMAT_VERSION,
            found=payload.get("format_version"),
        )
    try:
        return MambaConfig.from_dict(payload["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"invalid config ({err})", file=file, key="config") from err


def _restore_params(directory: Path, config: MambaConfig) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    if not directory.is_dir():
        raise CheckpointError(
            "params directory missing", file=directory, expected="an orbax checkpoint", found="nothing"
        )
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    try:
        with _without_closed_loop_noise():
            return ocp.PyTreeCheckpointer().restore(directory, restore_args=restore_args)
    except Exception as err:
        raise CheckpointError(
            f"could not restore the orbax checkpoint ({type(err).__name__}: {err})", file=directory
        ) from err


@contextlib.contextmanager
def _without_closed_loop_noise(settle_s: float = 0.5):
    """Run a restore with the process's stderr (fd 2) going to a temporary file: written back as it was
    when the restore succeeds, dropped when it fails (the CheckpointError says what failed). A failed
    restore leaves reads in flight: after orbax closes its event loop each one prints "RuntimeError:
    Event loop is closed" from C++ (past every Python hook, several threads at once), and asyncio logs
    "Task exception was never retrieved" when the failed tasks are collected; both surrounded the one
    error line in about two runs of three. So a failure waits ``settle_s`` and collects them first."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2 (an embedded interpreter)
        yield
        return
    failed = False
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            time.sleep(settle_s)
            gc.collect()
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                caught.seek(0)
                text = caught.read().decode(errors="replace")
                if text:
                    sys.stderr.write(text)
                    sys.stderr.flush()
