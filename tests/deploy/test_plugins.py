"""Plugin registry: the built-in sync/runtime plugins are declared as entry points in pyproject.toml and load by
name; an unknown name is one clear sentence listing the choices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from twinspark.deploy import plugins
from twinspark.deploy.errors import DeployError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["twinspark.sync", "twinspark.runtime"])
def test_entry_points_declared_and_loadable(group):
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][group]
    assert eps == plugins.BUILTIN[group]
    for name in eps:
        cls = plugins.load(group, name)
        assert cls.name == name


def test_unknown_plugin_is_one_sentence():
    with pytest.raises(DeployError, match=r"Unknown sync plugin 'btrfs'; choose one of: nfs, rsync, zfs\."):
        plugins.load("twinspark.sync", "btrfs")
