"""What bounds exl3_gemm's large path at prefill sizes on the 48-SM proxy (cuda/exl3_gemm/DESIGN.md, large m).

The large path is dequant_w (the whole weight W = diag(suh)·Hk·W_hat·Hn·diag(svh) in x's dtype) plus the very bf16
matmul it is compared with, so the ratio to dense is 1 + dequant_w / dense. This times dequant_w's parts at the V4.1
attention and shared-expert shapes (K = 5, mul1, bf16), L2-cold, on a green context:
- ``all``: the package's kernel (checked bit for bit against twinspark's exl3_gemm_dequant_w);
- ``k_side``: steps 1-2 only (decode, suh and Hk), W' in bf16; with Hn and svh left to the package's epilogue pass
  on y it is a complete GEMM (checked against the fp32 reference at the GEMM's bf16 tolerance, 5e-3);
- ``decode``: the trellis decode and the store alone, no transform: a floor for any whole-weight decode;
and prints, derived from those times (not timed themselves): ``free exchange`` = decode + 2 (k_side - decode), both
transforms at the cost of the one that needs no exchange between warps; and per m the large path's ratio to dense
with dequant_w at that cost, or at decode alone (the measured large path less the difference). Its kernels are the
package's template with steps switched off (small_m.cuh, DwParts), built here by torch's extension loader: a
device-session tool, not a package benchmark.

    python scripts/probe_dequant_w.py [--sms 48] [--m 512,1024]

Writes dequant_w_parts.json to $TWINSPARK_BENCH_OUT (default bench/results); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import benchkit as bk  # noqa: E402
from bench_exl3_gemm import _layers  # noqa: E402
from bench_prefill import gemm_shapes  # noqa: E402
from twinspark import _ext  # noqa: E402
from twinspark.exl3.reference import CODEBOOKS  # noqa: E402
from twinspark.ops import exl3_gemm, plans, sms  # noqa: E402

PARTS = ("all", "k_side", "decode")
TOL = 5e-3  # the exl3_gemm tests' bf16 tolerance (relative L2 against the fp32 reference)


def build():
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}" + ("a" if major >= 9 else ""))  # TMA, one arch
    out = Path(os.environ.get("PROBE_BUILD_DIR") or tempfile.mkdtemp(prefix="probe_dequant_w_"))
    out.mkdir(parents=True, exist_ok=True)
    return load("probe_dequant_w", sources=[str(ROOT / "scripts/probe_dequant_w.cu"),
                                            str(ROOT / "cuda/common/tensor_map.cu")],
                extra_include_paths=[str(ROOT / "cuda")], build_directory=str(out),
                extra_cuda_cflags=["-O3", "-std=c++17"])


def check(probe, C, name, k, n, L, x, s) -> bool:
    """``all`` equals the package's kernel; k_side + matmul + epilogue is the GEMM."""
    cb = CODEBOOKS.index(L.codebook)
    w = torch.empty(k, n, device=x.device, dtype=torch.bfloat16)
    C.exl3_gemm_dequant_w(L.trellis.data_ptr(), L.suh.data_ptr(), L.svh.data_ptr(), k, n, 5, cb, True, w.data_ptr(), s)
    w_pkg = w.clone()
    w.fill_(float("nan"))
    probe.dequant_w_part("all", L.trellis.data_ptr(), L.suh.data_ptr(), L.svh.data_ptr(), k, n, cb, True, w.data_ptr(), s)
    same = torch.equal(w, w_pkg)
    w.fill_(float("nan"))
    probe.dequant_w_part("k_side", L.trellis.data_ptr(), L.suh.data_ptr(), L.svh.data_ptr(), k, n, cb, True,
                         w.data_ptr(), s)
    yh = (x @ w).half()
    y = torch.full((x.shape[0], n), float("nan"), device=x.device, dtype=torch.bfloat16)
    C.exl3_gemm_epilogue(yh.data_ptr(), 0, L.svh.data_ptr(), 0, x.shape[0], n, y.data_ptr(), n, True, s)
    ref = x.float() @ L.weight().to(x.device)
    err = float((y.float() - ref).norm() / ref.norm())
    ok = same and err <= TOL
    print(f"{name:12s} {k:5d}x{n:5d} check: all == package {same}, k_side + mm + epilogue rel L2 {err:.2e} "
          f"(<= {TOL:g}) {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def probe_shape(probe, C, name, k, n, K, ms, n_sms, iters, stream, dev, gen) -> tuple[list, bool]:
    layers, _ = _layers(k, n, K, dev, torch.Generator().manual_seed(k + n))
    cb = CODEBOOKS.index(layers[0].codebook)
    w = torch.empty(k, n, device=dev, dtype=torch.bfloat16)
    ring = [(L,) for L in layers]
    wring = bk.rotate(lambda: (torch.randn(k, n, device=dev, dtype=torch.bfloat16),))
    s = stream.cuda_stream

    def t(fn, args=None):
        return bk.time_cuda(fn, args=args, warmup=3, iters=iters)

    def part(p, L):
        probe.dequant_w_part(p, L.trellis.data_ptr(), L.suh.data_ptr(), L.svh.data_ptr(), k, n, cb, True,
                             w.data_ptr(), s)

    ok = check(probe, C, name, k, n, layers[0], torch.randn(ms[0], k, device=dev, generator=gen).bfloat16(), s)
    pt = {p: t(lambda L, p=p: part(p, L), ring) for p in PARTS}
    free = pt["decode"].median_us + 2 * (pt["k_side"].median_us - pt["decode"].median_us)
    line = "  ".join(f"{p} {pt[p].median_us:6.1f}" for p in PARTS)
    print(f"{name:12s} dequant_w µs: {line}  free exchange {free:6.1f} (derived)", flush=True)
    save_free, save_decode = pt["all"].median_us - free, pt["all"].median_us - pt["decode"].median_us
    shape = {"k": k, "n": n, "K": K, "sms": n_sms}
    records = [bk.Record(op="exl3_gemm.dequant_w", shape=shape, timing=pt[p], variant=p, notes=name) for p in PARTS]
    for m in ms:
        x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        yh = torch.randn(m, n, device=dev, generator=gen).half()  # the epilogue's input: y's bytes, fp16 as it reads

        def k_side_gemm(L, x=x, y=y, yh=yh, m=m):
            part("k_side", L)
            torch.mm(x, w, out=y)
            C.exl3_gemm_epilogue(yh.data_ptr(), 0, L.svh.data_ptr(), 0, m, n, y.data_ptr(), n, True, s)

        dense = t(lambda W, x=x, y=y: torch.mm(x, W, out=y), wring).median_us
        with plans.override("exl3_gemm.variant=large"):
            large = t(lambda L, x=x, y=y: exl3_gemm(x, L, out=y), ring)
        ks = t(k_side_gemm, ring)
        print(f"  m={m:5d} bf16 {dense:6.1f}  large {large.median_us:6.1f} (x{large.median_us / dense:.2f})"
              f"  k_side+mm+epilogue {ks.median_us:6.1f} (x{ks.median_us / dense:.2f})  1.5x {1.5 * dense:6.1f};"
              f" with free exchange x{(large.median_us - save_free) / dense:.2f}, decode alone"
              f" x{(large.median_us - save_decode) / dense:.2f}", flush=True)
        shape_m = {**shape, "m": m}
        records += [bk.Record(op="exl3_gemm", shape=shape_m, timing=large, dense_us=dense, variant="large", notes=name),
                    bk.Record(op="exl3_gemm", shape=shape_m, timing=ks, dense_us=dense, variant="k_side+epilogue",
                              notes=name)]
    return records, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=48, help="SMs of the green context (GB10: 48)")
    ap.add_argument("--m", default="512", help="token counts, comma-separated")
    ap.add_argument("--iters", type=int, default=15)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_dequant_w: no CUDA GPU is visible; run it on a GPU machine", file=sys.stderr)
        return 2
    from torch.cuda.green_contexts import GreenContext

    probe, C = build(), _ext.module()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(512)
    gc = GreenContext.create(num_sms=a.sms, device_id=dev.index)  # kept: its streams die with it
    stream = gc.Stream()
    ms = [int(v) for v in a.m.split(",")]
    records, ok = [], True
    for name, k, n, K in gemm_shapes():
        if K != 5:
            print(f"{name}: K={K} skipped (the probe is built for K = 5)")
            continue
        with torch.cuda.stream(stream), sms.limit(a.sms):
            recs, good = probe_shape(probe, C, name, k, n, K, ms, a.sms, a.iters, stream, dev, gen)
        records += recs
        ok &= good
        torch.cuda.empty_cache()
    print(f"wrote {bk.write_results('dequant_w_parts', records, ceilings={'proxy_sms': a.sms})}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
