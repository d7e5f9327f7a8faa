"""Benchmark kit shared by every kernel benchmark (bench/bench_<op>.py): GPU timing, L2-cold rotation,
the ceilings of the machine measured in the same run, records, JSON results and the H200 anchors.

Method (the same as bench/anchors_h200.json, so numbers compare): CUDA events around back-to-back calls queued
behind a GPU sleep, so the GPU runs them back to back (GPU time; host launch cost excluded); a few warm-up calls;
the median of 7 samples, each one pass over the argument ring; L2-cold weights by cycling through copies of the
arguments whose bytes total >= 256 MB (the H200's L2 is 60 MB, GB10's 24 MB: after 256 MB of other weights none
of a call's weights is still cached).

Contract of a benchmark file: ``bench/bench_<op>.py`` runs as a script (bench/run.py starts each in its own
process, ``python bench/bench_<op>.py``, with $TWINSPARK_BENCH_OUT set), times its cases with this kit and ends
with ``write_results("<op>", records, ceilings=...)``. Set ``anchor_us`` (and ``dense_us`` where it applies) on
each record: the report compares against them. Example::

    import torch
    from twinspark import benchkit as bk

    def main():
        dev = torch.device("cuda")
        copy = bk.copy_ceiling_gbps(dev)                      # GB/s, bytes read + written, measured now
        anchors = bk.load_anchors()
        records = []
        for k, n, K in [(5120, 1152, 3)]:
            x = torch.randn(1, k, device=dev, dtype=torch.float16)
            # one argument set = the weights of one call; rotate() makes copies until they total >= 256 MB
            ring = bk.rotate(lambda: (make_weights(k, n, K, dev),))
            t = bk.time_cuda(lambda w: my_op(x, w), args=ring, warmup=3, iters=7)
            a = anchors.gemm(k=k, n=n, K=K, m=1)                 # None when the shape has no anchor
            records.append(bk.Record(
                op="exl3_gemm", shape={"k": k, "n": n, "K": K, "m": 1}, timing=t,
                bytes=ring.bytes_per_set + x.nbytes + n * 2,    # what one call must move
                anchor_us=a.upstream_us if a else None,
                dense_us=bk.bf16_dense_us(1, k, n, device=dev)))
        bk.write_results("exl3_gemm", records, ceilings={"copy_gbps": copy})

    if __name__ == "__main__":
        main()

API:
- ``time_cuda(fn, *, warmup=3, iters=7, setup=None, args=None, calls_per_sample=None) -> Timing`` (µs per
  call: ``.median_us``, ``.samples_us``, ``float(t)`` is the median). ``fn`` is called as ``fn(*args[i])`` with
  the i-th argument set (cycling) when ``args`` is given, else ``fn()``. A sample is an event pair around a pass
  over the ring (<= 64 calls) divided by its calls, as for the anchors; ``setup()`` (optional) runs before
  every call outside the events (then each call is its own sample, ~2 µs of event overhead included).
- ``rotate(make_args, total_bytes=L2_COLD_BYTES, *, nbytes=None) -> Ring``: calls ``make_args()`` (returns a
  tuple) until the argument sets hold ``total_bytes``; ``nbytes(args)`` overrides what counts (default: the
  bytes of every tensor in the tuple). ``ring.bytes_per_set`` is the bytes of one set.
- ``copy_ceiling_gbps(device)``: device-to-device copy bandwidth (read + write) measured now, cached per device.
- ``bf16_matmul_tflops(device)``: torch.mm 8192^3 bf16, cached per device.
- ``bf16_dense_us(m, k, n, *, device)``: torch.mm of bf16 [m, k] activations by random bf16 weights stored
  [n, k] (the nn.Linear layout), L2-cold like the kernels.
- ``gbps(nbytes, us)``; ``Record`` (op, shape, timing, bytes, flops, anchor_us, dense_us, variant, notes);
  ``write_results(name, records, out_dir=None, ceilings=None) -> Path`` (JSON, temp + rename, into
  $TWINSPARK_BENCH_OUT or bench/results, with
  ``machine_info()``: GPU, SM count, torch and CUDA versions, date); ``load_results(path)``.
- ``load_anchors(path=None) -> Anchors``: the tables of docs anchors-h200.md as typed rows, with lookups
  ``.gemm(k, n, K, m)``, ``.dense(k, n, m)``, ``.moe(K, T)``, ``.moe_mgemm(K, tokens)``, ``.engram(rows)``
  and ``.ceilings``.

Only the timing and ceiling functions need a GPU; everything else (records, JSON, anchors) runs anywhere.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twinspark import gb10
from twinspark.fileio import atomic_write, read_json
from twinspark.paths import project_root

L2_COLD_BYTES = 256 * 1024 * 1024  # >= 4x the largest L2 we run on (H200: 60 MB)
_SLEEP_HZ = 2.0e9  # torch.cuda._sleep counts GPU cycles; >= the fastest SM clock we run on (H200 boost 1.98 GHz)
REPO_ROOT = project_root()
ANCHORS_PATH = REPO_ROOT / "bench" / "anchors_h200.json"


class BenchError(RuntimeError):
    """A benchmark cannot run as asked (no GPU, bad argument); str() says what to do."""


# ---------------------------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Timing:
    """GPU times of the timed calls, in microseconds."""

    samples_us: tuple[float, ...]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def min_us(self) -> float:
        return min(self.samples_us)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the run was."""
        m = self.median_us
        return (max(self.samples_us) - min(self.samples_us)) / m if m > 0 else 0.0

    def __float__(self) -> float:
        return self.median_us


def _require_cuda(device=None):
    import torch

    if not torch.cuda.is_available():
        raise BenchError("benchkit: no CUDA GPU is visible to torch; run the benchmarks on a GPU machine")
    return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())


def time_cuda(
    fn: Callable[..., Any],
    *,
    warmup: int = 3,
    iters: int = 7,
    setup: Callable[[], Any] | None = None,
    args: Sequence[tuple] | None = None,
    calls_per_sample: int | None = None,
) -> Timing:
    """GPU µs per call of ``fn``: ``iters`` samples (median them) after ``warmup`` untimed calls (at least one
    runs: it also measures how long the host takes to launch a call).

    A sample is one CUDA event pair around ``calls_per_sample`` back-to-back calls, divided by that count;
    default: one pass over ``args`` (at most 64 calls), or 16 calls without ``args``, or 1 call with ``setup``.
    The anchors were measured this way: an event pair per call adds ~2 µs of event overhead (H200, bf16 mm
    1x1152 by 1152x5120: 8.7 µs with an event pair per call vs 6.7 µs, the anchor, over a pass of the ring).
    With ``args`` (argument tuples, e.g. a Ring from rotate()) call i gets ``args[i % len]``, so consecutive calls
    touch different memory (L2-cold). ``setup()`` runs before every call outside the events (one call per sample)."""
    if warmup < 0 or iters < 1:
        raise BenchError(f"time_cuda: expected warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    if args is not None and len(args) == 0:
        raise BenchError("time_cuda: args is an empty list of argument sets; pass at least one tuple")
    if setup is not None and calls_per_sample not in (None, 1):
        raise BenchError("time_cuda: with setup= every call is timed alone; leave calls_per_sample unset")
    per = calls_per_sample or (1 if setup is not None else min(len(args), 64) if args is not None else 16)
    if per < 1:
        raise BenchError(f"time_cuda: expected calls_per_sample >= 1, got {per}")
    _require_cuda()
    import torch

    def call(i: int):
        return fn(*args[i % len(args)]) if args is not None else fn()

    for i in range(max(warmup - 1, 0)):
        if setup is not None:
            setup()
        call(i)
    torch.cuda.synchronize()
    if setup is not None:
        setup()
    t0 = time.perf_counter()
    call(max(warmup - 1, 0))  # the last warm-up call (or one extra) also measures the host's launch time
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # Queue each sample's calls behind a GPU sleep long enough for the host to launch them, so the GPU runs them
    # back to back. On an idle GPU the start event fires at once and the host's launch time lands inside the
    # events (measured on the H200: bf16 mm 1x5120 by 5120x1152 read 44 us idle vs 10 us queued). One sleep per
    # sample, sized from the slowest host launch time seen so far: one sleep sized from the warm-up call ran out
    # half-way through 30 samples of 64 calls (exl3_gemm m=1: 17 samples at 5.8 us, then 13 at ~47 us per call).
    per_call_s = host_s
    i = warmup
    for j in range(iters):
        if setup is not None:
            setup()
        torch.cuda._sleep(int(min(2 * per * (per_call_s + 20e-6) + 50e-6, 0.5) * _SLEEP_HZ))
        t0 = time.perf_counter()
        starts[j].record(stream)
        for _ in range(per):
            call(i)
            i += 1
        ends[j].record(stream)
        per_call_s = max(per_call_s, (time.perf_counter() - t0) / per)
    torch.cuda.synchronize()
    return Timing(tuple(s.elapsed_time(e) * 1000.0 / per for s, e in zip(starts, ends)))


# ---------------------------------------------------------------------------------------------- L2-cold ring
def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside obj (tensors, tuples/lists/dicts of them, objects with tensor attributes)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(tensor_bytes(v) for v in vars(obj).values())
    return 0


class Ring(list):
    """Argument sets for L2-cold timing; a list of tuples plus what one set weighs."""

    bytes_per_set: int = 0
    total_bytes: int = 0


def rotate(
    make_args: Callable[[], tuple],
    total_bytes: int = L2_COLD_BYTES,
    *,
    nbytes: Callable[[tuple], int] | None = None,
    max_sets: int = 100_000,
) -> Ring:
    """Call ``make_args()`` until the sets total ``total_bytes`` (at least one set). Each call must return fresh
    tensors (a tuple; a single tensor is wrapped). ``nbytes(args)`` says what counts; default: every tensor."""
    count = nbytes or tensor_bytes
    ring = Ring()
    total = 0
    while total < total_bytes or not ring:
        a = make_args()
        a = a if isinstance(a, tuple) else (a,)
        b = int(count(a))
        if b <= 0:
            raise BenchError("rotate: make_args() returned no tensor bytes; return the weights of one call as a tuple")
        if len(ring) >= max_sets:
            raise BenchError(f"rotate: {max_sets} argument sets hold only {total} bytes of {total_bytes}; "
                             "return larger argument sets or pass a smaller total_bytes")
        ring.append(a)
        total += b
    ring.bytes_per_set = total // len(ring)
    ring.total_bytes = total
    return ring


# --------------------------------------------------------------------------------------------------- GB10 model
# One model, twinspark.gb10 (its docstring: every constant with its source); these names stay for the benchmarks.
GB10_BW = float(gb10.BW)
GB10_BW_FRACTION = float(gb10.BW_EFFICIENCY)
GB10_SMS, GB10_CLOCK = int(gb10.SMS.value), float(gb10.CLOCK)
GB10_SMEM_PER_SM = int(gb10.SMEM_PER_SM.value)
H200_SMS, H200_CLOCK = int(gb10.H200_SMS.value), float(gb10.H200_CLOCK)
GB10_LAUNCH_US = float(gb10.LAUNCH_US)
H200_LAUNCH_US = float(gb10.H200_LAUNCH_US)
GB10_BF16_FLOPS = float(gb10.GB10_BF16_FLOPS)


def predict_gb10_us(nbytes: float, h200_us: float, h200_copy_gbps: float, launches: int = 1) -> dict:
    """GB10 time of one call from its bytes and whole-H200 time: twinspark.gb10.predict_from_h200_us."""
    return gb10.predict_from_h200_us(nbytes, h200_us, h200_copy_gbps, launches)


def predict_gb10_large_us(k: int, n: int, m: int, trellis_bytes: float, x_bytes: float, out_bytes: float) -> dict:
    """GB10 time of the exl3_gemm large path: twinspark.gb10.large_gemm_us."""
    return gb10.large_gemm_us(k, n, m, trellis_bytes, x_bytes, out_bytes)


# --------------------------------------------------------------------------------------------------- ceilings
def gbps(nbytes: float, us: float) -> float:
    """Bytes moved in ``us`` microseconds -> GB/s (10^9 bytes per second)."""
    return nbytes / us / 1e3 if us > 0 else float("nan")


def _dev_key(device) -> str:
    import torch

    d = torch.device(device) if device is not None else _require_cuda()
    if d.type != "cuda":
        raise BenchError(f"benchkit: expected a CUDA device, got {d}")
    return str(d if d.index is not None else torch.device("cuda", torch.cuda.current_device()))


@functools.cache
def _copy_ceiling(dev: str, nbytes: int) -> float:
    import torch

    n = nbytes // 2
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    with torch.cuda.device(torch.device(dev)):
        t = time_cuda(lambda: dst.copy_(src), warmup=3, iters=15)
    return gbps(nbytes, t.median_us)


def copy_ceiling_gbps(device=None, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of ``nbytes`` read + written (default 512 MiB each way), GB/s; cached per device."""
    _require_cuda(device)
    return _copy_ceiling(_dev_key(device), int(nbytes))


@functools.cache
def _matmul_ceiling(dev: str, size: int) -> float:
    import torch

    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    with torch.cuda.device(torch.device(dev)):
        t = time_cuda(lambda: torch.mm(a, b), warmup=3, iters=10)
    return 2.0 * size**3 / (t.median_us * 1e-6) / 1e12


def bf16_matmul_tflops(device=None, size: int = 8192) -> float:
    """bf16 torch.mm of size^3 in TFLOP/s; cached per device."""
    _require_cuda(device)
    return _matmul_ceiling(_dev_key(device), int(size))


def bf16_dense_us(m: int, k: int, n: int, *, device=None, warmup: int = 3, iters: int = 7,
                  total_bytes: int = L2_COLD_BYTES) -> float:
    """Median µs of torch.mm(x[m, k], W[n, k].t()) in bf16 with random weights, L2-cold (a ring of weights)."""
    if min(m, k, n) < 1:
        raise BenchError(f"bf16_dense_us: expected positive m, k, n, got m={m}, k={k}, n={n}")
    import torch

    dev = torch.device(_dev_key(device))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ring = rotate(lambda: (torch.randn(n, k, device=dev, dtype=torch.bfloat16),), total_bytes)
    t = time_cuda(lambda w: torch.mm(x, w.t()), args=ring, warmup=warmup, iters=iters)
    del ring
    return t.median_us


# ---------------------------------------------------------------------------------------------------- records
@dataclass
class Record:
    """One measured case. ``bytes`` = bytes one call must move (weights + activations), for GB/s against the
    copy ceiling; ``anchor_us`` = the upstream H200 number for the same case (None when there is none);
    ``dense_us`` = the bf16 dense torch.mm time of the same shape, when it applies."""

    op: str
    shape: dict[str, int]
    timing: Timing | None = None
    median_us: float | None = None
    bytes: int | None = None
    flops: int | None = None
    anchor_us: float | None = None
    dense_us: float | None = None
    variant: str = "twinspark"
    notes: str = ""
    samples_us: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.op or not isinstance(self.shape, dict):
            raise BenchError(f"Record: expected an op name and a shape dict, got op={self.op!r}, shape={self.shape!r}")
        if self.timing is not None:
            self.median_us = self.timing.median_us
            self.samples_us = list(self.timing.samples_us)
        if self.median_us is None:
            raise BenchError(f"Record {self.op} {self.shape}: give timing= or median_us=")

    @property
    def gbps(self) -> float | None:
        return gbps(self.bytes, self.median_us) if self.bytes else None

    @property
    def vs_anchor(self) -> float | None:
        """Speed-up over the upstream anchor (> 1: faster than upstream)."""
        return self.anchor_us / self.median_us if self.anchor_us and self.median_us else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timing")
        d["gbps"] = self.gbps
        d["vs_anchor"] = self.vs_anchor
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        keep = {k: d[k] for k in ("op", "shape", "median_us", "bytes", "flops", "anchor_us", "dense_us",
                                   "variant", "notes", "samples_us") if k in d}
        return cls(**keep)


def machine_info() -> dict[str, Any]:
    """GPU name, SM count, capability, torch and CUDA versions, host and date (UTC) of this run."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            info.update(gpu=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                        gpu_memory_gib=round(p.total_memory / 2**30, 1))
            try:
                import subprocess

                info["driver"] = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
            except (OSError, IndexError, subprocess.SubprocessError):
                pass
        else:
            info["gpu"] = None
    except ImportError:
        info["torch"] = None
    return info


def default_out_dir() -> Path:
    """$TWINSPARK_BENCH_OUT (set by bench/run.py) or bench/results."""
    return Path(os.environ.get("TWINSPARK_BENCH_OUT") or "bench/results")


def write_results(name: str, records: Iterable[Record], out_dir: str | os.PathLike | None = None,
                  ceilings: dict[str, float] | None = None, machine: dict[str, Any] | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` (temp + rename): machine info, ceilings and every record.
    ``out_dir`` defaults to default_out_dir(), so a bench file run by bench/run.py writes where run.py reads."""
    if not name or "/" in name:
        raise BenchError(f"write_results: expected a plain name like 'exl3_gemm', got {name!r}")
    recs = list(records)
    bad = [r for r in recs if not isinstance(r, Record)]
    if bad:
        raise BenchError(f"write_results: expected Record objects, got {type(bad[0]).__name__}")
    doc = {
        "name": name,
        "machine": machine if machine is not None else machine_info(),
        "ceilings": dict(ceilings or {}),
        "records": [r.to_json() for r in recs],
    }
    path = Path(out_dir if out_dir is not None else default_out_dir()) / f"{name}.json"
    atomic_write(path, json.dumps(doc, indent=1) + "\n")
    return path


def save_figure(fig, png: str | os.PathLike, dpi: int = 100) -> Path:
    """Write a matplotlib figure to ``png`` (temp name, then rename: never a half-written PNG) and close it."""
    import matplotlib.pyplot as plt

    png = Path(png)
    tmp = png.with_name(f".{png.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return png


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A results file back: {"name", "machine", "ceilings", "records": [Record, ...]}."""
    p = Path(path)
    try:
        doc = read_json(p)  # a regular file only: a FIFO would block the reader
        doc["records"] = [Record.from_json(r) for r in doc["records"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{p} is not a benchkit results file ({e}); re-run the benchmark that wrote it") from None
    return doc


# ---------------------------------------------------------------------------------------------------- anchors
@dataclass(frozen=True)
class GemmAnchor:
    k: int
    n: int
    K: int
    m: int
    upstream_us: float


@dataclass(frozen=True)
class DenseAnchor:
    k: int
    n: int
    m: int
    us: float


@dataclass(frozen=True)
class MoeAnchor:
    K: int
    T: int
    us: float
    path: str  # "cooperative" (decode, T <= 8) or "fused_full" (prefill, routing preparation included)


@dataclass(frozen=True)
class MgemmAnchor:
    K: int
    tokens: int
    gate_up_us: float
    down_us: float
    layer_us: float


@dataclass(frozen=True)
class EngramAnchor:
    rows: int
    us: float
    gbps: float


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    bf16_matmul_tflops: float


@dataclass(frozen=True)
class Anchors:
    meta: dict[str, Any]
    ceilings: Ceilings
    gemm_rows: tuple[GemmAnchor, ...]
    dense_rows: tuple[DenseAnchor, ...]
    moe_rows: tuple[MoeAnchor, ...]
    moe_shape: dict[str, int]
    moe_distinct_experts: dict[int, float]
    mgemm_rows: tuple[MgemmAnchor, ...]
    engram_rows: tuple[EngramAnchor, ...]
    engram_table: dict[str, int]

    def gemm(self, *, k: int, n: int, K: int, m: int) -> GemmAnchor | None:
        return next((r for r in self.gemm_rows if (r.k, r.n, r.K, r.m) == (k, n, K, m)), None)

    def dense(self, *, k: int, n: int, m: int) -> DenseAnchor | None:
        return next((r for r in self.dense_rows if (r.k, r.n, r.m) == (k, n, m)), None)

    def moe(self, *, K: int, T: int) -> MoeAnchor | None:
        return next((r for r in self.moe_rows if (r.K, r.T) == (K, T)), None)

    def moe_mgemm(self, *, K: int, tokens: int) -> MgemmAnchor | None:
        return next((r for r in self.mgemm_rows if (r.K, r.tokens) == (K, tokens)), None)

    def engram(self, *, rows: int) -> EngramAnchor | None:
        return next((r for r in self.engram_rows if r.rows == rows), None)


def _rows(doc: dict, key: str, cls: type, path: Path) -> tuple:
    out = []
    names = {f for f in cls.__dataclass_fields__}
    for i, row in enumerate(doc.get(key, [])):
        if set(row) != names:
            raise BenchError(f"{path}: {key}[{i}] has fields {sorted(row)}, expected {sorted(names)}; fix the file")
        typed = {}
        for f, spec in cls.__dataclass_fields__.items():
            v = row[f]
            want = spec.type
            ok = (isinstance(v, int) and not isinstance(v, bool)) if want == "int" else (
                isinstance(v, (int, float)) and not isinstance(v, bool) if want == "float" else isinstance(v, str))
            if not ok:
                raise BenchError(f"{path}: {key}[{i}].{f} = {v!r} is not a {want}; fix the file")
            typed[f] = float(v) if want == "float" else v
        out.append(cls(**typed))
    if not out:
        raise BenchError(f"{path}: the table '{key}' is missing or empty; restore bench/anchors_h200.json")
    return tuple(out)


def load_anchors(path: str | os.PathLike | None = None) -> Anchors:
    """The H200 anchors (default bench/anchors_h200.json of this checkout, or $TWINSPARK_ANCHORS)."""
    p = Path(path or os.environ.get("TWINSPARK_ANCHORS", ANCHORS_PATH))
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise BenchError(f"cannot read the anchors file {p} ({e.strerror}); pass its path or set TWINSPARK_ANCHORS") from None
    except ValueError as e:
        raise BenchError(f"{p} is not valid JSON ({e}); fix the file") from None
    try:
        c = doc["ceilings"]
        ceilings = Ceilings(float(c["copy_gbps"]), float(c["bf16_matmul_tflops"]))
        moe = doc["moe"]
        engram = doc["engram"]
        return Anchors(
            meta=dict(doc.get("meta", {})),
            ceilings=ceilings,
            gemm_rows=_rows(doc, "gemm", GemmAnchor, p),
            dense_rows=_rows(doc, "bf16_dense", DenseAnchor, p),
            moe_rows=_rows(moe, "rows", MoeAnchor, p),
            moe_shape={k: int(v) for k, v in moe["shape"].items()},
            moe_distinct_experts={int(k): float(v) for k, v in moe["distinct_experts"].items()},
            mgemm_rows=_rows(doc, "moe_mgemm", MgemmAnchor, p),
            engram_rows=_rows(engram, "rows", EngramAnchor, p),
            engram_table={k: int(v) for k, v in engram["table"].items()},
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise BenchError(f"{p} lacks the entry {e} or has the wrong structure; restore bench/anchors_h200.json") from None
