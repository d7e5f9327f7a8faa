"""Where the project's checkout is: recipes (configs/), the Dockerfile, bench data. The deploy tasks run from a
checkout (tasks.py sits at its root), while the package itself may be installed as a wheel elsewhere, so the
source location of this file is not enough.

Order: $TWINSPARK_ROOT; the source tree this module lives in (editable installs); the current directory or the
nearest parent holding configs/ and pyproject.toml; else the current directory."""

from __future__ import annotations

import functools
import os
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
