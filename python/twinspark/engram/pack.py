"""Per-rank pack files: one local file per (layer, rank) holding that rank's rows, weight and scale adjacent.

Layout: a 4096-byte header, then row ``first_row + i`` at byte ``4096 + 264*i`` (256 fp8 e4m3 weight bytes, 8
E8M0 scale bytes), so one read brings a whole row and the data starts O_DIRECT-aligned. Header (little-endian):

    magic b"TSENGRAM" | version u32 | header_bytes u32 | layer u32 | row_bytes u32 | weight_bytes u32 |
    scale_bytes u32 | first_row u64 | last_row u64 (inclusive) | table_rows u64 (rows of the whole layer) |
    dtype 16s (b"F8_E4M3+E8M0") | crc32 u32 of everything before it | zero padding to 4096

Writing goes to ``<name>.partial`` and is renamed when complete. A re-run finds the final file complete and
skips it, resumes a partial file whose header matches (from its last whole row), and restarts anything else.
Opening checks magic, version, checksum, layer, row range and the exact size: a truncated or mismatched file is
refused with an EngramError naming the file and saying to re-run ``invoke pack``.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinspark.engram.errors import EngramError
from twinspark.engram.layout import ENGRAM_LAYERS, EngramLayout, RowRange
from twinspark.engram.source import RECORD_BYTES, SCALE_BYTES, WEIGHT_BYTES, LayerTensors, locate
from twinspark.fileio import open_regular

MAGIC = b"TSENGRAM"
VERSION = 1
HEADER_BYTES = 4096
DTYPE = b"F8_E4M3+E8M0"
_FIELDS = struct.Struct("<8sIIIIIIQQQ16s")
_CRC = struct.Struct("<I")
CHUNK_ROWS = 1 << 16  # 17 MB of output per write: large sequential I/O, small memory
REDO = "re-run `invoke pack` to rewrite it"


@dataclass(frozen=True)
class PackHeader:
    layer: int
    first_row: int
    last_row: int  # inclusive
    table_rows: int
    version: int = VERSION
    row_bytes: int = RECORD_BYTES

    @property
    def rows(self) -> int:
        return self.last_row - self.first_row + 1

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.rows * self.row_bytes

    def encode(self) -> bytes:
        body = _FIELDS.pack(MAGIC, self.version, HEADER_BYTES, self.layer, self.row_bytes, WEIGHT_BYTES,
                            SCALE_BYTES, self.first_row, self.last_row, self.table_rows, DTYPE)
        head = body + _CRC.pack(zlib.crc32(body))
        return head + bytes(HEADER_BYTES - len(head))

    def extents(self, path: str | Path) -> list[tuple[str, int, int, int, int]]:
        """One extent for the C++ store: row id r is at HEADER_BYTES + (r - first_row) * 264."""
        return [(str(path), HEADER_BYTES - self.first_row * RECORD_BYTES, RECORD_BYTES, RECORD_BYTES, 0)]


def decode_header(raw: bytes, path: str | Path) -> PackHeader:
    """Parse and check a header (magic, version, checksum, constants); EngramError on anything wrong."""
    if len(raw) < _FIELDS.size + _CRC.size:
        raise EngramError(f"Engram pack file {path} is truncated (no complete header); {REDO}")
    body = raw[:_FIELDS.size]
    magic, version, hbytes, layer, row_bytes, wbytes, sbytes, first, last, table_rows, dtype = _FIELDS.unpack(body)
    if magic != MAGIC:
        raise EngramError(f"{path} is not an Engram pack file (bad magic); {REDO}")
    if version != VERSION:
        raise EngramError(f"Engram pack file {path} has format version {version}, this twinspark reads {VERSION}; "
                          f"{REDO}")
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    if crc != zlib.crc32(body):
        raise EngramError(f"Engram pack file {path} has a corrupt header (checksum mismatch); {REDO}")
    dtype = dtype.rstrip(b"\0")
    if (hbytes, row_bytes, wbytes, sbytes, dtype) != (HEADER_BYTES, RECORD_BYTES, WEIGHT_BYTES, SCALE_BYTES, DTYPE):
        raise EngramError(f"Engram pack file {path} has an unexpected row format ({row_bytes} bytes, "
                          f"{dtype.decode(errors='replace')}); {REDO}")
    if last < first:
        raise EngramError(f"Engram pack file {path} has an empty row range; {REDO}")
    if last >= table_rows:
        raise EngramError(f"Engram pack file {path} holds rows {first}..{last} of a layer of only {table_rows} rows; "
                          f"{REDO}")
    return PackHeader(layer, first, last, table_rows, version, row_bytes)


def read_pack_header(path: str | Path, expect: PackHeader | None = None) -> PackHeader:
    """The header of a complete pack file, checked against `expect` (layer, rows) and the file's size. Without
    `expect`, a file named as ``pack_name`` names it is checked against its name: the layer, and rows that start
    at row 0 for rank 0 and end at the table's last row for the last rank."""
    p = Path(path)
    try:
        with open_regular(p) as f:
            raw = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise EngramError(f"cannot read Engram pack file {p}: {exc.strerror}; run `invoke pack` first") from None
    h = decode_header(raw, p)
    if expect is not None and (h.layer, h.first_row, h.last_row, h.table_rows) != (
            expect.layer, expect.first_row, expect.last_row, expect.table_rows):
        raise EngramError(f"Engram pack file {p} holds layer {h.layer} rows {h.first_row}..{h.last_row} of "
                          f"{h.table_rows}, expected layer {expect.layer} rows {expect.first_row}..{expect.last_row} "
                          f"of {expect.table_rows}; {REDO}")
    named = _NAME.fullmatch(p.name)
    if expect is None and named:
        layer, rank, world = (int(x) for x in named.groups())
        if layer != h.layer or rank >= world or (rank == 0) != (h.first_row == 0) or (
                rank == world - 1) != (h.last_row == h.table_rows - 1):
            raise EngramError(f"Engram pack file {p} holds layer {h.layer} rows {h.first_row}..{h.last_row} of "
                              f"{h.table_rows}, which is not what its name says (layer {layer}, rank {rank} of "
                              f"{world}); {REDO}")
    if size != h.file_bytes:
        state = "truncated" if size < h.file_bytes else "longer than its header says"
        raise EngramError(f"Engram pack file {p} is {state} ({size} bytes, expected {h.file_bytes}); {REDO}")
    return h


def pack_name(layer: int, rank: int, world: int) -> str:
    return f"engram-layer{layer:02d}-rank{rank}of{world}.tspack"


_NAME = re.compile(r"engram-layer(\d+)-rank(\d+)of(\d+)\.tspack")


@dataclass(frozen=True)
class PackResult:
    path: Path
    header: PackHeader
    status: str  # "written", "resumed", "up to date", "would write" (dry run)
    rows_copied: int


def pack_range(tensors: LayerTensors, rows: RowRange, out_path: str | Path, *,
               progress: Callable[[int, int], None] | None = None, dry_run: bool = False) -> PackResult:
    """Copy rows [rows.first_row, rows.end_row) of one layer into `out_path` (see the module docstring)."""
    out = Path(out_path)
    header = PackHeader(tensors.layer, rows.first_row, rows.end_row - 1, tensors.rows)
    if rows.end_row > tensors.rows:
        raise EngramError(f"Engram layer {tensors.layer} has {tensors.rows} rows in {tensors.weight.path}, but the "
                          f"config puts this rank's rows up to {rows.end_row}; the config's head sizes do not "
                          "match this checkpoint")
    part = out.with_name(out.name + ".partial")
    for p in (out, part):
        if p.exists() and not p.is_file():
            raise EngramError(f"{p} exists and is not a regular file; remove it or pack into another folder")
    if out.exists():
        try:
            read_pack_header(out, header)
            return PackResult(out, header, "up to date", 0)
        except EngramError:
            pass  # stale or damaged: rewritten below
    if dry_run:
        return PackResult(out, header, "would write", header.rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    encoded = header.encode()
    done, status = 0, "written"
    if part.exists():
        with open_regular(part) as f:
            if f.read(HEADER_BYTES) == encoded:
                done = min(header.rows, (part.stat().st_size - HEADER_BYTES) // RECORD_BYTES)
                status = "resumed" if done > 0 else status
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if done == 0:
            os.ftruncate(fd, 0)
            os.pwrite(fd, encoded, 0)
        os.ftruncate(fd, HEADER_BYTES + done * RECORD_BYTES)  # drop a torn last row
        copied = _copy_rows(tensors, header, fd, done, progress)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, out)
    _fsync_dir(out.parent)
    read_pack_header(out, header)
    return PackResult(out, header, status, copied)


def _copy_rows(t: LayerTensors, h: PackHeader, fd: int, done: int, progress) -> int:
    rec = np.empty((CHUNK_ROWS, RECORD_BYTES), dtype=np.uint8)
    wbuf = np.empty(CHUNK_ROWS * WEIGHT_BYTES, dtype=np.uint8)
    sbuf = np.empty(CHUNK_ROWS * SCALE_BYTES, dtype=np.uint8)
    with open(t.weight.path, "rb", buffering=0) as wf, open(t.scale.path, "rb", buffering=0) as sf:
        i = done
        while i < h.rows:
            k = min(CHUNK_ROWS, h.rows - i)
            row = h.first_row + i
            _read_exact(wf, memoryview(wbuf)[:k * WEIGHT_BYTES], t.weight.start + row * WEIGHT_BYTES, t.weight.path)
            _read_exact(sf, memoryview(sbuf)[:k * SCALE_BYTES], t.scale.start + row * SCALE_BYTES, t.scale.path)
            rec[:k, :WEIGHT_BYTES] = wbuf[:k * WEIGHT_BYTES].reshape(k, WEIGHT_BYTES)
            rec[:k, WEIGHT_BYTES:] = sbuf[:k * SCALE_BYTES].reshape(k, SCALE_BYTES)
            data = memoryview(rec[:k]).cast("B")
            off = HEADER_BYTES + i * RECORD_BYTES
            while data:
                n = os.pwrite(fd, data, off)
                data, off = data[n:], off + n
            i += k
            if progress is not None:
                progress(i, h.rows)
    return h.rows - done


def _read_exact(f, buf: memoryview, offset: int, path) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(f.fileno(), [buf[got:]], offset + got)
        if n == 0:
            raise EngramError(f"{path} ends early (byte {offset + got}); the shard is truncated, re-download it")
        got += n


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(checkpoint: str | Path, out_dir: str | Path, layout: EngramLayout, rank: int, world: int, *,
         layers: Iterable[int] = ENGRAM_LAYERS, dry_run: bool = False,
         progress: Callable[[int, int, int], None] | None = None) -> list[PackResult]:
    """Pack this rank's range of each layer into out_dir (one file per layer). The library call behind
    `invoke pack`; progress(layer, rows_done, rows_total) is called after every chunk."""
    results = []
    for layer in layers:
        tensors = locate(checkpoint, layer)
        if tensors.rows != layout.rows(layer):
            raise EngramError(f"Engram layer {layer} has {tensors.rows} rows in {tensors.weight.path}, the config's "
                              f"head sizes add up to {layout.rows(layer)}; use the config of this checkpoint")
        rows = layout.rank_range(layer, rank, world)
        cb = (lambda d, t, _l=layer: progress(_l, d, t)) if progress else None
        results.append(pack_range(tensors, rows, Path(out_dir) / pack_name(layer, rank, world), progress=cb,
                                  dry_run=dry_run))
    return results


def pack_command(source: str | Path, out_dir: str | Path, *, config: str | Path | None = None, rank: int = 0,
                 world: int = 2, layers: Iterable[int] = ENGRAM_LAYERS, dry_run: bool = False,
                 echo: Callable[[str], None] = print) -> list[PackResult]:
    """`invoke pack`: head sizes from `config` (default <source>/config.json), progress and results to echo."""
    layout = EngramLayout.from_config(config if config is not None else Path(source) / "config.json")
    last = {}

    def progress(layer, done, total):
        pct = 100 * done // total
        if pct // 10 != last.get(layer, -1):
            last[layer] = pct // 10
            echo(f"layer {layer}: {done}/{total} rows ({pct}%)")

    results = pack(source, out_dir, layout, rank, world, layers=layers, dry_run=dry_run, progress=progress)
    for r in results:
        h = r.header
        echo(f"{r.path}: layer {h.layer} rows {h.first_row}..{h.last_row} ({h.rows} rows, "
             f"{h.file_bytes / 2**30:.2f} GiB): {r.status}")
    return results
