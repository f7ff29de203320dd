"""Files written atomically: into a temporary file beside the target, then renamed into place, so no reader
ever sees a half-written file."""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np


def write_npz_atomic(path, arrays: dict) -> None:
    """np.savez into memory, then :func:`write_bytes_atomic`: no half-written file is ever left."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getvalue())


def write_bytes_atomic(path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place.

    The file gets the permissions a plain ``open(path, "w")`` would give (0o666 minus the umask),
    not mkstemp's private 0o600.

    An OSError names ``path`` (the user's), never the temporary file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError):
            raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
        raise


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
