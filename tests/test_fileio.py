"""twinspark.fileio.atomic_write: whole-file writes through a temp file and a rename."""

from __future__ import annotations

import stat

import pytest
from twinspark.fileio import atomic_write


def test_text_bytes_mode_and_parents(tmp_path):
    p = atomic_write(tmp_path / "a" / "b" / "f.txt", "hello\n")
    assert p.read_text() == "hello\n"
    atomic_write(p, b"\x00\x01", mode=0o600)
    assert p.read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert [q.name for q in p.parent.iterdir()] == ["f.txt"], "a temp file was left behind"

def test_failure_keeps_the_old_file_and_no_temp(tmp_path):
    p = atomic_write(tmp_path / "f.json", "{}")
    with pytest.raises(TypeError):
        atomic_write(p, 123)  # neither str nor bytes: refused by write(), nothing replaced
    assert p.read_text() == "{}"
    assert [q.name for q in tmp_path.iterdir()] == ["f.json"]
