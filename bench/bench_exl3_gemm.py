"""EXL3 GEMM benchmark (`nox -s bench -- exl3`): the 15 anchor (shape, K) pairs, mul1, bf16 activations,
m in {1, 4, 16, 64, 256, 1024}; CUDA events, warm-up, median, L2-cold weights (twinspark.benchkit rotates trellis
copies over >= 256 MB). Prints µs, trellis GB/s, fraction of the copy ceiling measured in this run, bf16 dense
(torch.mm) time measured in this run, ratios to the upstream anchors, the target summary and the GB10 prediction.
Writes exl3_gemm.json (benchkit) and exl3_gemm.png (time vs m per shape with bf16 and upstream lines).

    python bench/bench_exl3_gemm.py [--quick]     # --quick: m in {1, 16, 256}, K=2 only (a smoke run)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import benchkit as bk  # noqa: E402
from twinspark.exl3.layer import Exl3Layer, random_layer  # noqa: E402
from twinspark.ops import exl3_gemm, plans  # noqa: E402
from twinspark.ops.exl3_gemm import M_SLICE, fused_available, plan  # noqa: E402

SHAPES = ((1152, 5120), (5120, 1152), (4096, 5120), (5120, 4096), (5120, 12288))
KS = (2, 3, 4)
MS = (1, 4, 16, 64, 256, 1024)
CROSSOVER_MS = (32, 128)  # every variant timed here to place large_m (and fused vs large at m >= 256)
LARGE_M = plans.current().exl3_gemm.large_m  # the table's (with $TWINSPARK_PLAN applied)

# ---------------------------------------------------------------------------------------------------- timing
def _layers(k, n, K, dev, gen, codebook="mul1"):
    """Copies of one random layer (distinct trellis, shared scales) rotated L2-cold. mul1 is the anchors' codebook;
    --codebook times another (their decoders differ in cost)."""
    base = random_layer(k, n, K, codebook, generator=gen, device=dev)
    shape = (k // 16, n // 16, 16 * K)  # random int16 words are valid trellis data (made on the GPU: fast)
    ring = bk.rotate(lambda: (torch.randint(-32768, 32768, shape, dtype=torch.int16, device=dev),))
    return [Exl3Layer(t, base.suh, base.svh, float(K), codebook) for (t,) in ring], ring.bytes_per_set


def _plan(**values):
    """exl3_gemm's plan keys (None: leave as is) for the duration (twinspark.ops.plans.override)."""
    return plans.override(",".join(f"exl3_gemm.{k}={v}" for k, v in values.items() if v is not None))


def _time(layers, x, out, variant=None, iters=30, prep=None, bps=None):
    with _plan(variant=variant, prep=prep, blocks_per_sm=bps):
        return bk.time_cuda(lambda L: exl3_gemm(x, L, out=out), args=[(L,) for L in layers], warmup=5,
                            iters=iters)


def _time_graph(layers, x, out, variant=None, replays=7, prep=None, bps=None) -> float:
    """µs per call with the host out of the picture: one CUDA graph holding a call per ring entry (L2-cold),
    replayed; median replay time / calls."""
    with _plan(variant=variant, prep=prep, blocks_per_sm=bps):
        exl3_gemm(x, layers[0], out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for L in layers:
                exl3_gemm(x, L, out=out)
        t = bk.time_cuda(g.replay, warmup=2, iters=replays)
        del g
        return t.median_us / len(layers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="m in {1, 16, 256} and K=2 only")
    ap.add_argument("--ms", type=lambda s: tuple(int(v) for v in s.split(",")), help="m values (default: all)")
    ap.add_argument("--ks", type=lambda s: tuple(int(v) for v in s.split(",")), help="K values (default: 2,3,4)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the split-k / prep sweeps")
    ap.add_argument("--codebook", choices=("3inst", "mcg", "mul1"), default="mul1",
                    help="codebook of the timed layers (default mul1, as the upstream anchors)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_exl3_gemm: no CUDA GPU visible; run it on a GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1234)
    copy = bk.copy_ceiling_gbps(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    anchors = bk.load_anchors()
    ms = a.ms or ((1, 16, 256) if a.quick else MS)
    ks = a.ks or ((2,) if a.quick else KS)
    fused = fused_available(dev)
    large_variants = ["fused", "large"] if fused else ["large"]
    print(f"copy ceiling {copy:.0f} GB/s on {torch.cuda.get_device_name()} ({sms} SMs)", flush=True)
    print(f"plan: {plans.changes() or 'the defaults'} (twinspark.ops.plans, $TWINSPARK_PLAN)", flush=True)
    dense: dict[tuple[int, int, int], float] = {}
    records: list[bk.Record] = []
    hdr = (f"{'k':>5} {'n':>6} {'K':>2} {'m':>5} {'var':>5} {'us':>8} {'GB/s':>7} {'%copy':>6} {'upstr':>7} "
           f"{'x up':>6} {'dense':>7} {'x dense':>7} {'graph':>7} {'gb10':>7}")
    print(hdr, flush=True)
    for k, n in SHAPES:
        for K in ks:
            layers, tbytes = _layers(k, n, K, dev, gen, a.codebook)
            for m in sorted(set(ms) | (set(CROSSOVER_MS) if not (a.quick or a.ms) else set())):
                x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                chosen_plan = plan(m, k, n, K, sms, fused=fused)
                chosen = chosen_plan.variant
                variants = [chosen] if m not in CROSSOVER_MS else ["small"] + large_variants
                if m >= 256 and fused:  # both prefill variants, to place fused_max_m
                    variants = [chosen] + [v for v in large_variants if v != chosen]
                if (k, n, m) not in dense and m in ms:
                    dense[(k, n, m)] = bk.bf16_dense_us(m, k, n, device=dev)
                for var in variants:
                    t = _time(layers, x, out, var)
                    tg = _time_graph(layers, x, out, var)
                    nbytes = tbytes + x.nbytes + out.nbytes + (k + n) * 2
                    an = anchors.gemm(k=k, n=n, K=K, m=m)
                    d = dense.get((k, n, m))
                    main_rec = var == chosen and m in ms
                    g = bk.predict_gb10_us(nbytes, t.median_us, copy)
                    if m > LARGE_M:  # GB10's large path, from its weight's bytes (against small slices: gb10_prefill)
                        g["bounded_us"] = bk.predict_gb10_large_us(k, n, m, tbytes, x.nbytes, out.nbytes)["us"]
                    rec = bk.Record(op="exl3_gemm", shape={"k": k, "n": n, "K": K, "m": m}, timing=t, bytes=nbytes,
                                    flops=2 * m * k * n, anchor_us=an.upstream_us if an else None, dense_us=d,
                                    variant=var if main_rec else f"{var} (crossover)",
                                    notes=f"graph_us={tg:.2f} gb10_bounded_us={g['bounded_us']:.1f} "
                                          f"gb10_naive_us={g['naive_us']:.1f}"
                                          + (f" block={chosen_plan.block} splits={chosen_plan.splits}"
                                             if var == chosen == "fused" else ""))
                    records.append(rec)
                    gbs = rec.gbps or 0.0
                    print(f"{k:>5} {n:>6} {K:>2} {m:>5} {var:>5} {t.median_us:8.1f} {gbs:7.0f} {100 * gbs / copy:6.1f} "
                          f"{(an.upstream_us if an else float('nan')):7.1f} "
                          f"{(t.median_us / an.upstream_us if an else float('nan')):6.2f} "
                          f"{(d or float('nan')):7.1f} {(t.median_us / d if d else float('nan')):7.2f} "
                          f"{tg:7.1f} {g['bounded_us']:7.1f}" + ("" if main_rec else "  (crossover)"), flush=True)
            del layers
            torch.cuda.empty_cache()
        bk.write_results("exl3_gemm", records, ceilings={"copy_gbps": copy})  # partial results survive a timeout
    main_records = [r for r in records if "(" not in r.variant]
    summary = summarize(main_records)
    graph_records = []
    for r in main_records:
        gus = float(r.notes.split("graph_us=")[1].split()[0])
        graph_records.append(bk.Record(op=r.op, shape=r.shape, median_us=gus, anchor_us=r.anchor_us, dense_us=r.dense_us))
    summary += ["", "Same targets with the kernel's time from CUDA-graph replay (host launch cost removed; the "
                "upstream and dense numbers stay eager):"] + summarize(graph_records)
    print("\n" + "\n".join(summary), flush=True)
    print("\n".join(gb10_prefill(main_records)), flush=True)
    if not (a.quick or a.no_sweep):
        records += sweep_split(dev, gen, copy, a.codebook)
    path = bk.write_results("exl3_gemm", records, ceilings={"copy_gbps": copy})
    png = plot(main_records, path.with_name("exl3_gemm.png"))
    print(f"wrote {path} and {png}")
    return 0


def gb10_prefill(records) -> list[str]:
    """GB10 prefill on paper: the large path the table runs there (benchkit.predict_gb10_large_us) against the small
    kernel in slices of M_SLICE tokens (each slice predicted like the m = M_SLICE row: bounded estimate)."""
    notes = {(r.shape["k"], r.shape["n"], r.shape["K"], r.shape["m"]): r.notes for r in records}
    lines = ["", f"GB10 prefill (predicted, us): large path vs the small kernel in slices of {M_SLICE} tokens"]
    for (k, n, K, m), note in sorted(notes.items()):
        small = notes.get((k, n, K, M_SLICE))
        if m <= LARGE_M or small is None:
            continue
        large_us = float(note.split("gb10_bounded_us=")[1].split()[0])
        slice_us = float(small.split("gb10_bounded_us=")[1].split()[0])
        sliced = math.ceil(m / M_SLICE) * slice_us
        lines.append(f"  {k}x{n} K={K} m={m}: large {large_us:.0f}, small x{math.ceil(m / M_SLICE)} {sliced:.0f}"
                     f" ({'small' if sliced < large_us else 'large'} predicted faster)")
    return lines


def sweep_split(dev, gen, copy, codebook="mul1") -> list[bk.Record]:
    """K=2: time vs the split-k target (blocks per SM) at m=1 and 64 — the table's blocks_per_sm comes from
    this — and with x' made per strip vs by the prep kernel at m=16, 32, 64 (prep_groups)."""
    recs = []
    print("\nsplit-k sweep, K=2 (blocks per SM target: eager us / graph us)", flush=True)
    for k, n in SHAPES:
        layers, tbytes = _layers(k, n, 2, dev, gen, codebook)
        for m in (1, 64):
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            row = []
            for bps in (1, 2, 3, 6):
                t = _time(layers, x, out, "small", iters=20, bps=bps)
                tg = _time_graph(layers, x, out, "small", replays=5, bps=bps)
                row.append(f"{bps}:{t.median_us:.1f}/{tg:.1f}")
                recs.append(bk.Record(op="exl3_gemm", shape={"k": k, "n": n, "K": 2, "m": m}, timing=t,
                                      bytes=tbytes, variant=f"small bps={bps} (sweep)"))
            print(f"{k}x{n} m={m}: " + "  ".join(row), flush=True)
        for m in (16, 32, 64):  # x' per strip (prep 0) vs once by the prep kernel (prep 1): prep_groups
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            row = []
            for prep in ("0", "1"):
                t = _time(layers, x, out, "small", iters=20, prep=prep)
                tg = _time_graph(layers, x, out, "small", replays=5, prep=prep)
                row.append(f"prep={prep}:{t.median_us:.1f}/{tg:.1f}")
                recs.append(bk.Record(op="exl3_gemm", shape={"k": k, "n": n, "K": 2, "m": m}, timing=t,
                                      bytes=tbytes, variant=f"small prep={prep} (sweep)"))
            print(f"{k}x{n} m={m}: " + "  ".join(row), flush=True)
        del layers
    return recs


def _geomean(v):
    v = [x for x in v if x and x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def summarize(records) -> list[str]:
    """The issue's targets, each with the measured value."""
    by = {(r.shape["k"], r.shape["n"], r.shape["K"], r.shape["m"]): r for r in records}
    out = []
    for m, target in ((1, 0.6), (4, None), (16, 0.8), (64, 0.8)):
        ratios = [r.median_us / r.anchor_us for (k, n, K, mm), r in by.items() if mm == m and r.anchor_us]
        if ratios:
            g = _geomean(ratios)
            verdict = "" if target is None else (" MET" if g <= target else f" MISSED by {g / target:.2f}x")
            out.append(f"m={m}: geomean time / upstream over {len(ratios)} pairs = {g:.2f}"
                       + (f" (target <= {target}){verdict}" if target else ""))
    for k, n in ((5120, 4096), (5120, 12288)):
        for K in (2, 3):
            r = by.get((k, n, K, 1))
            if r and r.dense_us:
                ok = "MET" if r.median_us <= r.dense_us else f"MISSED by {r.median_us / r.dense_us:.2f}x"
                out.append(f"{k}x{n} K={K} m=1: {r.median_us:.1f} us vs bf16 dense {r.dense_us:.1f} us {ok}")
    big = [r.median_us / r.dense_us for (k, n, K, m), r in by.items() if m >= 256 and r.dense_us]
    if big:
        worst = max(big)
        out.append(f"m>=256: worst time / bf16 dense = {worst:.2f}, geomean {_geomean(big):.2f} (target <= 1.25) "
                   + ("MET" if worst <= 1.25 else f"MISSED by {worst / 1.25:.2f}x"))
    return out


def plot(records, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(4.2 * len(SHAPES), 4), sharey=False)
    for ax, (k, n) in zip(axes, SHAPES):
        rs = [r for r in records if r.shape["k"] == k and r.shape["n"] == n]
        for K, color in zip(KS, ("tab:blue", "tab:green", "tab:purple")):
            pts = sorted((r.shape["m"], r.median_us) for r in rs if r.shape["K"] == K)
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, label=f"twinspark K={K}")
            up = sorted((r.shape["m"], r.anchor_us) for r in rs if r.shape["K"] == K and r.anchor_us)
            if up:
                ax.plot(*zip(*up), "x--", color=color, alpha=0.6, label=f"upstream K={K}")
        dn = sorted({(r.shape["m"], r.dense_us) for r in rs if r.dense_us})
        if dn:
            ax.plot(*zip(*dn), "k-", lw=1.5, label="bf16 dense")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{k}x{n}")
        ax.set_xlabel("m (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("µs per call (H200, L2-cold)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    return bk.save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
