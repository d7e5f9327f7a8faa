"""Drop page cache after the weights are loaded: the weight files' pages are never read again, and on a
unified-memory node they crowd out what the GPU will need (MemAvailable counts them, the driver cannot use them).

Two ways: per file with posix_fadvise(DONTNEED) (no privilege needed; works in containers), and the whole
cache through /proc/sys/vm/drop_caches (root on the host; says clearly when it is not permitted)."""

from __future__ import annotations

import os
from pathlib import Path

from twinspark.memory import memlog
from twinspark.memory.meminfo import read_meminfo


def drop_files(folder: str | os.PathLike) -> int:
    """posix_fadvise(DONTNEED) on every file under folder; returns the number of files advised."""
    n = 0
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def drop_all() -> str | None:
    """Write 1 to /proc/sys/vm/drop_caches; returns None on success, else the reason it was not possible."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except PermissionError:
        return "no permission to write /proc/sys/vm/drop_caches (needs root on the host, not in a container)"
    except OSError as exc:
        return f"cannot write /proc/sys/vm/drop_caches ({exc.strerror}; read-only /proc/sys in a container?)"


def drop_after_load(rank: int, model_dir: str | None) -> dict:
    """Drop the model files' pages (and the whole cache when permitted); writes a memory line with Cached before
    and after."""
    before = read_meminfo()["Cached"]
    files = drop_files(model_dir) if model_dir and Path(model_dir).is_dir() else 0
    why = drop_all()
    after = read_meminfo()["Cached"]
    note = why or "whole page cache dropped"
    return memlog.write("page_cache_dropped", rank, cached_before=before, cached_after=after, files=files,
                        note=note)
