"""Where the project's checkout is: recipes (configs/), the Dockerfile, bench data. The deploy tasks run from a
checkout (tasks.py sits at its root), while the package itself may be installed as a wheel elsewhere, so the
source location of this file is not enough.

Order: $TWINSPARK_ROOT; the source tree this module lives in (editable installs); the current directory or the
nearest parent holding configs/ and pyproject.toml; else the current directory."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path


def _is_root(p: Path) -> bool:
    return (p / "configs").is_dir() and (p / "pyproject.toml").is_file()


@functools.cache
def project_root() -> Path:
    env = os.environ.get("TWINSPARK_ROOT")
    if env:
        return Path(env).resolve()
    src = Path(__file__).resolve().parents[2]
    if _is_root(src):
        return src
    cwd = Path.cwd().resolve()
    for p in (cwd, *cwd.parents):
        if _is_root(p):
            return p
    return cwd


def checkout_commit() -> str:
    """The checkout's commit (`git rev-parse HEAD`, "+dirty" when tracked files changed), "unknown" outside git."""
    root = str(project_root())
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
