"""Fuzz tests of every reader of user data (issue 44): the shared scratch folder and the outcome counts per
reader, printed at the end of the run (cases, clean errors, accepted-equal, other)."""

from __future__ import annotations

from pathlib import Path

import fuzzkit  # tests/fuzz is on sys.path (pytest imports test folders without __init__.py so)
import pytest


def pytest_collection_modifyitems(items):
    """A backstop behind the per-case alarm (fuzzkit.alarm): a hang the alarm cannot break (inside C code) ends
    the run with every thread's stack after this long."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(300, method="thread"))


@pytest.fixture
def scratch(tmp_path) -> fuzzkit.Scratch:
    return fuzzkit.Scratch(tmp_path / "in")


def pytest_terminal_summary(terminalreporter):
    if not fuzzkit.OUTCOMES:
        return
    w = terminalreporter
    w.section("fuzz outcomes per reader")
    kinds = (fuzzkit.ERROR, fuzzkit.EQUAL, fuzzkit.OTHER_VALID, fuzzkit.OTHER)
    w.line(f"{'reader':24s} {'cases':>6s}" + "".join(f" {k:>15s}" for k in kinds))
    for reader, c in sorted(fuzzkit.OUTCOMES.items()):
        w.line(f"{reader:24s} {sum(c.values()):6d}" + "".join(f" {c[k]:15d}" for k in kinds))
