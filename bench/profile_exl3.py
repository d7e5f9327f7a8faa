"""Run one EXL3 op a few times at one shape, for a profiler (`ncu`) to capture its kernels:

    ncu --kernel-name regex:moe_gemm --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python bench/profile_exl3.py moe --K 2 --T 1
    ncu --kernel-name regex:small_m --launch-skip 2 --launch-count 1 python bench/profile_exl3.py gemm --m 1

Random data (trellis, scales, x, routing), the same builders as the benchmarks; nothing is timed here.
--kernels: no ncu needed; torch.profiler (CUPTI) prints each kernel's mean GPU µs per call instead (gemm: also
bf16 dense x @ W of the same shape). Pick a GEMM path with TWINSPARK_PLAN=exl3_gemm.variant=small|fused|large
(any key of twinspark.ops.plans, comma-separated: the plan the op launches with).
Kernels launched with programmatic dependent launch count their wait for the kernel before them.

    TWINSPARK_PLAN=exl3_gemm.variant=large python bench/profile_exl3.py gemm --m 1024 --kernels

moe --trace: the per-block timeline of one layer (a TWINSPARK_TRACE=1 build; cuda/common/trace.cuh).
--host: the host's µs per call (what eager, graph-less decode pays to launch a layer), e.g. --calls 200.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=("moe", "gemm"))
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--T", type=int, default=1, help="moe: tokens")
    ap.add_argument("--m", type=int, default=1, help="gemm: rows of x")
    ap.add_argument("--k", type=int, default=5120, help="gemm: input features")
    ap.add_argument("--n", type=int, default=12288, help="gemm: output features")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--kernels", action="store_true", help="print per-kernel GPU time (torch.profiler) instead")
    ap.add_argument("--host", action="store_true",
                    help="print the host's µs per call instead (--calls calls queued without a sync, median of 5)")
    ap.add_argument("--trace", action="store_true",
                    help="moe: print the per-block timeline of the last of --calls layers (common/trace.cuh)")
    ap.add_argument("--warm", action="store_true",
                    help="--trace: every call on the same routing (its weights stay in L2: no DRAM latency)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    if a.op == "moe":
        import bench_exl3_moe as bm
        from twinspark.ops import exl3_moe

        ex = bm.make_experts(float(a.K), dev)
        if a.kernels:
            ids, w = bm.routing(a.T, dev, gen)
            x = torch.randn(a.T, bm.H, device=dev, generator=gen).bfloat16()
            _kernels(f"exl3_moe K={a.K} T={a.T}", lambda: exl3_moe(x, ids, w, ex), a.calls)
            return 0
        if a.host:
            ids, w = bm.routing(a.T, dev, gen)
            x = torch.randn(a.T, bm.H, device=dev, generator=gen).bfloat16()
            _host(f"exl3_moe K={a.K} T={a.T}", lambda: exl3_moe(x, ids, w, ex), a.calls)
            return 0
        if a.trace:
            _trace_moe(ex, a.T, a.calls, bm, dev, gen, a.warm)
            return 0
        for _ in range(a.calls):
            ids, w = bm.routing(a.T, dev, gen)
            exl3_moe(torch.randn(a.T, bm.H, device=dev, generator=gen).bfloat16(), ids, w, ex)
    else:
        from twinspark.exl3.layer import Exl3Layer, random_layer
        from twinspark.ops import exl3_gemm

        base = random_layer(a.k, a.n, a.K, "mul1", device=dev)
        t = torch.randint(-32768, 32768, (a.k // 16, a.n // 16, 16 * a.K), dtype=torch.int16, device=dev)
        layer = Exl3Layer(t, base.suh, base.svh, float(a.K), "mul1")
        x = torch.randn(a.m, a.k, device=dev, generator=gen).bfloat16()
        if a.kernels:
            w = torch.randn(a.k, a.n, device=dev, generator=gen).bfloat16()
            _kernels(f"exl3_gemm {a.k}x{a.n} K={a.K} m={a.m}", lambda: exl3_gemm(x, layer), a.calls)
            _kernels("bf16 dense x @ W", lambda: torch.mm(x, w), a.calls)
            return 0
        if a.host:
            _host(f"exl3_gemm {a.k}x{a.n} K={a.K} m={a.m}", lambda: exl3_gemm(x, layer), a.calls)
            return 0
        for _ in range(a.calls):
            exl3_gemm(x, layer)
    torch.cuda.synchronize()
    return 0


def _trace_moe(ex, T, calls, bm, dev, gen, warm) -> None:
    """Layers back to back on fresh routings (weights from DRAM; warm: one routing, weights in L2), the last one
    with per-block marks; prints when the gate/up and down blocks ran (µs from the first gate/up start), their
    phases, and how many ran at once."""
    import importlib

    from twinspark import _ext

    if not _ext.module().trace_built:
        raise SystemExit("--trace needs a build with the marks compiled in: TWINSPARK_TRACE=1 pip install "
                         "--no-build-isolation --no-deps . (cuda/common/trace.cuh)")
    mod = importlib.import_module("twinspark.ops.exl3_moe")  # the package exports the function under this name
    buf = torch.zeros(_ext.module().trace_shape, dtype=torch.int64, device=dev)
    for i in range(calls):
        if i == 0 or not warm:
            ids, w = bm.routing(T, dev, gen)
            x = torch.randn(T, bm.H, device=dev, generator=gen).bfloat16()
        mod._kernel(x, ids, w, ex.trellis, ex.offsets, ex.words, ex.suh13, ex.svh13, ex.suh2, ex.svh2,
                    ex.first_expert, ex.max_words, ex.words13, ex.words2, ex.codebook, None,
                    trace=buf if i == calls - 1 else None)
    torch.cuda.synchronize()
    rows = buf.cpu()
    ran = [rows[k][rows[k][:, 0] > 0] for k in range(2)]
    t0 = int(ran[0][:, 1].min())
    us = lambda v: (v.double() - t0) / 1e3  # noqa: E731
    print(f"exl3_moe K={ex.max_words // 16} T={T}{' (warm: weights in L2)' if warm else ''}: per-block marks of "
          "one layer (µs from the first gate/up start)")
    for k, name in enumerate(("gate/up", "down")):
        r = ran[k]
        work = r[r[:, 2] > 0]  # blocks past the item count return before mark 2
        q = lambda v: " / ".join(f"{float(v.quantile(p)):6.1f}" for p in (0.0, 0.5, 1.0))  # noqa: E731
        print(f"  {name}: {len(r)} blocks ran on {len(set(r[:, 0].tolist()))} SMs, {len(work)} with work "
              f"(min / median / max)")
        print(f"    start        {q(us(r[:, 1]))}")
        print(f"    body begins  {q(us(work[:, 2]))}   (routing and rows: {q((work[:, 2] - work[:, 1]) / 1e3)})")
        print(f"    body ends    {q(us(work[:, 3]))}   (body: {q((work[:, 3] - work[:, 2]) / 1e3)})")
        print(f"    end          {q(us(work[:, 4]))}")
        last = work[work[:, 5] > 0]
        if len(last):
            what = "activations made" if k == 0 else "columns converted"
            print(f"    {what} by {len(last)} blocks: from {q(us(last[:, 5]))} to {q(us(last[:, 4]))}")
        per_sm = defaultdict(list)
        for row in r.tolist():
            per_sm[row[0]].append(row)
        ends = torch.tensor([max(b[4] for b in bs) for bs in per_sm.values()], dtype=torch.int64)
        counts = torch.tensor([len(bs) for bs in per_sm.values()], dtype=torch.float64)
        print(f"    per SM: blocks {q(counts)}, last end {q(us(ends))}")
    edges = torch.arange(0, float(us(torch.cat([ran[0][:, 4], ran[1][:, 4]])).max()) + 2, 2.0)
    line = "  running at once (2 µs bins; gate/up | down):"
    for lo in edges.tolist():
        n = [int(((us(ran[k][:, 1]) < lo + 2) & (us(ran[k][:, 4]) > lo)).sum()) for k in range(2)]
        line += f"\n    {lo:5.0f}  {n[0]:4d} | {n[1]:4d}"
    print(line)


def _host(label, fn, calls) -> None:
    """The host's µs per call (launch cost): rounds of `calls` calls queued back to back without a sync (keep
    calls x launches per call under the launch queue's depth, ~1000), median of 5 rounds after a warm-up round."""
    import statistics
    import time

    rounds = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    print(f"{label}: host {statistics.median(rounds[1:]):.1f} µs per call ({calls} calls per round, median of 5; "
          f"rounds {' '.join(f'{r:.1f}' for r in rounds[1:])})")


def _kernels(label, fn, calls) -> None:
    """Mean GPU µs per call of each kernel fn launches (after warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time / calls
    print(f"{label}: {sum(per.values()):.1f} us of kernels per call")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
