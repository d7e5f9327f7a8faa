"""EXL3 MoE layer benchmark (`nox -s bench -- exl3_moe`): DeepSeek V4.1 Flash's routed experts at tensor parallel 2
(384 experts, hidden 5120, intermediate 1152 per rank, top-6), mul1, K in {2, 3, 4}, bf16 activations,
T in {1, 2, 4, 8, 32, 512, 2048}.

Random routing with fresh expert sets per call (a ring of routings; consecutive calls touch different experts, so
weights come from DRAM: the layer's experts are 1.3-3.4 GB, far past the 60 MB L2). CUDA events, warm-up, median
(twinspark.benchkit). Per case: µs per layer, GB/s of expert bytes touched (trellis + scales of the distinct
experts a call routes to, averaged over the ring), the upstream H200 anchor, and the baseline "reconstruct the
touched experts (twinspark exl3_reconstruct) + torch matmuls" timed in the same run (its routing bookkeeping is
done on the host outside the timed region: that favours the baseline). Then the targets and a GB10 prediction.
gate/up is launched as in a CUDA graph (programmatic dependent launch) unless $TWINSPARK_PLAN sets exl3_moe.pdl.
Each line shows the two kernels' blocks per SM (gate/up / down). At T=1 the prediction is also made from the time
with the kernels sized and held as GB10's 100 KB of shared memory per SM would hold them (time_at_gb10_residency;
TWINSPARK_PLAN=exl3_moe.smem_per_sm=102400 runs the whole benchmark that way).
Writes exl3_moe.json (benchkit) and exl3_moe.png (µs per layer vs T for each K, with the upstream anchors, the
baseline and the targets).

    python bench/bench_exl3_moe.py [--quick] [--no-baseline] [--graph]
    python bench/bench_exl3_moe.py --plot-only bench/results/exl3_moe.json   # redraw the PNG (no GPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import benchkit as bk  # noqa: E402
from twinspark import moe_layout as ml  # noqa: E402
from twinspark.exl3.reference import hadamard_128  # noqa: E402
from twinspark.ops import exl3_moe, exl3_reconstruct, plans  # noqa: E402
from twinspark.ops.exl3_moe import kernel_residency, launch_plan  # noqa: E402

E, H, INTER, TOP_K = 384, 5120, 1152, 6
KS = (2, 3, 4)
TS = (1, 2, 4, 8, 32, 512, 2048)
RING = 32  # routings per case

GB10_PUBLISHED_GBPS = 208.0  # the best published hand-tuned EXL3 MoE kernel on GB10 (issue 4)


def make_experts(K: float, dev) -> ml.Exl3MoeExperts:
    """Random experts built on the GPU (the CPU would take minutes for 1-3 GB of trellis)."""
    ex = ml.empty([[K, K, K]] * E, H, INTER, "mul1", device=dev)
    ex.trellis.random_(-32768, 32768)
    for t, k in ((ex.suh13, H), (ex.svh13, 0), (ex.suh2, INTER), (ex.svh2, 0)):
        sign = torch.randint(0, 2, t.shape, device=dev).float() * 2 - 1
        t.copy_(sign * (0.75 + 0.5 * torch.rand(t.shape, device=dev)) / (k**0.5 if k else 1.0))
    return ex


def routing(T: int, dev, gen: torch.Generator):
    """Uniform random top-k routing: distinct experts per token, softmax-like positive weights."""
    ids = torch.rand(T, E, generator=gen, device=dev).topk(TOP_K, dim=1).indices.to(torch.int32)
    w = torch.rand(T, TOP_K, generator=gen, device=dev) + 0.1
    return ids, (w / w.sum(1, keepdim=True)).float()


def expert_bytes(ex: ml.Exl3MoeExperts) -> int:
    """Bytes one expert's weights occupy: three trellises and their scales (all experts share K here)."""
    trellis = sum(ex.matrix_bytes(0, p) for p in range(3))
    return trellis + 2 * (2 * H + 2 * INTER + INTER + H)


# ------------------------------------------------------------------------------------------------- baseline
class Baseline:
    """Reconstruct each touched expert's W_hat (exl3_reconstruct, bf16) and run the layer with torch ops: the
    Hadamard transforms and scales on the activations, one torch.mm per expert and matrix. Host-side routing
    bookkeeping (sort, counts) is prepared per routing outside the timing."""

    def __init__(self, ex: ml.Exl3MoeExperts):
        self.ex = ex
        self.h128 = hadamard_128(ex.device, torch.float32)
        self.K = ex.rates()[0][0]
        # Trellis views per expert, made once: ex.layer() reads offsets on the device (a sync inside the timing).
        offs, words = ex.offsets.cpu().tolist(), ex.words.cpu().tolist()
        self.trellis = [[ml.layer_from_tensors(ex.trellis, ex.offsets, ex.words, ex.suh13, ex.svh13, ex.suh2, ex.svh2,
                                               e, p, ex.hidden, ex.inter, ex.codebook, off=offs[e][p],
                                               w=words[e][p]).trellis for p in range(3)] for e in range(ex.num_experts)]

    def prepare(self, ids: torch.Tensor):
        flat = ids.flatten().long()
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        return order, order // TOP_K, flat[order], list(zip(experts.tolist(), counts.tolist()))

    def _had(self, a: torch.Tensor) -> torch.Tensor:
        return (a.reshape(a.shape[0], -1, 128) @ self.h128).reshape(a.shape)

    def __call__(self, x, w, prep):
        order, tok, eid, groups = prep
        ex = self.ex
        xs = x[tok].float()
        ag = self._had(xs * ex.suh13[eid, 0].float()).half()
        au = self._had(xs * ex.suh13[eid, 1].float()).half()
        g = torch.empty(len(tok), INTER, dtype=torch.float16, device=x.device)
        u = torch.empty_like(g)
        row = 0
        whats = []
        for e, c in groups:
            wg = exl3_reconstruct(self.trellis[e][0], self.K, "mul1", torch.float16)
            wu = exl3_reconstruct(self.trellis[e][1], self.K, "mul1", torch.float16)
            torch.mm(ag[row: row + c], wg, out=g[row: row + c])
            torch.mm(au[row: row + c], wu, out=u[row: row + c])
            whats.append(exl3_reconstruct(self.trellis[e][2], self.K, "mul1", torch.float16))
            row += c
        gf = self._had(g.float()) * ex.svh13[eid, 0].float()  # hadamard_128 is orthonormal
        uf = self._had(u.float()) * ex.svh13[eid, 1].float()
        hd = self._had(torch.nn.functional.silu(gf) * uf * ex.suh2[eid].float()).half()
        y = torch.empty(len(tok), H, dtype=torch.float16, device=x.device)
        row = 0
        for (_, c), wd in zip(groups, whats):
            torch.mm(hd[row: row + c], wd, out=y[row: row + c])
            row += c
        yf = self._had(y.float()) * ex.svh2[eid].float() * w.flatten()[order].unsqueeze(1)
        out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, yf)
        return out.to(x.dtype)


def time_graph(ex, ring, replays: int = 7) -> float:
    """µs per layer with the host out of the picture, as vLLM's decode runs it: one CUDA graph holding a call per
    ring entry (fresh expert sets: L2-cold), replayed; the median replay / calls. Captured calls launch gate/up with
    programmatic dependent launch unless the plan says exl3_moe.pdl=0 (ops/exl3_moe.py gate_up_pdl)."""
    exl3_moe(*ring[0], ex)  # the per-stream counters are made outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x, ids, w in ring:
            exl3_moe(x, ids, w, ex)
    t = bk.time_cuda(g.replay, warmup=2, iters=replays)
    del g
    return t.median_us / len(ring)


def time_at_gb10_residency(ex, ring, iters: int) -> tuple[float, str]:
    """µs per layer here with the kernels' shared memory sized and held as on GB10 (benchkit.GB10_SMEM_PER_SM per SM;
    the plan's exl3_moe.smem_per_sm), and their blocks per SM: the time the GB10 prediction should scale, since there
    shared memory, not registers, can decide how many blocks share an SM."""
    with plans.override(f"exl3_moe.smem_per_sm={bk.GB10_SMEM_PER_SM}"):
        t = bk.time_cuda(lambda x, ids, w: exl3_moe(x, ids, w, ex), args=ring, warmup=3, iters=iters)
        res = "/".join(map(str, kernel_residency(*ring[0], ex)))
    return t.median_us, res


def sweep(dev, gen) -> None:
    """Decode time at each gate/up split-k (the plan's exl3_moe.split_k), K=3: what plan_launch should pick."""
    ex = make_experts(3.0, dev)
    print("\nsplit-k sweep (K=3, us per layer):")
    for T in (1, 2, 4, 8):
        ring = []
        for _ in range(RING):
            ids, w = routing(T, dev, gen)
            ring.append((torch.randn(T, H, device=dev, generator=gen).bfloat16(), ids, w))
        row = []
        for s in (1, 2, 3, 4, 5, 8, 10, 20):
            with plans.override(f"exl3_moe.split_k={s}"):
                t = bk.time_cuda(lambda x, ids, w, ex=ex: exl3_moe(x, ids, w, ex), args=ring, warmup=3, iters=5)
            row.append(f"s={s}: {t.median_us:6.1f}")
        print(f"  T={T}: " + "  ".join(row), flush=True)
    del ex
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="K=3 and T in {1, 4, 512} only (a smoke run)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the reconstruct + torch matmul baseline")
    ap.add_argument("--iters", type=int, default=7, help="timed samples per case (median reported)")
    ap.add_argument("--graph", action="store_true",
                    help="also time decode (T <= 8) as CUDA-graph replays, as vLLM runs it (time_graph)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time K=3, T in {1, 2, 4, 8} at every gate/up split-k (to tune plan_launch)")
    ap.add_argument("--ts", type=lambda s: tuple(int(v) for v in s.split(",")), help="T values (default: all)")
    ap.add_argument("--ks", type=lambda s: tuple(int(v) for v in s.split(",")), help="K values (default: 2,3,4)")
    ap.add_argument("--plot-only", metavar="JSON", type=Path,
                    help="only draw the PNG (beside JSON) from a results file this benchmark wrote; no GPU needed")
    args = ap.parse_args(argv)
    if args.plot_only:
        try:
            png = plot(bk.load_results(args.plot_only)["records"], args.plot_only.with_suffix(".png"))
        except bk.BenchError as e:
            print(f"bench_exl3_moe: {e}", file=sys.stderr)
            return 2
        print(f"wrote {png}")
        return 0
    # gate/up launches with programmatic dependent launch where vLLM runs decode, inside CUDA graphs (eager calls
    # launch it plainly: ops/exl3_moe.py). This benchmark launches eagerly but queues each sample's calls ahead of the
    # GPU (benchkit.time_cuda), so it times the graph configuration unless $TWINSPARK_PLAN sets exl3_moe.pdl.
    if plans.current().exl3_moe.pdl is None:
        plans.use("exl3_moe.pdl=1")
    print(f"gate/up programmatic dependent launch: exl3_moe.pdl={plans.text(plans.current().exl3_moe.pdl)}")
    print(f"plan: {plans.changes()} (twinspark.ops.plans; exl3_moe.smem_per_sm / fit_smem: shared memory sized as on "
          "such a device, ops/exl3_moe.py plan_launch)")
    dev = torch.device("cuda")
    copy = bk.copy_ceiling_gbps(dev)
    anchors = bk.load_anchors()
    gen = torch.Generator(device=dev).manual_seed(1234)
    records, summary = [], []
    ks, ts = ((3,), (1, 4, 512)) if args.quick else (KS, TS)
    ks, ts = args.ks or ks, args.ts or ts
    for K in ks:
        ex = make_experts(float(K), dev)
        per_expert = expert_bytes(ex)
        base = None if args.no_baseline else Baseline(ex)
        for T in ts:
            ring = []
            for _ in range(RING):
                ids, w = routing(T, dev, gen)
                x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
                ring.append((x, ids, w))
            touched = [torch.unique(ids).numel() for _, ids, _ in ring]
            nbytes = sum(touched) / len(touched) * per_expert + sum(a.nbytes for a in ring[0]) + T * H * 2
            t = bk.time_cuda(lambda x, ids, w, ex=ex: exl3_moe(x, ids, w, ex), args=ring, warmup=3, iters=args.iters)
            cfg = launch_plan(ring[0][0], ring[0][1], ex)  # as the op plans it (gate/up blocks per SM included)
            a = anchors.moe(K=K, T=T)
            rec = bk.Record(op="exl3_moe", shape={"E": E, "H": H, "I": INTER, "top_k": TOP_K, "K": K, "T": T}, timing=t,
                            bytes=int(nbytes), anchor_us=a.us if a else None,
                            notes=f"distinct experts {sum(touched) / len(touched):.1f}; mt={cfg['mt']} "
                                  f"splitk={cfg['splitk']} short_groups={cfg['short_groups']}")
            records.append(rec)
            res = "/".join(map(str, kernel_residency(*ring[0], ex)))
            rec.notes += f"; blocks_per_sm={res}"
            line = (f"K={K} T={T:5d}: {t.median_us:9.1f} us  {rec.gbps:7.0f} GB/s ({rec.gbps / copy:5.1%} of copy)  "
                    f"experts {sum(touched) / len(touched):6.1f}  blocks/SM {res}")
            if a:
                line += f"  upstream {a.us:8.1f} us (x{a.us / t.median_us:.2f})"
            if args.graph and T <= 8:
                tg = time_graph(ex, ring)
                rec.notes += f"; graph_us={tg:.1f}"
                line += f"  graph {tg:7.1f} us"
            if base is not None:
                preps = [base.prepare(ids) for _, ids, _ in ring]
                bring = [(x, w, p) for (x, _, w), p in zip(ring, preps)]
                n_base = min(len(bring), 4 if T >= 512 else 16)
                tb = bk.time_cuda(base, args=bring[:n_base], warmup=2, iters=max(3, args.iters // 2),
                                  calls_per_sample=1)
                records.append(bk.Record(op="exl3_moe", shape=dict(rec.shape), timing=tb, bytes=int(nbytes),
                                         variant="reconstruct+torch.mm"))
                line += f"  baseline {tb.median_us:9.1f} us (x{tb.median_us / t.median_us:.2f})"
            pred = bk.predict_gb10_us(nbytes, t.median_us, copy, launches=2)  # gate/up and down
            rec.notes += f"; gb10_bounded_us={pred['bounded_us']:.1f} gb10_naive_us={pred['naive_us']:.1f}"
            if T == 1:
                line += (f"\n    GB10 T=1 (benchkit.predict_gb10_us): bounded {pred['bounded_us']:.1f} us = "
                         f"{bk.gbps(nbytes, pred['bounded_us']):.0f} GB/s (bandwidth floor {pred['bw_floor_us']:.1f}, "
                         f"decode {pred['decode_us']:.1f}); naive {pred['naive_us']:.1f} us = "
                         f"{bk.gbps(nbytes, pred['naive_us']):.0f} GB/s; published {GB10_PUBLISHED_GBPS:.0f} GB/s")
                if not plans.current().exl3_moe.smem_per_sm:
                    t10, res10 = time_at_gb10_residency(ex, ring, args.iters)
                    p10 = bk.predict_gb10_us(nbytes, t10, copy, launches=2)
                    rec.notes += f"; gb10_residency_us={t10:.1f} gb10_residency_bounded_us={p10['bounded_us']:.1f}"
                    line += (f"\n    the same at GB10's residency (shared memory sized as there, blocks/SM {res10}): "
                             f"{t10:.1f} us here -> bounded {p10['bounded_us']:.1f} us = "
                             f"{bk.gbps(nbytes, p10['bounded_us']):.0f} GB/s (decode {p10['decode_us']:.1f})")
            print(line, flush=True)
            summary.append((K, T, t.median_us, pred))
        del ex, base
        torch.cuda.empty_cache()
    print("\nTargets (H200): T=1 <= 30 us, T=4 <= 60 us, T=2048 >= 1.5x faster than the baseline")
    for K, T, us, _ in summary:
        if T in (1, 4):
            print(f"  K={K} T={T}: {us:.1f} us -> {'met' if us <= (30 if T == 1 else 60) else 'NOT met'}")
    for r in records:
        if r.variant != "twinspark" and r.shape["T"] == 2048:
            mine = next(q for q in records if q.variant == "twinspark" and q.shape == r.shape)
            ratio = r.median_us / mine.median_us
            print(f"  K={r.shape['K']} T=2048: x{ratio:.2f} vs baseline -> {'met' if ratio >= 1.5 else 'NOT met'}")
    if args.sweep:
        sweep(dev, gen)
    path = bk.write_results("exl3_moe", records, ceilings={"copy_gbps": copy})
    print(f"wrote {path} and {plot(records, path.with_name('exl3_moe.png'))}")
    return 0


TARGETS_US = {1: 30.0, 4: 60.0}  # issue 4: µs per layer at T=1 and T=4 (H200)


def plot(records, png: Path) -> Path:
    """µs per layer vs T (log-log) for each K: twinspark, the upstream anchors, the reconstruct + torch baseline, and
    the T=1 / T=4 targets. Written to a temp name, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r.op == "exl3_moe"]
    if not recs:
        raise bk.BenchError(f"no exl3_moe records to plot for {png}; run bench/bench_exl3_moe.py on a GPU first")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for K, color in zip(sorted({r.shape["K"] for r in recs}), ("tab:blue", "tab:green", "tab:purple", "tab:orange")):
        mine = sorted((r.shape["T"], r.median_us) for r in recs if r.shape["K"] == K and r.variant == "twinspark")
        if mine:
            ax.plot(*zip(*mine), "o-", color=color, label=f"twinspark K={K}")
        up = sorted((r.shape["T"], r.anchor_us) for r in recs
                    if r.shape["K"] == K and r.variant == "twinspark" and r.anchor_us)
        if up:
            ax.plot(*zip(*up), "x--", color=color, alpha=0.6, label=f"upstream K={K}")
        base = sorted((r.shape["T"], r.median_us) for r in recs if r.shape["K"] == K and r.variant != "twinspark")
        if base:
            ax.plot(*zip(*base), ":", color=color, alpha=0.6, label=f"reconstruct + torch K={K}")
    ax.plot(list(TARGETS_US), list(TARGETS_US.values()), "r*", ms=12, label="targets (T=1, T=4)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("µs per layer (H200, L2-cold)")
    ax.set_title(f"exl3_moe: {E} experts, {H}/{INTER}, top-{TOP_K}, mul1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return bk.save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
