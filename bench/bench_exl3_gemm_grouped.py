"""Grouped EXL3 GEMM benchmark (`nox -s bench -- exl3_gemm_grouped`): DeepSeek V4.1's wo_a, G groups of
4096 -> 1024 (G = 4 at TP 2, 8 at TP 1), K = 5 (K = 4: the draft model), mul1, bf16 activations x [m, G, 4096],
m in {1, 2, 4, 8, 16, 64}. Three ways, each timed eager (CUDA events around back-to-back calls, warm-up, median)
and as CUDA-graph replay (one graph holding a call per ring entry), weights L2-cold (benchkit rotates
copies over >= 256 MB), random data:
  grouped      exl3_gemm_grouped: one launch for all G groups
  one-by-one   G calls of exl3_gemm (x[:, g] strided, an output per group)
  bf16 bmm     torch.bmm of [G, m, 4096] by bf16 [G, 4096, 1024] weights
Prints µs, GB/s of weight bytes and the ratios; writes exl3_gemm_grouped.json (benchkit) and exl3_gemm_grouped.png.

    python bench/bench_exl3_gemm_grouped.py [--quick] [--ms 1,16] [--gk 4:5,8:5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import benchkit as bk  # noqa: E402
from twinspark.exl3.layer import random_layer  # noqa: E402
from twinspark.ops import exl3_gemm, exl3_gemm_grouped  # noqa: E402
from twinspark.ops.exl3_gemm_grouped import Exl3GroupedLayer, stack_layers  # noqa: E402

K_IN, N_OUT = 4096, 1024
GKS = ((4, 5), (8, 5), (4, 4), (8, 4))  # (groups, K): V4.1 at TP 2 / TP 1, then the draft model
MS = (1, 2, 4, 8, 16, 64)
METHODS = ("grouped", "one-by-one", "bf16 bmm")


def _grouped_ring(G, K, dev, gen):
    """Stacked layers with distinct random trellis (shared scales), enough of them to be L2-cold."""
    base = stack_layers([random_layer(K_IN, N_OUT, K, "mul1", generator=gen) for _ in range(G)]).to(dev)
    shape = (G, K_IN // 16, N_OUT // 16, 16 * K)  # random int16 words are valid trellis data
    ring = bk.rotate(lambda: (torch.randint(-32768, 32768, shape, dtype=torch.int16, device=dev),))
    layers = [Exl3GroupedLayer(t, base.suh, base.svh, float(K), "mul1") for (t,) in ring]
    return layers, ring.bytes_per_set


def _time_graph(fn, args, replays=7) -> float:
    """µs per call with the host out of the picture: one CUDA graph holding fn(*a) for every a in args, replayed."""
    fn(*args[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for a in args:
            fn(*a)
    t = bk.time_cuda(g.replay, warmup=2, iters=replays)
    del g
    return t.median_us / len(args)


def _methods(G, m, layers, dev, gen):
    """[(name, fn, args)] for the three ways at one (G, m), and the bf16 weight bytes of one bmm call."""
    x = torch.randn(m, G, K_IN, generator=gen).to(dev, torch.bfloat16)
    outs = [torch.empty(m, N_OUT, dtype=torch.bfloat16, device=dev) for _ in range(G)]
    per_group = [tuple(L.group(g) for g in range(G)) for L in layers]

    def one_by_one(groups):
        for g, layer in enumerate(groups):
            exl3_gemm(x[:, g], layer, out=outs[g])

    xb = x.transpose(0, 1).contiguous()  # [G, m, k]
    dense = bk.rotate(lambda: (torch.randn(G, K_IN, N_OUT, device=dev, dtype=torch.bfloat16),))
    yb = torch.empty(G, m, N_OUT, dtype=torch.bfloat16, device=dev)
    return [
        ("grouped", lambda L: exl3_gemm_grouped(x, L), [(L,) for L in layers]),
        ("one-by-one", one_by_one, [(p,) for p in per_group]),
        ("bf16 bmm", lambda w: torch.bmm(xb, w, out=yb), list(dense)),
    ], dense.bytes_per_set


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m in {1, 16}, G=4 K=5 only")
    ap.add_argument("--ms", type=lambda s: tuple(int(v) for v in s.split(",")), help="m values (default: all)")
    ap.add_argument("--gk", type=lambda s: tuple(tuple(int(v) for v in p.split(":")) for p in s.split(",")),
                    help="groups:K pairs, e.g. 4:5,8:5 (default: 4:5,8:5,4:4,8:4)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_exl3_gemm_grouped: no CUDA GPU visible; run it on a GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1234)
    copy = bk.copy_ceiling_gbps(dev)
    ms = a.ms or ((1, 16) if a.quick else MS)
    gks = a.gk or (((4, 5),) if a.quick else GKS)
    print(f"copy ceiling {copy:.0f} GB/s on {torch.cuda.get_device_name()}; wo_a {K_IN}->{N_OUT}, mul1, bf16; "
          "each cell eager / graph µs", flush=True)
    print(f"{'G':>2} {'K':>2} {'m':>3} | {'grouped':>13} {'GB/s':>5} | {'one-by-one':>13} | {'bf16 bmm':>13} | "
          f"{'grp/obo':>7} {'grp/bmm':>7} (graph)", flush=True)
    records: list[bk.Record] = []
    for G, K in gks:
        layers, tbytes = _grouped_ring(G, K, dev, gen)
        for m in ms:
            methods, dense_bytes = _methods(G, m, layers, dev, gen)
            res = {}
            for name, fn, args in methods:
                t = bk.time_cuda(fn, args=args, warmup=5, iters=30)
                res[name] = (t, _time_graph(fn, args))
            bmm_us = res["bf16 bmm"][0].median_us
            for name, (t, tg) in res.items():
                wbytes = dense_bytes if name == "bf16 bmm" else tbytes
                records.append(bk.Record(
                    op="exl3_gemm_grouped", shape={"G": G, "k": K_IN, "n": N_OUT, "K": K, "m": m}, timing=t,
                    bytes=wbytes, flops=2 * m * K_IN * N_OUT * G, dense_us=None if name == "bf16 bmm" else bmm_us,
                    variant=name, notes=f"graph_us={tg:.2f} weight_bytes={wbytes}"))
            cell = {n: f"{t.median_us:6.1f}/{tg:6.1f}" for n, (t, tg) in res.items()}
            gg, go, gb = res["grouped"][1], res["one-by-one"][1], res["bf16 bmm"][1]
            print(f"{G:>2} {K:>2} {m:>3} | {cell['grouped']:>13} {bk.gbps(tbytes, gg):5.0f} | "
                  f"{cell['one-by-one']:>13} | {cell['bf16 bmm']:>13} | {gg / go:7.2f} {gg / gb:7.2f}", flush=True)
            del methods
        del layers
        torch.cuda.empty_cache()
        bk.write_results("exl3_gemm_grouped", records, ceilings={"copy_gbps": copy})  # partial results survive
    path = bk.write_results("exl3_gemm_grouped", records, ceilings={"copy_gbps": copy})
    png = plot(records, path.with_name("exl3_gemm_grouped.png"))
    print(f"wrote {path} and {png}")
    return 0


def plot(records, png: Path) -> Path:
    """Graph-replay µs vs m, one panel per (G, K), a line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gks = sorted({(r.shape["G"], r.shape["K"]) for r in records}, key=lambda gk: (-gk[1], gk[0]))
    fig, axes = plt.subplots(1, len(gks), figsize=(4.2 * len(gks), 4), squeeze=False)
    for ax, (G, K) in zip(axes[0], gks):
        for name, style in zip(METHODS, ("o-", "s--", "k-")):
            pts = sorted((r.shape["m"], float(r.notes.split("graph_us=")[1].split()[0])) for r in records
                         if (r.shape["G"], r.shape["K"]) == (G, K) and r.variant == name)
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"wo_a G={G} K={K} ({K_IN}->{N_OUT})")
        ax.set_xlabel("m (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per call, graph replay (L2-cold)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return bk.save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
