"""Engram pack files (twinspark.engram.pack, `invoke pack`), rank layout and the synthetic checkpoint."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from twinspark.engram import (
    EngramError,
    EngramLayout,
    EngramStore,
    PackHeader,
    locate,
    pack,
    pack_name,
    read_pack_header,
    write_synthetic_checkpoint,
)
from twinspark.engram.pack import HEADER_BYTES, pack_command, pack_range
from twinspark.engram.source import RECORD_BYTES

REDO = r"re-run `invoke pack`"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("engram_pack")
    layout = write_synthetic_checkpoint(root / "ckpt", seed=3)
    return root / "ckpt", layout


@pytest.fixture
def packed(ckpt, tmp_path):
    src, layout = ckpt
    results = pack(src, tmp_path / "pack", layout, 0, 2)
    return src, layout, results


def records(src: Path, layer: int, first: int, end: int) -> np.ndarray:
    t = locate(src, layer)
    w = np.fromfile(t.weight.path, np.uint8, count=t.rows * 256, offset=t.weight.start).reshape(-1, 256)
    s = np.fromfile(t.scale.path, np.uint8, count=t.rows * 8, offset=t.scale.start).reshape(-1, 8)
    return np.concatenate([w, s], axis=1)[first:end]


def test_synthetic_checkpoint_reads_back_with_safetensors(ckpt):
    src, layout = ckpt
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["layers.1.engram.embed.weight"] == "model-00047-of-00048.safetensors"
    assert index["layers.14.engram.embed.scale"] == "model-00048-of-00048.safetensors"
    with safe_open(src / "model-00048-of-00048.safetensors", "pt") as f:
        w = f.get_tensor("layers.14.engram.embed.weight")
        s = f.get_tensor("layers.14.engram.embed.scale")
    assert w.dtype == torch.float8_e4m3fn and w.shape == (layout.rows(14), 256)
    assert s.dtype == torch.uint8 and s.shape == (layout.rows(14), 8)
    assert torch.isfinite(w.float()).all() and (s >= 112).all() and (s <= 134).all()
    assert EngramLayout.from_config(src / "config.json") == layout


def test_layout_splits_whole_heads():
    layout = EngramLayout({1: (5, 7, 11, 13), 14: (2, 3, 5)})
    r0, r1 = layout.rank_range(1, 0, 2), layout.rank_range(1, 1, 2)
    assert (r0.first_row, r0.end_row, r0.first_head, r0.end_head) == (0, 12, 0, 2)
    assert (r1.first_row, r1.end_row, r1.rows) == (12, 36, 24)
    assert layout.rank_range(14, 0, 1).rows == 10
    with pytest.raises(EngramError, match="rank 2 is not in 0..1"):
        layout.rank_range(1, 2, 2)
    with pytest.raises(EngramError, match="fewer than 4 ranks"):
        layout.rank_range(14, 0, 4)
    with pytest.raises(EngramError, match="layer 7 is not in the config"):
        layout.rank_range(7, 0, 2)
    with pytest.raises(EngramError, match="has no Engram head sizes"):
        EngramLayout.from_dict({"hidden_size": 5})
    assert EngramLayout.from_dict({"engram": {"head_sizes": {"1": [3]}}}).rows(1) == 3


def test_pack_holds_the_rank_rows(packed):
    src, layout, results = packed
    assert [r.status for r in results] == ["written", "written"]
    for r in results:
        rng = layout.rank_range(r.header.layer, 0, 2)
        assert r.path.name == pack_name(r.header.layer, 0, 2)
        assert (r.header.first_row, r.header.last_row) == (rng.first_row, rng.end_row - 1)
        data = np.fromfile(r.path, np.uint8)
        assert data.size == HEADER_BYTES + rng.rows * RECORD_BYTES
        np.testing.assert_array_equal(data[HEADER_BYTES:].reshape(-1, RECORD_BYTES),
                                      records(src, r.header.layer, rng.first_row, rng.end_row))
        assert read_pack_header(r.path, r.header) == r.header
        assert not list(r.path.parent.glob("*.partial"))


def test_rerun_is_up_to_date(packed, tmp_path):
    src, layout, results = packed
    mtimes = [r.path.stat().st_mtime_ns for r in results]
    again = pack(src, tmp_path / "pack", layout, 0, 2)
    assert [r.status for r in again] == ["up to date"] * 2
    assert [r.path.stat().st_mtime_ns for r in again] == mtimes


def test_resume_after_interruption(packed, tmp_path):
    """A partial file with a matching header resumes from its last whole row (a torn row is dropped)."""
    src, layout, results = packed
    r = results[1]
    part = r.path.with_name(r.path.name + ".partial")
    os.replace(r.path, part)
    keep = 1000
    with open(part, "r+b") as f:
        f.truncate(HEADER_BYTES + keep * RECORD_BYTES + 100)  # 1000 whole rows and a torn one
    again = pack_range(locate(src, 14), layout.rank_range(14, 0, 2), r.path)
    assert again.status == "resumed" and again.rows_copied == r.header.rows - keep
    rng = layout.rank_range(14, 0, 2)
    np.testing.assert_array_equal(np.fromfile(r.path, np.uint8)[HEADER_BYTES:].reshape(-1, RECORD_BYTES),
                                  records(src, 14, rng.first_row, rng.end_row))
    assert not part.exists()


def test_partial_for_another_range_restarts(packed):
    src, layout, results = packed
    r = results[0]
    part = r.path.with_name(r.path.name + ".partial")
    other = PackHeader(1, 0, 10, layout.rows(1))
    part.write_bytes(other.encode() + b"\xff" * (11 * RECORD_BYTES))
    r.path.unlink()
    again = pack_range(locate(src, 1), layout.rank_range(1, 0, 2), r.path)
    assert again.status == "written" and again.rows_copied == r.header.rows
    read_pack_header(r.path, r.header)


def test_damaged_final_file_is_rewritten(packed):
    src, layout, results = packed
    r = results[0]
    with open(r.path, "r+b") as f:
        f.truncate(r.header.file_bytes - 1)
    again = pack_range(locate(src, 1), layout.rank_range(1, 0, 2), r.path)
    assert again.status == "written"
    assert read_pack_header(r.path, r.header).rows == r.header.rows


def _rewrite_header(path: Path, **changes) -> None:
    """Rewrite the header with changed fields and a valid checksum (so only the changed field is wrong)."""
    raw = bytearray(path.read_bytes()[:HEADER_BYTES])
    fields = list(struct.unpack_from("<8sIIIIIIQQQ16s", raw))
    names = ["magic", "version", "header_bytes", "layer", "row_bytes", "weight_bytes", "scale_bytes", "first_row",
             "last_row", "table_rows", "dtype"]
    for k, v in changes.items():
        fields[names.index(k)] = v
    body = struct.pack("<8sIIIIIIQQQ16s", *fields)
    raw[:len(body) + 4] = body + struct.pack("<I", zlib.crc32(body))
    with open(path, "r+b") as f:
        f.write(raw)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: os.truncate(p, p.stat().st_size - 1), "is truncated"),
    (lambda p: os.truncate(p, p.stat().st_size - RECORD_BYTES), "is truncated"),
    (lambda p: os.truncate(p, 50), "is truncated"),
    (lambda p: open(p, "ab").write(b"x"), "longer than its header says"),
    (lambda p: _rewrite_header(p, magic=b"SAFETENS"), "is not an Engram pack file"),
    (lambda p: _rewrite_header(p, version=2), "has format version 2"),
    (lambda p: _rewrite_header(p, row_bytes=272), "unexpected row format"),
    (lambda p: _rewrite_header(p, dtype=b"U8+U8"), "unexpected row format"),
    (lambda p: _rewrite_header(p, layer=14), "holds layer 14 .* expected layer 1"),
    (lambda p: _rewrite_header(p, first_row=1), "expected layer 1 rows 0"),
])
def test_damaged_or_mismatched_file_refused(packed, damage, message):
    _, _, results = packed
    r = results[0]
    damage(r.path)
    with pytest.raises(EngramError, match=f"{message}.*{REDO}"):
        read_pack_header(r.path, r.header)
    with pytest.raises(EngramError, match=REDO):
        EngramStore.from_pack(r.path, expect=r.header)


def test_corrupt_header_checksum_refused(packed):
    _, _, results = packed
    path = results[0].path
    raw = bytearray(path.read_bytes()[:HEADER_BYTES])
    raw[40] ^= 1  # last_row, checksum left as it was
    with open(path, "r+b") as f:
        f.write(raw)
    with pytest.raises(EngramError, match=f"corrupt header \\(checksum mismatch\\); {REDO}"):
        read_pack_header(path)


def test_pack_checks_config_against_checkpoint(ckpt, tmp_path):
    src, layout = ckpt
    wrong = EngramLayout({1: layout.head_sizes[1][:-1], 14: layout.head_sizes[14]})
    with pytest.raises(EngramError, match="head sizes add up to"):
        pack(src, tmp_path, wrong, 0, 2)
    with pytest.raises(EngramError, match="has no tensor layers.3.engram.embed.weight"):
        pack(src, tmp_path, EngramLayout({3: (5,)}), 0, 1, layers=[3])


def test_pack_command_dry_run_writes_nothing(ckpt, tmp_path):
    src, _ = ckpt
    lines = []
    results = pack_command(src, tmp_path / "out", rank=1, dry_run=True, echo=lines.append)
    assert [r.status for r in results] == ["would write"] * 2 and not (tmp_path / "out").exists()
    assert any("would write" in line for line in lines)


@pytest.mark.slow
def test_invoke_pack(ckpt, tmp_path):
    """The task end to end: success, then a clear one-line failure (no traceback) for a missing config."""
    src, layout = ckpt
    invoke = [sys.executable, "-m", "invoke", "-r", str(Path(__file__).resolve().parents[1])]
    ok = subprocess.run(invoke + ["pack", "--source", str(src), "--out", str(tmp_path), "--rank", "1",
                                  "--layers", "14"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "written" in ok.stdout and (tmp_path / pack_name(14, 1, 2)).exists()
    bad = subprocess.run(invoke + ["pack", "--source", str(tmp_path / "nowhere"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "cannot read Engram config" in bad.stderr and "pass --config" in bad.stderr


def test_invoke_pack_takes_its_folders_from_the_deploy_config(tmp_path):
    """`invoke pack --rank 1` with ENGRAM_DIR / ENGRAM_PACK_DIR from the deploy config (here the environment) packs
    that rank's rows of every layer named, from a DeepSeek V4.1 config's own Engram fields."""
    from twinspark.engram.pack import read_pack_header
    from twinspark.tiny_v41 import config_json, write_engram_tables
    from twinspark.v41_layout import V41Spec

    spec = V41Spec.tiny()
    write_engram_tables(tmp_path / "engram", spec, config_json(spec, None), seed=0)
    env = {**os.environ, "ENGRAM_DIR": str(tmp_path / "engram"), "ENGRAM_PACK_DIR": str(tmp_path / "packs"),
           "TWINSPARK_ENV_FILE": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "invoke", "pack", "--rank", "1", "--world", "2", "--layers", "1,3"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sizes = spec.engram_head_sizes()
    for layer in (1, 3):
        h = read_pack_header(tmp_path / "packs" / f"engram-layer{layer:02d}-rank1of2.tspack")
        assert (h.first_row, h.last_row + 1, h.table_rows) == (sum(sizes[layer][:3]), sum(sizes[layer]),
                                                               sum(sizes[layer]))
    bad = subprocess.run([sys.executable, "-m", "invoke", "pack", "--layers", "1,x"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "--layers must be" in bad.stderr
