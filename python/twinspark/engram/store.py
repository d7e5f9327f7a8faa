"""EngramStore: rows of one Engram layer served from files (original shards or a pack file) by the C++ store in
twinspark._C (cuda/engram_store/): O_DIRECT where the filesystem allows, a thread pool whose threads each keep
``queue_depth`` reads in flight through io_uring or Linux AIO (blocking pread where those are unavailable or the
files are read buffered; ``io_path`` says which), an optional RAM cache.

Two ways to look rows up:
- ``store.lookup_async(ids)`` / ``store.lookup(ids)``: host ids -> host weight fp8 [n, 256] and scale uint8
  [n, 8] (zero rows for ids outside this rank's range and for -1).
- ``store.staging(capacity).fetch(ids_on_gpu)``: enqueued on the current CUDA stream (ids copied to pinned
  memory, the fetch as a host function, the rows copied back, then the dequant kernel) and therefore capturable
  in a CUDA graph; a replay fetches the rows of whatever ids the buffer holds then.

Memory: the cache and per-thread I/O buffers (8 KiB, plus 8 KiB per read in flight) are ordinary host memory
(``host_bytes``); each staging buffer is ``capacity * 272`` pinned bytes (``pinned_bytes``). On GB10 both come out
of the GPU's 128 GB.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from twinspark import _ext
from twinspark.checks import is_int, is_number
from twinspark.engram.errors import EngramError
from twinspark.engram.layout import RowRange
from twinspark.engram.pack import PackHeader, read_pack_header
from twinspark.engram.source import SCALE_BYTES, WEIGHT_BYTES, locate

IO_MODES = ("auto", "direct", "buffered")
IO_ENGINES = ("auto", "io_uring", "aio", "pread")
PINNED_BYTES_PER_ROW = 8 + WEIGHT_BYTES + SCALE_BYTES  # id + weight + scale


def staging_pinned_bytes(capacity: int) -> int:
    """Pinned bytes of one staging buffer of `capacity` rows (what a graph-capturable lookup costs)."""
    return capacity * PINNED_BYTES_PER_ROW


def _is_extent(e) -> bool:
    return (isinstance(e, tuple) and len(e) == 5 and isinstance(e[0], str)
            and all(is_int(x) for x in e[1:]))


def _host_ids(ids, op: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.int64)
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise TypeError(f"{op}: expected ids to be a 1-D int64 or int32 tensor, got {ids.dtype} with {ids.dim()} dims")
    if ids.device.type != "cpu":
        raise ValueError(f"{op}: expected ids in host memory, got {ids.device}; use store.staging(...).fetch for "
                         "ids on the GPU")
    return ids.contiguous()


def _host_out(t, n: int, width: int, dtype: torch.dtype, name: str, op: str) -> torch.Tensor:
    if t is None:
        return torch.empty(n, width, dtype=dtype)
    if t.dtype != dtype or tuple(t.shape) != (n, width) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{op}: expected {name} to be a contiguous host {dtype} [{n}, {width}], got "
                         f"{t.dtype} {list(t.shape)} on {t.device}")
    return t


class PendingLookup:
    """A submitted lookup; wait() returns (weight fp8 [n, 256], scale uint8 [n, 8])."""

    def __init__(self, batch, ids, weight, scale):
        self._batch, self._keep, self.weight, self.scale = batch, ids, weight, scale

    def ready(self) -> bool:
        return self._batch.ready()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            self._batch.wait()
        except RuntimeError as exc:
            raise EngramError(f"Engram row read failed: {exc}; check the file (re-run `invoke pack` for a pack "
                              "file, re-download a shard)") from None
        return self.weight, self.scale


class EngramStore:
    """Rows [first_row, end_row) of one Engram layer, read from `extents` (see cuda/engram_store/engram_store.h).

    Prefer the constructors ``from_checkpoint`` (original shards: two reads per row) and ``from_pack`` (a pack
    file: one read per row). threads: I/O threads; queue_depth: rows each thread keeps in flight on the
    asynchronous paths (threads x queue_depth reads outstanding for a pack file, twice that for the shards);
    cache_gib: RAM cache (0 = off); io_mode: "auto" (O_DIRECT where it works), "direct" or "buffered";
    io_engine: "auto" (io_uring, else Linux AIO, else blocking pread; asynchronous only with O_DIRECT),
    "io_uring" or "aio" (refused when unavailable or buffered) or "pread".
    """

    def __init__(self, extents, first_row: int, end_row: int, *, threads: int = 16, cache_gib: float = 0.0,
                 io_mode: str = "auto", queue_depth: int = 32, io_engine: str = "auto"):
        for name, value, choices in (("io_mode", io_mode, IO_MODES), ("io_engine", io_engine, IO_ENGINES)):
            if not isinstance(value, str) or value not in choices:
                raise EngramError(f"Engram store: {name} must be one of {choices}, got {value!r:.40}")
        for name, value in (("threads", threads), ("queue_depth", queue_depth)):
            if not is_int(value) or not 1 <= value <= 1024:
                raise EngramError(f"Engram store: {name} must be 1..1024 (an integer), got {value!r:.40}")
        ram_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        if not is_number(cache_gib) or not 0 <= cache_gib <= ram_gib:
            raise EngramError(f"Engram store: cache_gib must be >= 0 (0 = off) and at most this machine's "
                              f"{ram_gib:.1f} GiB of memory, got {cache_gib!r:.40}")
        if not (is_int(first_row) and is_int(end_row)):
            raise EngramError(f"Engram store: rows [{first_row!r:.40}, {end_row!r:.40}) must be integers")
        if not isinstance(extents, (list, tuple)) or not all(_is_extent(e) for e in extents):
            raise EngramError("Engram store: extents must be a list of (path, base, stride, length, record offset) "
                              "tuples; build the store with from_checkpoint or from_pack")
        try:
            self._c = _ext.module().EngramStore(list(extents), int(first_row), int(end_row), int(threads),
                                                int(cache_gib * 2**30), io_mode, int(queue_depth), io_engine)
        except (RuntimeError, ValueError) as exc:
            raise EngramError(str(exc)) from None
        except MemoryError:
            raise EngramError(f"Engram store: no memory for a {cache_gib} GiB cache; use a smaller cache_gib") from None
        self._staging: list[EngramStaging] = []

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, layer: int, rows: RowRange | tuple[int, int] | None = None,
                        **kw) -> EngramStore:
        """Rows of `layer` straight from the original shards; rows: this rank's range (default: all rows)."""
        t = locate(checkpoint, layer)
        if rows is None:
            first, end = 0, t.rows
        elif isinstance(rows, RowRange):
            first, end = rows.first_row, rows.end_row
        elif isinstance(rows, tuple) and len(rows) == 2:
            first, end = rows
        else:
            raise EngramError(f"Engram layer {layer}: rows must be a RowRange or (first_row, end_row), got "
                              f"{rows!r:.60}")
        if not (is_int(first) and is_int(end) and 0 <= first < end <= t.rows):
            raise EngramError(f"Engram layer {layer}: rows [{first}, {end}) are outside the table's {t.rows} rows; "
                              "the config's head sizes do not match this checkpoint")
        return cls(t.extents(), first, end, **kw)

    @classmethod
    def from_pack(cls, path: str | Path, expect: PackHeader | None = None, **kw) -> EngramStore:
        """Rows from a pack file, whose header (and size) is checked first, against `expect` when given."""
        h = read_pack_header(path, expect)
        store = cls(h.extents(path), h.first_row, h.last_row + 1, **kw)
        store.header = h
        return store

    # ---------------------------------------------------------------------------------------------- lookups
    def lookup_async(self, ids, weight: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None) -> PendingLookup:
        """Start fetching rows `ids` (host int64/int32 [n]) into host weight/scale (allocated when None)."""
        op = "EngramStore.lookup"
        ids = _host_ids(ids, op)
        n = ids.shape[0]
        weight = _host_out(weight, n, WEIGHT_BYTES, torch.float8_e4m3fn, "weight", op)
        scale = _host_out(scale, n, SCALE_BYTES, torch.uint8, "scale", op)
        batch = self._c.submit(ids.data_ptr(), ids.dtype == torch.int32, n, weight.data_ptr(), scale.data_ptr())
        return PendingLookup(batch, ids, weight, scale)

    def lookup(self, ids, weight=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocking lookup: (weight float8_e4m3fn [n, 256], scale uint8 [n, 8]) in host memory."""
        return self.lookup_async(ids, weight, scale).wait()

    def staging(self, capacity: int) -> EngramStaging:
        """A pinned staging buffer for GPU lookups of up to `capacity` rows (one per stream)."""
        s = EngramStaging(self, capacity)
        self._staging.append(s)
        return s

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop cached pages of the files (cold-cache measurements in buffered mode)."""
        self._c.drop_page_cache()

    # ------------------------------------------------------------------------------------------ properties
    first_row = property(lambda self: self._c.first_row)
    end_row = property(lambda self: self._c.end_row)
    direct = property(lambda self: self._c.direct, doc="True when reads use O_DIRECT")
    io_path = property(lambda self: self._c.io_path, doc='"io_uring", "aio" or "pread" (blocking, one read per '
                       'thread)')
    queue_depth = property(lambda self: self._c.queue_depth, doc="rows in flight per thread (1 on the pread path)")
    io_note = property(lambda self: self._c.io_note, doc="why this path (fallback reasons), empty when none")
    threads = property(lambda self: self._c.threads)
    cache_hits = property(lambda self: self._c.cache_hits)
    cache_misses = property(lambda self: self._c.cache_misses)
    reads = property(lambda self: self._c.reads, doc="file reads so far (one per extent per missed row)")
    host_bytes = property(lambda self: self._c.host_bytes, doc="cache + I/O buffers (ordinary host memory)")
    cache_bytes = property(lambda self: self._c.cache_bytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(s.pinned_bytes for s in self._staging)


class EngramStaging:
    """Pinned staging + the CUDA-graph-capturable lookup (one per stream; keep it alive as long as any graph
    that captured it). fetch() enqueues on the current stream and returns without waiting."""

    def __init__(self, store: EngramStore, capacity: int):
        if not is_int(capacity) or capacity < 1:
            raise EngramError(f"Engram staging: capacity must be an integer >= 1 row, got {capacity!r:.40}")
        if not _ext.with_cuda():
            raise EngramError("Engram staging needs the CUDA build of twinspark (this build is CPU-only); use "
                              "EngramStore.lookup for host lookups")
        try:
            self._slot = _ext.module().EngramSlot(store._c, int(capacity))
        except RuntimeError as exc:
            raise EngramError(f"{exc}; use a smaller capacity") from None
        self.capacity = capacity

    @property
    def pinned_bytes(self) -> int:
        return self._slot.pinned_bytes

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor | None = None,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids int64/int32 [n] on a CUDA device (n <= capacity) -> (weight fp8 [n, 256], scale uint8 [n, 8]) on
        that device, filled in stream order (capturable)."""
        op = "EngramStaging.lookup"
        if not isinstance(ids, torch.Tensor) or not ids.is_cuda or ids.dim() != 1 or ids.dtype not in (
                torch.int64, torch.int32):
            raise TypeError(f"{op}: expected ids to be a 1-D int64/int32 CUDA tensor, got "
                            f"{getattr(ids, 'dtype', type(ids))} on {getattr(ids, 'device', '?')}")
        n = ids.shape[0]
        if n > self.capacity:
            raise ValueError(f"{op}: {n} ids exceed this staging buffer's capacity of {self.capacity} rows")
        ids = ids.contiguous()
        dev = ids.device
        if weight is None:
            weight = torch.empty(n, WEIGHT_BYTES, dtype=torch.float8_e4m3fn, device=dev)
        if scale is None:
            scale = torch.empty(n, SCALE_BYTES, dtype=torch.uint8, device=dev)
        for t, name, w, dt in ((weight, "weight", WEIGHT_BYTES, torch.float8_e4m3fn),
                               (scale, "scale", SCALE_BYTES, torch.uint8)):
            if t.dtype != dt or tuple(t.shape) != (n, w) or t.device != dev or not t.is_contiguous():
                raise ValueError(f"{op}: expected {name} to be a contiguous {dt} [{n}, {w}] on {dev}, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        with torch.cuda.device(dev):
            self._slot.enqueue(ids.data_ptr(), ids.dtype == torch.int32, n, weight.data_ptr(), scale.data_ptr(),
                               _ext.stream_ptr(dev))
        return weight, scale

    def fetch(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """lookup + dequant: bf16 [n, 256] on the ids' device, enqueued on the current stream (capturable)."""
        from twinspark.ops import engram_dequant

        weight, scale = self.lookup(ids)
        return engram_dequant(weight, scale, out=out)

    def check(self) -> None:
        """Raise the first read error since the last check (host functions cannot raise; their rows are zero)."""
        err = self._slot.take_error()
        if err:
            raise EngramError(f"Engram row read failed during a GPU lookup: {err}; check the file (re-run "
                              "`invoke pack` for a pack file, re-download a shard)")
