"""Prefill on a GB10-sized GPU (`nox -s bench -- prefill`): DeepSeek V4.1 Flash's EXL3 work per rank at tensor
parallel 2, timed on a green context of 48 SMs (GB10's count; `--sms`) and on the whole GPU.

- exl3_moe: the routed-expert layer (384 experts, hidden 5120, intermediate 1152 per rank, top-6, mul1) at K = 2, 3
  and T = 512, 2048, 8192 tokens; random routing, fresh inputs per call. Variants side by side (same build, same
  run): "before" (the 64-row kernels build A in every block, as before issue 43), "after" (the plan's defaults),
  "rows4" (64-row items from 4 rows per expert on). Beside them a bound: the decode path's rate (the layer at T = 32,
  scaled to every expert), which any prefill call that decodes each weight once at that rate cannot beat.
- exl3_gemm at the attention and shared-expert shapes (shared/docs/deepseek-v41.md: wq_a, wkv, wq_b, wo_a per group,
  wo_b, shared w1/w3 and w2 at their per-rank sizes, K from twinspark.v41_layout) for m = 512 ... 8192 against
  torch.mm in bf16 on the same SMs; variants side by side (`--gemm-variants`): the plan's own choice, the `large` path,
  the fused mma.sync kernel at 64 / 128 / 256 tokens per block (`mma64` ...: GB10's prefill kernel, no wgmma there),
  the 64-token `small` slices, the wgmma `fused` kernel. After them the GB10 model's estimate of each case
  (twinspark.gb10: the compute-bound kernels from their proxy times, the large path from its bytes) and the table's
  GB10 choice; `--from-json PATH` prints the summary and those estimates from a results file, no GPU needed.
- layer: one V4.1 layer's twinspark work per rank at T = 2048 and 8192 on the proxy, averaged over the 40 layers
  (every EXL3 matrix of bench_decode_step.plan_step at m = T, plus the routed experts), as µs per layer and tokens
  per second of these kernels alone (no attention core, no all-reduce).

Plans are made for the proxy's SM count (twinspark.ops.sms.limit: the device still reports all of them) and every
call runs on the green context's stream. CUDA events, warm-up, median (benchkit.time_cuda on that stream); the
expert weights (1.3-2.5 GB) are read from DRAM on every call, the GEMM weights rotate L2-cold. Writes prefill.json.

    python bench/bench_prefill.py [--sms 48] [--no-full] [--only moe|gemm|layer] [--ks 2,3] [--ts ...] [--ms ...]
                                  [--gemm-variants plan,large,mma128,mma256] [--from-json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))
import benchkit as bk  # noqa: E402
from bench_decode_step import plan_step  # noqa: E402
from bench_exl3_gemm import _layers  # noqa: E402
from bench_exl3_moe import make_experts, routing  # noqa: E402
from twinspark.ops import exl3_gemm, exl3_moe, plans, sms  # noqa: E402
from twinspark.ops.exl3_gemm import plan as exl3_gemm_plan  # noqa: E402
from twinspark.ops.exl3_moe import launch_plan  # noqa: E402
from twinspark.v41_layout import V41Spec  # noqa: E402

TP = 2
SPEC = V41Spec.real()
E, H, INTER, TOP_K = SPEC.experts, SPEC.hidden, SPEC.moe_inter // TP, SPEC.top_k
MOE_TS = (512, 2048, 8192)
MOE_KS = (2, 3)
GEMM_MS = (512, 1024, 2048, 4096, 8192)
LAYER_TS = (2048, 8192)


def gemm_shapes(spec: V41Spec = SPEC) -> list[tuple[str, int, int, float]]:
    """(name, k, n, K) of the attention and shared-expert EXL3 matrices one rank multiplies at TP 2."""
    h, Ka, Ks = spec.hidden, spec.k_attn, spec.k_shared(0)
    return [("wq_a", h, spec.q_lora, Ka), ("wkv", h, spec.head_dim, Ka),
            ("wq_b", spec.q_lora, spec.heads * spec.head_dim // TP, Ka), ("wo_a", spec.group_in, spec.o_lora, Ka),
            ("wo_b", spec.o_groups * spec.o_lora // TP, h, Ka), ("shared w1/w3", h, spec.shared_inter // TP, Ks),
            ("shared w2", spec.shared_inter // TP, h, Ks)]


@contextlib.contextmanager
def on(stream, n_sms):
    """Calls inside run on ``stream`` with plans made for ``n_sms`` SMs (None: the device's own count)."""
    with torch.cuda.stream(stream), (sms.limit(n_sms) if n_sms else contextlib.nullcontext()):
        yield


# MoE variants timed side by side in one run, same build: (label, plan override). "before": the 64-row kernels build
# A in every block (as before issue 43); "after": the plan's defaults; "rows4": 64-row items from 4 rows per expert.
MOE_VARIANTS = {"before": "exl3_moe.prefill_prep=0", "after": "", "rows4": "exl3_moe.prefill_rows=4"}


# ------------------------------------------------------------------------------------------------------- moe
def moe_cases(where: str, stream, n_sms, ks, ts, iters: int, dev, gen, variants: list[str]) -> list[bk.Record]:
    out = []
    for K in ks:
        ex = make_experts(float(K), dev)
        for T in ts:
            ring = []
            for _ in range(3):
                ids, w = routing(T, dev, gen)
                ring.append((torch.randn(T, H, device=dev, generator=gen).bfloat16(), ids, w))
            flops = 2 * T * TOP_K * 3 * H * INTER
            line = f"[{where}] exl3_moe K={K} T={T:5d}:"
            first = None
            for label in variants:
                with on(stream, n_sms), plans.override(MOE_VARIANTS[label]):
                    cfg = launch_plan(ring[0][0], ring[0][1], ex)
                    t = bk.time_cuda(lambda x, ids, w, ex=ex: exl3_moe(x, ids, w, ex), args=ring, warmup=2,
                                     iters=iters)
                out.append(bk.Record(op="exl3_moe", shape={"K": K, "T": T, "sms": n_sms or 0}, timing=t, flops=flops,
                                     variant=f"{label} {where}", notes=f"mt={cfg['mt']} prep_a={cfg['prep_a']}"))
                first = first or t.median_us
                line += (f"  {label} {t.median_us:9.1f} us (x{t.median_us / first:.2f}, mt={cfg['mt']}, "
                         f"{flops / t.median_us / 1e6:5.1f} TFLOP/s, {t.median_us / T:6.2f} us/token)")
            print(line, flush=True)
        del ex
        torch.cuda.empty_cache()
    return out


def moe_bound(where: str, stream, n_sms, iters: int, dev, gen) -> list[bk.Record]:
    """The decode path's rate as a bound on prefill: the layer at T = 32 (16-row items of ~1.3 rows: the time is the
    decode of the experts it touches), scaled to all E experts. Every prefill call of T >= 512 touches every expert
    (1 - (1 - 6/384)^512 > 0.9997), so no kernel that decodes each weight at least once at this rate is faster."""
    out = []
    for K in MOE_KS:
        ex = make_experts(float(K), dev)
        ring = []
        for _ in range(16):
            ids, w = routing(32, dev, gen)
            ring.append((torch.randn(32, H, device=dev, generator=gen).bfloat16(), ids, w))
        distinct = sum(torch.unique(ids).numel() for _, ids, _ in ring) / len(ring)
        with on(stream, n_sms):
            t = bk.time_cuda(lambda x, ids, w, ex=ex: exl3_moe(x, ids, w, ex), args=ring, warmup=3, iters=iters)
        us = t.median_us * E / distinct
        out.append(bk.Record(op="exl3_moe", shape={"K": K, "T": 32, "sms": n_sms or 0}, timing=t,
                             variant=f"decode bound {where}", notes=f"distinct experts {distinct:.1f}; "
                             f"all {E} experts at this rate: {us:.1f} us"))
        print(f"[{where}] decode bound K={K}: T=32 {t.median_us:8.1f} us for {distinct:.1f} experts -> all {E} "
              f"experts decoded once at that rate: {us:9.1f} us", flush=True)
        del ex
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------------ gemm
# exl3_gemm variants timed side by side: (label, plan override).
GEMM_VARIANTS = {"plan": "exl3_gemm.variant=auto", "large": "exl3_gemm.variant=large", "small": "exl3_gemm.variant=small",
                 "mma64": "exl3_gemm.variant=fused_mma,exl3_gemm.mma_tokens=64",
                 "mma128": "exl3_gemm.variant=fused_mma,exl3_gemm.mma_tokens=128",
                 "mma256": "exl3_gemm.variant=fused_mma,exl3_gemm.mma_tokens=256", "fused": "exl3_gemm.variant=fused"}


def gemm_cases(where: str, stream, n_sms, ms, iters: int, dev, gen, variants: list[str]) -> list[bk.Record]:
    out = []
    for name, k, n, K in gemm_shapes():
        layers, _ = _layers(k, n, K, dev, torch.Generator().manual_seed(k + n))
        wring = bk.rotate(lambda k=k, n=n: (torch.randn(k, n, device=dev, dtype=torch.bfloat16),))
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            with on(stream, n_sms):
                dense = bk.time_cuda(lambda w, x=x, y=y: torch.mm(x, w, out=y), args=wring, warmup=3, iters=iters)
                line = f"[{where}] exl3_gemm {name:12s} {k:5d}x{n:5d} K={K} m={m:5d}: bf16 {dense.median_us:8.1f} us"
                for label in variants:
                    with plans.override(GEMM_VARIANTS[label]):
                        t = bk.time_cuda(lambda L, x=x, y=y: exl3_gemm(x, L, out=y), args=[(L,) for L in layers], warmup=3,
                                         iters=iters)
                    out.append(bk.Record(op="exl3_gemm", shape={"k": k, "n": n, "K": K, "m": m, "sms": n_sms or 0},
                                         timing=t, dense_us=dense.median_us, variant=f"{label} {where}", notes=name))
                    line += f"  {label} {t.median_us:8.1f} us (x{t.median_us / dense.median_us:.2f})"
            print(line, flush=True)
        del layers, wring
        torch.cuda.empty_cache()
    return out


def gemm_time(k: int, n: int, K: float, m: int, iters: int, dev, gen) -> float:
    """µs of one exl3_gemm call at the plan's choice, L2-cold (on the current stream and SM limit)."""
    layers, _ = _layers(k, n, K, dev, torch.Generator().manual_seed(k + n))
    x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    return bk.time_cuda(lambda L: exl3_gemm(x, L, out=y), args=[(L,) for L in layers], warmup=3, iters=iters).median_us


def layer_cases(stream, n_sms, ts, iters: int, dev, gen, moe: dict) -> list[bk.Record]:
    """The average V4.1 layer's EXL3 work at T tokens on the proxy: every gemm of plan_step (wo_a: its groups one by
    one, as prefill runs them) timed once per distinct (k, n, K) and weighted by its count over the 40 layers, plus
    the routed experts (``moe``: (K, T) -> µs, from moe_cases' "after" records)."""
    ops = [o for o in plan_step(SPEC) if o.layer >= 0 and o.kind in ("gemm", "moe")]
    out = []
    for T in ts:
        by_class: dict[str, float] = {}
        cache: dict[tuple, float] = {}
        with on(stream, n_sms):
            for o in ops:
                if o.kind == "moe":
                    us = moe[(int(o.K), T)]
                else:
                    key = (o.k, o.n, o.K)
                    if key not in cache:
                        cache[key] = gemm_time(o.k, o.n, o.K, T, iters, dev, gen)
                    us = cache[key] * o.groups
                by_class[o.cls] = by_class.get(o.cls, 0.0) + us / SPEC.layers
        total = sum(by_class.values())
        parts = ", ".join(f"{c} {us:,.0f}" for c, us in by_class.items())
        print(f"[proxy] V4.1 layer T={T:5d}: {total:9.1f} us per layer ({parts}) -> {T / total * 1e6 / SPEC.layers:,.0f} "
              f"tok/s per rank for these kernels alone ({total / T:.2f} us per token per layer)", flush=True)
        out.append(bk.Record(op="layer", shape={"T": T, "sms": n_sms}, median_us=total, variant="after proxy",
                             notes="; ".join(f"{c}={us:.1f}" for c, us in by_class.items())))
    return out


def summary(records: list[bk.Record]) -> None:
    print("\nSummary (ratios to bf16 dense on the same SMs; geomean over shapes):")
    for where in sorted({r.variant.split()[-1] for r in records if r.op == "exl3_gemm"}):
        for label in GEMM_VARIANTS:
            for m in sorted({r.shape["m"] for r in records if r.op == "exl3_gemm"}):
                rs = [r.median_us / r.dense_us for r in records
                      if r.op == "exl3_gemm" and r.variant == f"{label} {where}" and r.shape["m"] == m]
                if rs:
                    g = math.exp(sum(map(math.log, rs)) / len(rs))
                    print(f"  [{where}] {label:6s} m={m:5d}: geomean x{g:.2f}, worst x{max(rs):.2f}")


def gb10_estimates(records: list[bk.Record]) -> None:
    """Each exl3_gemm proxy case on GB10 by twinspark.gb10's model: the compute-bound kernels (fused_mma: the best of
    its token tiles; small) from their proxy times, the bytes they move and their MMA FLOPs (kernel_us); the large
    path from its bytes and FLOPs alone (large_gemm_us: the bf16 weight written and read back at GB10's bandwidth,
    which the proxy's HBM hides). Predictions, not GB10 measurements."""
    from twinspark import gb10

    cases = {}
    for r in records:
        if r.op == "exl3_gemm" and r.variant.endswith(" proxy"):
            key = (r.notes, r.shape["k"], r.shape["n"], r.shape["K"], r.shape["m"])
            cases.setdefault(key, {})[r.variant.split()[0]] = r.median_us
    if not cases:
        return
    print("\nGB10 model (twinspark.gb10; predicted µs: fused_mma / small / large, and the table's choice):")
    for (name, k, n, K, m), got in sorted(cases.items(), key=lambda c: (c[0][4], c[0][0])):
        trellis = k * n * K / 8
        flops = 2.0 * m * k * n
        acts = 6.0 * m * k + 6.0 * m * n  # x, x' written and read, y' written and read, out
        est = {}
        mma = [got[v] for v in ("mma64", "mma128", "mma256") if v in got]
        if mma:
            est["fused_mma"] = gb10.kernel_us(trellis * math.ceil(m / 128) + acts, min(mma), flops)["us"]
        if "small" in got:
            est["small"] = gb10.kernel_us(trellis * math.ceil(m / 64) + acts, got["small"], flops)["us"]
        est["large"] = gb10.large_gemm_us(k, n, m, trellis, 2.0 * m * k, 2.0 * m * n)["us"]
        with plans.override("", base=plans.DEFAULT):
            choice = exl3_gemm_plan(m, k, n, K, 48, None, False).variant
        print(f"  {name:12s} {k:5d}x{n:5d} m={m:5d}: " + "  ".join(f"{v} {us:8.1f}" for v, us in est.items())
              + f"  -> table: {choice}")


def main(argv=None) -> int:
    ints = lambda s: tuple(int(v) for v in s.split(",") if v)  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=48, help="SMs of the proxy's green context (GB10: 48)")
    ap.add_argument("--no-full", action="store_true", help="the proxy only (not the whole GPU too)")
    ap.add_argument("--only", choices=("moe", "gemm", "layer"), help="one part of the benchmark (layer: also its MoE)")
    ap.add_argument("--ks", type=ints, default=MOE_KS, help="MoE K values")
    ap.add_argument("--ts", type=ints, default=MOE_TS, help="MoE T values")
    ap.add_argument("--ms", type=ints, default=GEMM_MS, help="GEMM m values")
    ap.add_argument("--iters", type=int, default=5, help="timed samples per case (median reported)")
    ap.add_argument("--no-bound", action="store_true", help="skip the MoE decode-rate bound")
    ap.add_argument("--variants", default="before,after,rows4", help=f"MoE variants, of {', '.join(MOE_VARIANTS)}")
    ap.add_argument("--gemm-variants", default="plan,large,mma128,mma256",
                    help=f"exl3_gemm variants, of {', '.join(GEMM_VARIANTS)}")
    ap.add_argument("--from-json", metavar="PATH", help="print the summary and GB10 estimates of a results file, run "
                    "nothing (no GPU needed)")
    a = ap.parse_args(argv)
    if a.from_json:
        records = bk.load_results(a.from_json)["records"]
        summary(records)
        gb10_estimates(records)
        return 0
    if not torch.cuda.is_available():
        print("bench_prefill: no CUDA GPU is visible; run it on a GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(4343)
    from torch.cuda.green_contexts import GreenContext

    gc = GreenContext.create(num_sms=a.sms, device_id=dev.index)
    places = [("proxy", gc.Stream(), a.sms)]
    if not a.no_full:
        places.append(("h200", torch.cuda.Stream(dev), None))
    records: list[bk.Record] = []
    for where, stream, n in places:
        if a.only in (None, "moe", "layer"):
            variants = a.variants.split(",") if a.only != "layer" else ["after"]
            records += moe_cases(where, stream, n, a.ks, a.ts, a.iters, dev, gen, variants)
            if not a.no_bound:
                records += moe_bound(where, stream, n, a.iters, dev, gen)
        if a.only in (None, "gemm"):
            records += gemm_cases(where, stream, n, a.ms, a.iters, dev, gen, a.gemm_variants.split(","))
        if a.only in (None, "layer") and where == "proxy":
            moe = {(r.shape["K"], r.shape["T"]): r.median_us for r in records
                   if r.op == "exl3_moe" and r.variant == "after proxy"}
            records += layer_cases(stream, n, [T for T in LAYER_TS if all((K, T) in moe for K in (2, 3))], a.iters,
                                   dev, gen, moe)
    summary(records)
    gb10_estimates(records)
    print(f"wrote {bk.write_results('prefill', records, ceilings={'proxy_sms': a.sms})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
