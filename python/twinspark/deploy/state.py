"""deployment.json in the head's state dir: the settings a deployment was started with and each rank's runtime
info (PID or container). status/logs/stop/restart and the watchdog read it, so they act on what is running
rather than on a config that may have changed since."""

from __future__ import annotations

import json
from pathlib import Path

from twinspark.deploy.errors import DeployError
from twinspark.fileio import atomic_write

FILE = "deployment.json"
LIVE = ("booting", "running", "split")  # statuses of a deployment whose ranks should run (failed, stopped: not)


def path(state_dir: Path) -> Path:
    return Path(state_dir).resolve() / FILE


def save(state_dir: Path, data: dict) -> None:
    atomic_write(path(state_dir), json.dumps(data, indent=1, default=str))


def load(state_dir: Path, required: bool = True) -> dict | None:
    p = path(state_dir)
    if not p.is_file():
        if required:
            raise DeployError(f"No deployment recorded in {p.parent}; run `invoke deploy` first (or set STATE_DIR).")
        return None
    return json.loads(p.read_text())


def update(state_dir: Path, **kw) -> dict:
    d = load(state_dir) or {}
    d.update(kw)
    save(state_dir, d)
    return d


def set_status(state_dir: Path, status: str, reason: str | None = None, **kw) -> dict:
    """A new status with its own reason (None clears it): a later status never shows an earlier failure's reason."""
    return update(state_dir, status=status, reason=reason, **kw)
