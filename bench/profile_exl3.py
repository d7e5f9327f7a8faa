"""Run one EXL3 op a few times at one shape, for a profiler (`ncu`) to capture its kernels:

    ncu --kernel-name regex:moe_gemm --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python bench/profile_exl3.py moe --K 2 --T 1
    ncu --kernel-name regex:small_m --launch-skip 2 --launch-count 1 python bench/profile_exl3.py gemm --m 1

Random data (trellis, scales, x, routing), the same builders as the benchmarks; nothing is timed here.
"""

from __future__ import annotations

import argparse
import sys
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
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    if a.op == "moe":
        import bench_exl3_moe as bm
        from twinspark.ops import exl3_moe

        ex = bm.make_experts(float(a.K), dev)
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
        for _ in range(a.calls):
            exl3_gemm(x, layer)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
