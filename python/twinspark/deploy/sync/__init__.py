"""Weight sync plugins (entry-point group `twinspark.sync`). Contract of a plugin class:
`Plugin(settings, head, worker).sync() -> str` (one line saying what was done) and `.needed_bytes() -> int`
(free space the worker needs, for preflight). Head and worker are `twinspark.deploy.hosts.Host`s; a dry-run host
prints the commands that change it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree_fingerprint(root: Path) -> tuple[str, int]:
    """sha256 over (relative path, size, mtime_ns) of every file: the rsync skip marker; also the byte total."""
    h, total = hashlib.sha256(), 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".rsync-partial"))
        for f in sorted(files):
            if f == MARKER:
                continue
            p = Path(dirpath) / f
            st = p.stat()
            total += st.st_size
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest(), total


MARKER = ".twinspark-sync"
