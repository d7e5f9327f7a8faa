"""The one GB10 model: what a DGX Spark's GPU (GB10, sm_121a) is taken to be, and how a kernel's GB10 time is
estimated from an H200 measurement. Used by benchkit (per-kernel predictions), bench/bench_decode_step.py (the
48-SM proxy) and the forecast (``twinspark.client.forecast``, ``invoke forecast``).

Every constant is a ``Param``: value, unit and where it comes from ("measured" only where a run of this project or
a published source measured it; "assumed" otherwise: replace it with a Spark's number when one exists).

Kernel time on GB10 (``kernel_us``) is the largest of three floors plus nothing else:
- bandwidth: bytes / (273 GB/s x BW_EFFICIENCY);
- the 48-SM proxy: the kernel's time on 48 SMs of an H200 (a green context), times H200_CLOCK / GB10_CLOCK: the
  same SM count, the issue width and latencies of one SM per clock, at GB10's clock. It over-counts nothing that an
  SM does per clock the same way on both chips (integer and FP32 work: the trellis decode, address arithmetic,
  barriers, launch latency), but an H200 SM does TC_RATIO times the tensor-core work of a GB10 SM per clock, so for
  tensor-core-bound work the proxy is a lower bound;
- tensor cores: the kernel's MMA FLOPs (as issued: small m padded to the MMA tile) / GB10_MMA_FLOPS. That is the
  correction for the proxy's lower bound: where the tensor cores bound the kernel, this floor is the larger one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    value: float
    unit: str
    source: str

    def __float__(self) -> float:
        return float(self.value)


# ---------------------------------------------------------------------------------------------------- hardware
BW = Param(273e9, "B/s", "LPDDR5X peak of one DGX Spark (shared/docs/deployment.md)")
BW_EFFICIENCY = Param(0.85, "of BW", "assumed: what a streaming read of a tuned kernel reaches (not measured on a "
                      "Spark; the best published EXL3 MoE decode kernel reached 208 GB/s = 0.76, seed A's moex)")
SMS = Param(48, "SMs", "GB10 (shared/docs/deployment.md)")
CLOCK = Param(2.4e9, "Hz", "assumed SM clock under load (not read from a Spark)")
H200_SMS = Param(132, "SMs", "H200 (device properties)")
H200_CLOCK = Param(1.98e9, "Hz", "measured SM clock under back-to-back layers on the H200 (cuda/exl3_moe/DESIGN.md, Measured limits)")
# mma.sync m16n8k16 f16->f32: one per 6 cycles per sub-partition, 4 sub-partitions (scripts/probe_mma_rate.cu; its
# log: git show 1fc0a13:bench/results/mma_rate_probe_h200.log): 4 x 4096 / 6 FLOP per clock per SM
H200_MMA_PER_SM_CLK = Param(4 * 4096 / 6, "FLOP/clk/SM", "measured on the H200 (scripts/probe_mma_rate.cu)")
GB10_BF16_FLOPS = Param(100e12, "FLOP/s", "assumed bf16 mma with fp32 accumulation: ~1/10 of the 1 PFLOP "
                        "FP4-with-sparsity the product is sold with (not measured on a Spark)")
SMEM_PER_SM = Param(100 * 1024, "B", "compute capability 12.x (CUDA guide; not read from a Spark)")
LAUNCH_US = Param(4.0, "µs", "assumed fixed cost of an eager kernel launch on GB10 (~2x the H200's)")
H200_LAUNCH_US = Param(2.0, "µs", "H200 eager launch + prologue + tail (bench_exl3_gemm runs)")


def gb10_mma_per_sm_clk() -> float:
    return float(GB10_BF16_FLOPS) / (float(SMS) * float(CLOCK))


def tc_ratio() -> float:
    """How many times the tensor-core work per SM per clock an H200 SM does compared with a GB10 SM."""
    return float(H200_MMA_PER_SM_CLK) / gb10_mma_per_sm_clk()


def clock_scale() -> float:
    """Multiply a 48-SM H200 time by this for GB10's clock."""
    return float(H200_CLOCK) / float(CLOCK)


def bw_floor_us(nbytes: float, efficiency: float | None = None) -> float:
    """µs to stream ``nbytes`` at GB10's bandwidth x efficiency (default BW_EFFICIENCY)."""
    eff = float(BW_EFFICIENCY) if efficiency is None else efficiency
    return nbytes / (float(BW) * eff) * 1e6


def kernel_us(nbytes: float, proxy_us: float | None = None, mma_flops: float = 0.0,
              efficiency: float | None = None) -> dict:
    """A kernel's GB10 time from its bytes, its 48-SM H200 proxy time (None: not measured) and its issued MMA FLOPs.
    Returns {"us", "bw_us", "proxy_us", "tc_us", "bound"}; bound names the floor that sets "us"."""
    floors = {"bandwidth": bw_floor_us(nbytes, efficiency),
              "proxy": proxy_us * clock_scale() if proxy_us is not None else 0.0,
              "tensor cores": mma_flops / float(GB10_BF16_FLOPS) * 1e6}
    bound = max(floors, key=floors.get)
    return {"us": floors[bound], "bw_us": floors["bandwidth"], "proxy_us": floors["proxy"],
            "tc_us": floors["tensor cores"], "bound": bound}


def predict_from_h200_us(nbytes: float, h200_us: float, h200_copy_gbps: float, launches: int = 1) -> dict:
    """A GB10 estimate of one call (``launches`` kernels) from its bytes and its time on the whole H200.

    naive:   bytes / (273 GB/s x the fraction of the copy ceiling the call reached on the H200)
             (pessimistic when the H200 run was decode- or latency-bound).
    bounded: max(bandwidth floor at BW_EFFICIENCY, decode work = the H200 time above its own bandwidth floor and
             launch costs, scaled by SM throughput 132 x 1.98 GHz -> 48 x 2.4 GHz) + launch costs.
    The 48-SM proxy (kernel_us) replaces the SM scaling where a proxy time exists."""
    eff = (nbytes / (h200_us * 1e-6)) / (h200_copy_gbps * 1e9)
    naive = nbytes / (float(BW) * eff) * 1e6
    floor = bw_floor_us(nbytes)
    work = max(0.0, h200_us - launches * float(H200_LAUNCH_US) - nbytes / (h200_copy_gbps * 1e9) * 1e6)
    decode = work * (float(H200_SMS) * float(H200_CLOCK)) / (float(SMS) * float(CLOCK))
    return {"naive_us": naive, "bounded_us": max(floor, decode) + launches * float(LAUNCH_US),
            "bw_floor_us": floor, "decode_us": decode}


def large_gemm_us(k: int, n: int, m: int, trellis_bytes: float, x_bytes: float, out_bytes: float) -> dict:
    """GB10 time of the exl3_gemm large path (no wgmma on sm_121a): dequant_w (trellis read + bf16 W written) and
    a dense matmul (W + x read, out written, or 2 m k n / GB10_BF16_FLOPS when that is larger), plus two launches.
    Returns {"us", "dequant_us", "matmul_us"}."""
    w = 2.0 * k * n
    dequant = bw_floor_us(trellis_bytes + w)
    matmul = max(bw_floor_us(w + x_bytes + out_bytes), 2.0 * m * k * n / float(GB10_BF16_FLOPS) * 1e6)
    return {"us": dequant + matmul + 2 * float(LAUNCH_US), "dequant_us": dequant, "matmul_us": matmul}


# ------------------------------------------------------------------------------------ serving: what is not a kernel
# Decode and prefill terms that are not one of twinspark's kernels. Where a published two-Spark measurement fixes a
# value, the forecast's calibration derives it (client/forecast.py: ATTENTION_CORE from seed A's no-speculation
# decode, ATTENTION_PREFILL from its 8k prefill); the rest are stated assumptions.
ALLREDUCE_US = Param(30.0, "µs", "assumed, one call of twinspark's one-shot all-reduce over RoCE through host memory "
                     "(H200 host-memory loopback 18.6 µs at 16 KB, bench/results/allreduce.json, plus a RoCE round "
                     "trip; not measured between two Sparks)")
NCCL_ALLREDUCE_US = Param(50.0, "µs", "assumed, one small NCCL all-reduce over RoCE (NCCL took 41-53 µs over NVLink "
                          "between two H200s, the README's allreduce row at 65e0848; not measured between two Sparks)")
GRAPH_KERNEL_US = Param(1.0, "µs", "assumed, per kernel of a CUDA graph on GB10: the ramp-up and tail a bandwidth "
                        "floor leaves out (the H200 step graphs ran 0.3-1.3 µs per call above the sum of their classes' "
                        "graphs, bench/results/decode_step.json)")
ENGRAM_IOPS = Param(112e3, "rows/s", "GB10 NVMe, 4 KiB random reads at queue depth 64 (shared/docs/deepseek-v41.md "
                    "section 5, seed A)")
UPSTREAM_EFFICIENCY = Param(150 / 273, "of BW", "exllamav3's fused MoE decode kernel on GB10: a K=3 4-token launch "
                            "touching 24 experts (160 MB) in 1,065 µs = 150 GB/s (seed A README, standalone); taken for "
                            "upstream's dense EXL3 GEMMs and vLLM's own weight reads (router, mHC) too")
MOEX_EFFICIENCY = Param(208 / 273, "of BW", "seed A's tuned MoE kernel (exl3_moe_x, DSV41_EXL3_MOE_X): the same launch "
                        "in 765 µs = 208 GB/s (seed A README)")
ROUTING_OVERLAP = Param(862 / 1065, "of uniform", "distinct experts real routing touches at T > 1 against uniform "
                        "random routing: the same kernel's launch took 862 µs in situ (rank-0 trace) against 1,065 "
                        "standalone on 24 uniform experts (seed A README; T=1 always touches top_k)")
MOE_PREFILL_E3V2_US = Param(17.0e3 / 1536, "µs/token/layer", "seed A's E3 v2 grouped MoE kernels on GB10: 17.0 ms "
                            "per layer at a 1536-token chunk (seed A README)")
MOE_PREFILL_FUSED_US = Param(34.1e3 / 1536, "µs/token/layer", "exllamav3's per-16-row fused MoE kernel at prefill "
                             "on GB10: 34.1 ms per layer at a 1536-token chunk (seed A README)")
KV_LAYER_TOKEN_BYTES = Param(656, "B", "fp8_ds_mla: 512 fp8 latent + 4 fp32 scales + 64 bf16 RoPE values per token "
                             "per layer (client/budget.py)")
INDEX_KEY_BYTES = Param(132, "B", "an indexer key: 128 fp8 values + an fp32 scale (vLLM's fp8 indexer cache)")


@dataclass
class Term:
    """One line of a forecast: what it is, the bytes it moves per step (or token), its µs, how it was got."""

    name: str
    us: float
    nbytes: float = 0.0
    how: str = ""
    counted: bool = True  # False: printed, not added (overlapped with other work)


def total_us(terms: list[Term]) -> float:
    return sum(t.us for t in terms if t.counted)


def expected_distinct(experts: int, top_k: int, T: int, overlap: float | None = None) -> float:
    """Distinct experts T tokens touch: uniform random top-k routing, times ROUTING_OVERLAP for T > 1."""
    uniform = experts * -math.expm1(T * math.log1p(-top_k / experts)) if top_k < experts else float(experts)
    if T <= 1:
        return float(min(top_k, experts))
    return uniform * (float(ROUTING_OVERLAP) if overlap is None else overlap)


def tokens_per_step(k: int, acceptance_length: float | None) -> float:
    """Tokens one decode step yields: 1 without speculation, else the mean acceptance length (accepted draft
    tokens + the target's own token), which must lie in [1, k + 1]."""
    if k == 0:
        return 1.0
    if acceptance_length is None or not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"the mean acceptance length must be between 1 and k + 1 = {k + 1}, got {acceptance_length}")
    return float(acceptance_length)


def acceptance_length(alpha: float, k: int) -> float:
    """Mean tokens per step when each draft position is accepted with probability alpha given the ones before it."""
    return sum(alpha**i for i in range(k + 1))


def alpha_for(length: float, k: int) -> float:
    """The per-position acceptance that gives this mean acceptance length at k draft tokens (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2
