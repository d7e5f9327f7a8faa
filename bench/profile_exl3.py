"""Run one EXL3 op a few times at one shape, for a profiler (`ncu`) to capture its kernels:

    ncu --kernel-name regex:moe_gemm --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python bench/profile_exl3.py moe --K 2 --T 1
    ncu --kernel-name regex:small_m --launch-skip 2 --launch-count 1 python bench/profile_exl3.py gemm --m 1

Random data (trellis, scales, x, routing), the same builders as the benchmarks; nothing is timed here.
--kernels: no ncu needed; torch.profiler (CUPTI) prints each kernel's mean GPU µs per call instead (gemm: also
bf16 dense x @ W of the same shape). Pick a GEMM path with TWINSPARK_EXL3_GEMM_VARIANT=small|fused|large.
Kernels launched with programmatic dependent launch count their wait for the kernel before them.

    TWINSPARK_EXL3_GEMM_VARIANT=large python bench/profile_exl3.py gemm --m 1024 --kernels
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
        for _ in range(a.calls):
            exl3_gemm(x, layer)
    torch.cuda.synchronize()
    return 0


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
