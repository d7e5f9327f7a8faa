"""Whole-file writes that never leave a half-written file behind: write a temp file beside the target, then
rename it over the target (atomic on one file system). Contract: `atomic_write(path, data, mode=None) -> Path`.
Reads of user-named files that must not hang or misread: `open_regular(path)`, `read_json(path)`."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write(path: str | os.PathLike, data: str | bytes, mode: int | None = None) -> Path:
    """Write ``data`` (str: UTF-8 text, bytes: as is) to ``path`` through a temp file in the same folder, then
    rename. ``mode`` (e.g. 0o600) is set on the temp file before its contents are written, so a secret is never
    readable by others. Parent folders are created. On any failure the temp file is removed and the old file, if
    any, is left as it was."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


_NOT_REGULAR = ((stat.S_ISDIR, errno.EISDIR, "a directory"), (stat.S_ISFIFO, errno.EINVAL, "a FIFO"),
                (stat.S_ISSOCK, errno.EINVAL, "a socket"), (stat.S_ISCHR, errno.EINVAL, "a character device"),
                (stat.S_ISBLK, errno.EINVAL, "a block device"))


def _require_regular(st: os.stat_result, path) -> None:
    if not stat.S_ISREG(st.st_mode):
        code, kind = next(((c, k) for test, c, k in _NOT_REGULAR if test(st.st_mode)), (errno.EINVAL, "not a file"))
        raise OSError(code, f"it is {kind}, not a regular file", str(path))


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only; anything else raises OSError whose strerror names what it is
    (a FIFO would block the reader forever, a directory or a device has no file contents to read). The path is
    checked with stat before it is opened, and the open itself is non-blocking and checked again, so a FIFO
    swapped in between cannot hang the reader either."""
    _require_regular(os.stat(path), path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(os.fstat(fd), path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> Any:
    """One JSON document from bytes; ValueError with the reason when they are not UTF-8 JSON (NaN and Infinity
    included, which JSON does not have) or nest too deeply to parse."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path: str | os.PathLike) -> Any:
    """The JSON document of a regular file: OSError when it cannot be read (see ``open_regular``), ValueError as
    ``parse_json`` says."""
    with open_regular(path) as f:
        return parse_json(f.read())
