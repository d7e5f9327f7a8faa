"""Sync and runtime plugins by name. Contract: `load(group, name)` -> plugin class; `check_names(s, where)` refuses
an unknown RUNTIME or SYNC (or one that does not import) before any host is touched.

Plugins are entry points (groups `twinspark.sync`, `twinspark.runtime`, declared in pyproject.toml) so another
package can add one; the built-in ones are also known by module path so a checkout whose installed metadata is
older than pyproject.toml still finds them."""

from __future__ import annotations

import difflib
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


GROUPS = {"RUNTIME": "twinspark.runtime", "SYNC": "twinspark.sync"}


def check_names(s, where: dict) -> None:
    """Each plugin named by the settings exists and imports; the sentence names the key, the value, its source and
    the nearest known name."""
    for key, group in GROUPS.items():
        name = getattr(s, key.lower())
        known = sorted(available(group))
        if name not in known:
            near = difflib.get_close_matches(name, known, 1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise DeployError(f"{key}={name!r} (from {where.get(key, 'default')}) is not a {group.split('.')[1]} plugin"
                              f"{hint}; choose one of: {', '.join(known)}.")
        try:
            load(group, name)
        except (ImportError, AttributeError) as e:
            raise DeployError(f"The {key.lower()} plugin {name!r} cannot be loaded ({type(e).__name__}: {e}); "
                              "reinstall the package that provides it or choose another.") from None
