"""Whole-file writes that never leave a half-written file behind: write a temp file beside the target, then
rename it over the target (atomic on one file system). Contract: `atomic_write(path, data, mode=None) -> Path`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
