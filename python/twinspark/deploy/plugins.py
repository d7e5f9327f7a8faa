"""Sync and runtime plugins by name. Contract: `load(group, name)` -> plugin class.

Plugins are entry points (groups `twinspark.sync`, `twinspark.runtime`, declared in pyproject.toml) so another
package can add one; the built-in ones are also known by module path so a checkout whose installed metadata is
older than pyproject.toml still finds them."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from twinspark.deploy.errors import DeployError

BUILTIN = {
    "twinspark.sync": {
        "rsync": "twinspark.deploy.sync.rsync:RsyncSync",
        "zfs": "twinspark.deploy.sync.zfs:ZfsSync",
        "nfs": "twinspark.deploy.sync.nfs:NfsSync",
    },
    "twinspark.runtime": {
        "process": "twinspark.deploy.runtime.process:ProcessRuntime",
        "docker": "twinspark.deploy.runtime.docker:DockerRuntime",
    },
}


def available(group: str) -> dict[str, str]:
    found = dict(BUILTIN[group])
    for ep in entry_points(group=group):
        found[ep.name] = ep.value
    return found


def load(group: str, name: str):
    target = available(group).get(name)
    if target is None:
        kind = group.split(".")[1]
        raise DeployError(f"Unknown {kind} plugin '{name}'; choose one of: {', '.join(sorted(available(group)))}.")
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)
