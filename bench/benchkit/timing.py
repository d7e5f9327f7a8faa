"""GPU timing for the benchmarks: CUDA events around back-to-back calls queued behind a GPU sleep (time_cuda),
L2-cold argument rings (rotate) and the machine's ceilings measured in the same run (copy, bf16 matmul, bf16 dense)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BenchError

L2_COLD_BYTES = 256 * 1024 * 1024  # >= 4x the largest L2 we run on (H200: 60 MB)
_SLEEP_HZ = 2.0e9  # torch.cuda._sleep counts GPU cycles; >= the fastest SM clock we run on (H200 boost 1.98 GHz)


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
