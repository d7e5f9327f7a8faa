"""GB10 forecast: decode and prefill tokens per second of one rank pair (tensor parallel 2 on two Sparks),
predicted from the bytes each token must read (client.budget) and kernel efficiencies measured on the H200
(bench results, else the upstream anchors), next to the published two-Spark numbers.

Model (stated, not hidden; every number is a flag):
- decode, 1 stream, no speculation: every rank reads its dense weights (attention, shared experts, lm_head,
  norms/router; not the embedding: one row) plus top_k/n_experts of its routed-expert bytes per token. Two floors:
  bandwidth (bytes / GB10 copy bandwidth) and decoding work (weights per token / the weights per second the m=1
  kernels decode on the H200, scaled by the SM ratio: on the H200 they are bound by that work, not by memory).
  Time per token = the larger floor + a fixed per-token overhead (all-reduces, launches; a flag, default 0).
- prefill: the routed-expert layer time per token on the H200 at T=512 (bench or anchor), scaled by the SM ratio
  (the upstream kernels are limited by decoding work, not bandwidth, at large T), times the MoE layers; attention
  and all-reduce excluded, so it is an upper bound.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from twinspark import benchkit as bk
from twinspark.checks import is_int, is_number
from twinspark.client.budget import Budget
from twinspark.safetensors_io import SafetensorsError

GB10_GBPS = 273.0  # LPDDR5X spec bandwidth
GB10_COPY_FRACTION = 0.9  # copy ceiling / spec bandwidth assumed for GB10 (H200: 4260 of 4800 GB/s = 0.89)
GB10_SMS, H200_SMS = 48, 132
PUBLISHED = [  # deployment notes: two Sparks
    ("decode 1 stream", "31.6 tok/s (2.9 bpw, DSpark k=3); 39-41 code / ~29 prose (2.77 bpw, k=7)"),
    ("decode 2 streams aggregate", "42.5 tok/s (2.9 bpw); 60 tok/s (2.77 bpw)"),
    ("decode 4 streams aggregate, no speculation", "53.7 tok/s (2.9 bpw)"),
    ("prefill 8k / 32k", "~971 / 1,055 tok/s (2.9 bpw); 2,050 / 2,061 tok/s (2.77 bpw)"),
]


@dataclass
class Forecast:
    bytes_per_token: float
    weights_per_token: float
    bandwidth_tok_s: float  # bandwidth floor alone (upper bound)
    work_tok_s: float  # decoding-work floor alone
    decode_tok_s: float  # the forecast: the larger floor plus overhead
    h200_weights_per_s: float
    work_source: str
    prefill_tok_s: float | None
    prefill_source: str


def _positive(x) -> bool:
    return is_number(x) and x > 0


def _usable(doc: dict) -> list[tuple[dict, float]]:
    """(shape, median µs) of the records of a results file that a forecast can use (a shape, a time > 0)."""
    return [(r.shape, r.median_us) for r in doc["records"] if isinstance(r.shape, dict) and _positive(r.median_us)]


def h200_decode_rate(results: Path | None = None, anchors: bk.Anchors | None = None) -> tuple[float, str]:
    """Median weights per second an m=1 EXL3 GEMM decodes on the H200: from a bench results file when given
    (records with k, n and m=1), else from the upstream anchors."""
    if results is not None:
        doc = bk.load_results(results)
        rates = [shape["k"] * shape["n"] / (us * 1e-6) for shape, us in _usable(doc)
                 if is_int(shape.get("k")) and is_int(shape.get("n")) and shape.get("m", 1) == 1]
        if rates:
            return statistics.median(rates), f"median of {len(rates)} m=1 records in {results}"
    a = anchors or bk.load_anchors()
    rates = [r.k * r.n / (r.upstream_us * 1e-6) for r in a.gemm_rows if r.m == 1]
    return statistics.median(rates), f"upstream exllamav3 m=1 GEMMs on the H200 (anchors, median of {len(rates)})"


def h200_prefill_us_per_token(results: Path | None = None, anchors: bk.Anchors | None = None, K: int = 3) -> tuple[float, str]:
    """Routed-expert layer µs per token at T=512 on the H200."""
    if results is not None:
        doc = bk.load_results(results)
        times = [us for shape, us in _usable(doc) if shape.get("T") == 512]
        if times:
            return min(times) / 512, f"T=512 MoE record in {results}"
    a = anchors or bk.load_anchors()
    row = a.moe(K=K, T=512)
    return row.us / 512, f"upstream fused MoE, K={K}, T=512 on the H200 (anchors)"


def forecast(b: Budget, *, top_k: int | None = None, experts: int | None = None, moe_layers: int | None = None,
             gb10_gbps: float = GB10_GBPS, copy_fraction: float = GB10_COPY_FRACTION, overhead_ms: float = 0.0,
             decode_results: Path | None = None, moe_results: Path | None = None) -> Forecast:
    for name, v in (("top_k", top_k), ("experts", experts), ("moe_layers", moe_layers)):
        if v is not None and not (is_int(v) and v >= 1):
            raise SafetensorsError(f"forecast: {name} must be an integer >= 1, got {v!r:.40}")
    if not (_positive(gb10_gbps) and _positive(copy_fraction) and copy_fraction <= 1):
        raise SafetensorsError(f"forecast: the GB10 bandwidth must be a finite number of GB/s > 0 and the copy fraction "
                               f"in (0, 1], got {gb10_gbps!r:.40} and {copy_fraction!r:.40}")
    if not (is_number(overhead_ms) and overhead_ms >= 0):
        raise SafetensorsError(f"forecast: the per-token overhead must be a finite number of ms >= 0, got "
                               f"{overhead_ms!r:.40}")
    cfg = b.config
    top_k = top_k or int(cfg.get("num_experts_per_tok") or 6)
    experts = experts or int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 384)
    if top_k > experts:
        raise SafetensorsError(f"forecast: {top_k} experts per token but only {experts} experts; fix "
                               "num_experts_per_tok / n_routed_experts in config.json")
    skip = ("routed experts", "Engram tables", "MTP")
    dense = sum(v for k, v in b.per_rank.items() if k not in skip) - _embed_bytes_per_rank(b)
    per_token = dense + b.per_rank["routed experts"] * top_k / experts
    dense_w = sum(v for k, v in b.params_per_rank.items() if k not in skip)
    weights = dense_w + b.params_per_rank["routed experts"] * top_k / experts
    if per_token <= 0 or weights <= 0:
        raise SafetensorsError(f"forecast: a decoded token reads {per_token:,.0f} bytes and {weights:,.0f} weights of "
                               "this checkpoint (embedding excluded); pass a whole checkpoint folder with its own "
                               "config.json")
    bw = gb10_gbps * copy_fraction * 1e9
    rate, work_src = h200_decode_rate(decode_results)
    t_bw = per_token / bw
    t_work = weights / (rate * GB10_SMS / H200_SMS)
    t = max(t_bw, t_work) + overhead_ms / 1e3
    layers = moe_layers or int(cfg.get("num_hidden_layers") or 0)
    prefill = None
    pre_src = "no layer count in config.json"
    if layers:
        us, pre_src = h200_prefill_us_per_token(moe_results)
        prefill = 1e6 / (us * (H200_SMS / GB10_SMS) * layers)
        pre_src += f", x {H200_SMS}/{GB10_SMS} SMs, x {layers} MoE layers, attention excluded"
    return Forecast(per_token, weights, 1 / t_bw, 1 / t_work, 1 / t, rate, work_src, prefill, pre_src)


def _embed_bytes_per_rank(b: Budget) -> int:
    h = int(b.config.get("hidden_size") or 0)
    v = int(b.config.get("vocab_size") or 0)
    return h * v * 2 // b.tp if h and v else 0  # bf16 embedding, vocab-parallel


def report(f: Forecast, b: Budget) -> str:
    lines = [f"GB10 forecast, tensor parallel {b.tp}, one stream, no speculation",
             f"per token per rank: {f.bytes_per_token / 2**30:.2f} GiB read, {f.weights_per_token / 1e9:.2f} G weights "
             "decoded",
             f"bandwidth floor alone (upper bound):             {f.bandwidth_tok_s:6.1f} tok/s",
             f"decoding-work floor alone:                       {f.work_tok_s:6.1f} tok/s   "
             f"[{f.h200_weights_per_s / 1e12:.2f} T weights/s on the H200 x {GB10_SMS}/{H200_SMS} SMs; {f.work_source}]",
             f"decode forecast (the larger floor + overhead):   {f.decode_tok_s:6.1f} tok/s"]
    if f.prefill_tok_s is not None:
        lines.append(f"prefill, routed experts only (upper bound):      {f.prefill_tok_s:6.0f} tok/s   [{f.prefill_source}]")
    else:
        lines.append(f"prefill: not forecast ({f.prefill_source})")
    lines += ["", "published two-Spark numbers:"] + [f"  {k}: {v}" for k, v in PUBLISHED]
    return "\n".join(lines)
