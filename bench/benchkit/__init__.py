"""Benchmark kit shared by every kernel benchmark (bench/bench_<op>.py): GPU timing, L2-cold rotation,
the ceilings of the machine measured in the same run, records, JSON results and the H200 anchors. It lives in the
checkout, not in the wheel: a benchmark run as ``python bench/bench_<op>.py`` has bench/ on sys.path and imports
``benchkit``; the product (twinspark.client.forecast) reads the results files without it.

Modules: ``timing`` (time_cuda, rotate, ceilings), ``results`` (Record, write_results, load_results, save_figure),
``anchors`` (load_anchors); every name is re-exported here. The GB10 names below are twinspark.gb10's (one model).

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
    import benchkit as bk

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

from pathlib import Path

from twinspark import gb10

from .anchors import (
    ANCHORS_PATH,
    Anchors,
    Ceilings,
    DenseAnchor,
    EngramAnchor,
    GemmAnchor,
    MgemmAnchor,
    MoeAnchor,
    load_anchors,
)
from .errors import BenchError
from .results import Record, default_out_dir, load_results, machine_info, save_figure, write_results
from .timing import (
    L2_COLD_BYTES,
    Ring,
    Timing,
    _require_cuda,
    bf16_dense_us,
    bf16_matmul_tflops,
    copy_ceiling_gbps,
    gbps,
    rotate,
    tensor_bytes,
    time_cuda,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

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


__all__ = [
    "ANCHORS_PATH", "L2_COLD_BYTES", "REPO_ROOT", "Anchors", "BenchError", "Ceilings", "DenseAnchor", "EngramAnchor",
    "GemmAnchor", "MgemmAnchor", "MoeAnchor", "Record", "Ring", "Timing", "_require_cuda", "bf16_dense_us",
    "bf16_matmul_tflops", "copy_ceiling_gbps", "default_out_dir", "gbps", "load_anchors", "load_results",
    "machine_info", "predict_gb10_large_us", "predict_gb10_us", "rotate", "save_figure", "tensor_bytes", "time_cuda",
    "write_results", "GB10_BW", "GB10_BW_FRACTION", "GB10_SMS", "GB10_CLOCK", "GB10_SMEM_PER_SM", "H200_SMS",
    "H200_CLOCK", "GB10_LAUNCH_US", "H200_LAUNCH_US", "GB10_BF16_FLOPS",
]
