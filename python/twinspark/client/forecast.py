"""GB10 forecast (`invoke forecast DIR`): DeepSeek V4.1 Flash on two DGX Sparks at tensor parallel 2, decode tokens
per second of one stream (DSpark speculation: k draft tokens, a mean acceptance length) and prefill tokens per
second, term by term, from a checkpoint's headers (client.budget: bytes per rank by module class) and the one GB10
model (twinspark.gb10: every constant with its source). Then the same model run on each published two-Spark
configuration (shared/docs/deployment.md; seed A = MiaAI-Lab's 2.9 bpw kit, the pack twinspark serves; project B =
0xSero's 2.77 bpw kit), printed as prediction, published figure and residual, and on twinspark's own kernels.

Decode, one step (T = k + 1 tokens: the target verifies the draft), per rank:
  weight bytes read once per step by class (attention projections, compressor + indexer, shared experts, routed
  experts: the distinct experts T tokens touch, Engram wkv, lm_head, vLLM's own weights: router, mHC, norms),
  the embedding row, KV reads at the context length, activations, the Engram rows (read from NVMe on a prefetch
  stream: overlapped unless --engram-us), all-reduces (2 per layer, the embedding, the Engram gathers, the logits)
  at one latency each, graph overhead per kernel, the attention core (vLLM's kernels, a per-layer time calibrated
  on seed A's no-speculation decode) and the DSpark draft (its layers' bytes, its attention cores and all-reduces).
  Each byte class runs at its kernel's efficiency (published kernels: their GB/s on GB10; twinspark: the 48-SM H200
  proxy of bench/results/decode_step.json through gb10.kernel_us, else 273 GB/s x gb10.BW_EFFICIENCY).
  tok/s = tokens per step / step time.
Prefill, per token at a context length: the routed experts (compute-bound: µs per token per layer of the kernel),
  the dense projections (exl3_gemm's large path on GB10, gb10.large_gemm_us per chunk; twinspark: the 48-SM proxy's
  layer records of bench/results/prefill.json where they are above that model), the attention (vLLM's, calibrated on
  seed A's 8k prefill), one Engram layer's rows from NVMe (the other overlaps), all-reduces per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from twinspark import gb10
from twinspark.checks import is_int, is_number
from twinspark.client.budget import CONFIG_INTS, Budget
from twinspark.fileio import read_json
from twinspark.paths import project_root
from twinspark.safetensors_io import SafetensorsError

STEP_RESULTS = project_root() / "bench" / "results" / "decode_step.json"
MOE_RESULTS = project_root() / "bench" / "results" / "exl3_moe.json"
PREFILL_RESULTS = project_root() / "bench" / "results" / "prefill.json"
ANCHOR_CONTEXT = 512  # seed A's decode figures: 400-token prose answers to short prompts
SEED_A = "seed A README (MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks)"
PROJECT_B = "project B README (0xSero/DeepSeek-V4.1-Flash-Two-Sparks)"
# Acceptance lengths from seed A's own figures: tok/s x its measured 4-token verify step (72 ms with exllamav3's MoE
# kernel, 60 ms with its tuned one)
PROSE_LENGTH = 31.6 * 0.072  # headline 400-token prose, 31.6 tok/s
EASY_LENGTH = 64.5 * 0.060  # easy prose with the tuned kernel, 63-66 tok/s
CODE_LENGTH = 46.0 * 0.072  # code, 45-47 tok/s with exllamav3's kernel
LIST_FIELDS = ("compress_ratios", "index_source_layer_ids", "engram_layer_ids")


class ForecastError(SafetensorsError):
    """A forecast input that cannot be used; str() is one sentence saying what to change."""


# ------------------------------------------------------------------------------------------- what a step reads
def text_config(cfg: dict) -> dict:
    """The text model's config: config.json's top level with a nested ``text_config`` (V4.1) merged over it, the
    fields the forecast computes with checked (one sentence when one is of the wrong type)."""
    text = cfg.get("text_config", {})
    if not isinstance(text, dict):
        raise ForecastError(f"config.json: text_config is a {type(text).__name__}, not an object; fix or re-download it")
    merged = {**cfg, **text}
    for key, least in {**CONFIG_INTS, "moe_intermediate_size": 128, "dspark_n_routed_experts": 1,
                       "dspark_num_experts_per_tok": 1, "num_nextn_predict_layers": 0, "engram_n_heads": 1,
                       "engram_max_ngram_size": 2, "hc_mult": 1}.items():
        v = merged.get(key)
        if v is not None and not (is_int(v) and v >= least):
            raise ForecastError(f"config.json: {key} is {v!r:.40}, not an integer >= {least}; fix or re-download it")
    for key in LIST_FIELDS:
        v = merged.get(key)
        if v is not None and not (isinstance(v, list) and all(is_int(x) and x >= 0 for x in v)):
            raise ForecastError(f"config.json: {key} is {v!r:.40}, not a list of integers >= 0; fix or re-download it")
    return merged


@dataclass
class Model:
    """Per-rank bytes a decode step can read, by class, and the counts the terms need."""

    nbytes: dict[str, float]  # attention, compressor + indexer, shared, routed, engram wkv, lm_head, other, mtp dense,
    #                           mtp experts (all of them: the step reads a share of the routed ones)
    params: dict[str, float]  # weights per class (prefill FLOPs)
    tp: int
    layers: int
    hidden: int
    experts: int
    top_k: int
    hc_mult: int
    mtp_layers: int
    mtp_experts: int
    mtp_top_k: int
    engram_layers: int
    engram_rows: int  # Engram rows per token per rank per layer
    compress_ratios: tuple[int, ...]
    index_sources: tuple[int, ...]
    kv_layer_bytes: float
    name: str = "checkpoint"

    def native(self, name: str, routed_bits: float, dense_bytes: float, head_bytes: float,
               mtp_expert_bytes: float) -> Model:
        """The same model stored another way (bytes per weight by class): project B's pack."""
        p, b = self.params, dict(self.nbytes)
        for c in ("attention", "compressor + indexer", "shared", "engram wkv", "mtp dense"):
            b[c] = p[c] * dense_bytes
        b["routed"] = p["routed"] * routed_bits / 8
        b["lm_head"] = p["lm_head"] * head_bytes
        b["mtp experts"] = p["mtp experts"] * mtp_expert_bytes
        return replace(self, nbytes=b, name=name)


def _expert_weights(hidden: int, inter: int) -> int:
    return 3 * hidden * inter


def model_from_budget(b: Budget) -> Model:
    cfg = text_config(b.config)
    need = ("num_hidden_layers", "hidden_size")
    missing = [k for k in need if not cfg.get(k)]
    if missing:
        raise ForecastError(f"config.json has no {', '.join(missing)}; pass a checkpoint folder with its config.json")
    tp, h = b.tp, int(cfg["hidden_size"])
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not experts or not top_k:
        raise ForecastError("config.json has no n_routed_experts / num_experts_per_tok; the forecast is for MoE models")
    if top_k > experts:
        raise ForecastError(f"config.json: {top_k} experts per token but only {experts} experts; fix "
                            "num_experts_per_tok / n_routed_experts")
    inter = int(cfg.get("moe_intermediate_size") or 0) // tp
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    mtp_e = int(cfg.get("dspark_n_routed_experts") or experts)
    qc = cfg.get("quantization_config")
    mtp_bits = qc.get("mtp_bits", 4) if isinstance(qc, dict) else 4
    mtp_bits = mtp_bits if is_number(mtp_bits) and 0 < mtp_bits <= 16 else 4
    pr, pp = b.per_rank, b.params_per_rank
    embed = h * int(cfg.get("vocab_size") or 0) * 2 // tp  # bf16, vocab-parallel: read a row per token, not whole
    mtp_w = mtp_layers * mtp_e * _expert_weights(h, inter)
    mtp_exp_bytes = min(pr["MTP"], mtp_w * mtp_bits / 8)
    nbytes = {"attention": pr["attention"], "compressor + indexer": pr["compressor + indexer"],
              "shared": pr["shared experts"], "routed": pr["routed experts"], "engram wkv": pr["Engram"],
              "lm_head": pr["lm_head"], "other": max(0, pr["other"] - embed),
              "mtp dense": pr["MTP"] - mtp_exp_bytes, "mtp experts": mtp_exp_bytes}
    params = {"attention": pp["attention"], "compressor + indexer": pp["compressor + indexer"],
              "shared": pp["shared experts"], "routed": pp["routed experts"], "engram wkv": pp["Engram"],
              "lm_head": pp["lm_head"], "other": pp["other"], "mtp dense": max(0, pp["MTP"] - mtp_w),
              "mtp experts": min(pp["MTP"], mtp_w)}
    layers = int(cfg["num_hidden_layers"])
    heads = (int(cfg.get("engram_max_ngram_size") or 4) - 1) * int(cfg.get("engram_n_heads") or 8)
    ratios = tuple(int(r) for r in (cfg.get("compress_ratios") or [])[:layers])
    arch = (cfg.get("architectures") or ["?"])[0]
    q = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else {}
    name = f"{arch}" + (f", {q.get('quant_method')} {q.get('bits')} bpw" if q.get("quant_method") else "")
    return Model(nbytes=nbytes, params=params, tp=tp, layers=layers, hidden=h, experts=experts, top_k=top_k,
                 hc_mult=int(cfg.get("hc_mult") or 1), mtp_layers=mtp_layers, mtp_experts=mtp_e,
                 mtp_top_k=int(cfg.get("dspark_num_experts_per_tok") or top_k),
                 engram_layers=len(cfg.get("engram_layer_ids") or []), engram_rows=math.ceil(heads / tp),
                 compress_ratios=ratios, index_sources=tuple(cfg.get("index_source_layer_ids") or ()),
                 kv_layer_bytes=float(gb10.KV_LAYER_TOKEN_BYTES), name=name)


# ------------------------------------------------------------------------------------------------- the kernels
@dataclass
class Kernels:
    """How a configuration's kernels run on GB10: efficiency per byte class (fraction of 273 GB/s), or twinspark's
    measured classes (``measured[(class, T)] = (bytes, 48-SM proxy µs, MMA FLOPs)``), and its other costs."""

    name: str
    dense_eff: float
    routed_eff: float
    other_eff: float
    allreduce_us: float
    moe_prefill_us: float  # routed experts at prefill, µs per token per layer on GB10
    moe_prefill_how: str
    draft_eff: float
    graph_kernel_us: float = 0.0
    kernels_per_layer: float = 0.0
    measured: dict = field(default_factory=dict)
    measured_how: str = ""
    prefill_rates: dict = field(default_factory=dict)  # {T: (routed, other EXL3 projections)} µs/token/layer on GB10
    prefill_how: str = ""


def upstream(name: str, routed_eff: float, moe_prefill: gb10.Param) -> Kernels:
    """Published kits on exllamav3's kernels and vLLM's stock SM12x path (their launch gaps sit in the calibrated
    attention core)."""
    e = float(gb10.UPSTREAM_EFFICIENCY)
    return Kernels(name, e, routed_eff, e, float(gb10.NCCL_ALLREDUCE_US), float(moe_prefill), moe_prefill.source, e)


@dataclass(frozen=True)
class BenchRecord:
    """The fields the forecast reads from one record of a benchmark results file."""

    variant: str
    shape: dict
    median_us: float
    bytes: float
    flops: float
    op: str = ""
    notes: str = ""


def read_bench_results(path: Path) -> tuple[dict, list[BenchRecord]]:
    """(machine, records) of a results file that bench/run.py writes (bench/benchkit: {"name", "machine",
    "ceilings", "records": [{"op", "shape", "variant", "median_us", "bytes", "flops", ...}]}); the product reads
    these fields only and does not import the bench kit. One sentence when the file is not one."""
    try:
        doc = read_json(path)  # a regular file only: a FIFO would block the reader
        machine = doc.get("machine") or {}
        recs = [BenchRecord(str(r.get("variant", "twinspark")), r["shape"], float(r["median_us"]),
                            float(r.get("bytes") or 0), float(r.get("flops") or 0), str(r.get("op", "")),
                            str(r.get("notes", ""))) for r in doc["records"]]
        if not isinstance(machine, dict) or not all(isinstance(r.shape, dict) for r in recs):
            raise TypeError("machine and every record's shape must be objects")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ForecastError(f"{path} is not a benchmark results file ({e}); re-run the benchmark that wrote it "
                            "(`python bench/run.py NAME` on a GPU)") from None
    return machine, recs


def measured_classes(path: Path) -> tuple[dict, str]:
    """{(class, T): (bytes, proxy µs, MMA FLOPs)} of the 48-SM proxy in a decode_step.json."""
    machine, records = read_bench_results(path)
    out = {}
    for r in records:
        mode, _, rest = r.variant.partition(":")
        if mode == "proxy" and rest.startswith("class:") and is_int(r.shape.get("T")):
            out[(rest[len("class:"):], r.shape["T"])] = (r.bytes, r.median_us, r.flops)
    if not out:
        raise ForecastError(f"{path} has no 48-SM proxy records; re-run `python bench/run.py decode_step` on a GPU")
    return out, f"48-SM H200 proxy, {path.name} ({str(machine.get('date', '?'))[:10]})"


def moe_prefill_us(path: Path | None, K: int = 3) -> tuple[float, str]:
    """twinspark's exl3_moe at its largest T in an exl3_moe.json (H200), per token per layer on GB10: the larger of
    the SM-throughput scaling (the prefill kernels are bound by decode work) and the tensor-core floor."""
    best = None
    if path is not None and path.is_file():
        for r in read_bench_results(path)[1]:
            s = r.shape
            if r.variant == "twinspark" and s.get("K") == K and is_int(s.get("T")) and s["T"] >= 512:
                if best is None or s["T"] > best[0]:
                    best = (s["T"], r.median_us, s.get("H", 5120), s.get("I", 1152), s.get("top_k", 6))
    if best is None:
        return float(gb10.MOE_PREFILL_E3V2_US), "no exl3_moe results: " + gb10.MOE_PREFILL_E3V2_US.source
    T, us, H, inter, top_k = best
    scale = float(gb10.H200_SMS) * float(gb10.H200_CLOCK) / (float(gb10.SMS) * float(gb10.CLOCK))
    work = us / T * scale
    mma = 2.0 * top_k * _expert_weights(H, inter) / float(gb10.GB10_BF16_FLOPS) * 1e6
    return max(work, mma), (f"exl3_moe K={K} T={T} on the H200 ({us:,.0f} µs), x {scale:.2f} SM throughput "
                            f"(tensor-core floor {mma:.2f} µs)")


def prefill_rates(path: Path | None) -> tuple[dict, str]:
    """{T: (routed experts, the other EXL3 projections)} in µs per token per layer on GB10, from the average V4.1
    layer a prefill.json measured on the 48-SM proxy (bench/bench_prefill.py "layer" records), times the H200's clock
    over GB10's (the proxy runs GB10's SM count at the H200's clock); the routed term at least the tensor-core floor.
    Prefill is bound by decode and mma work there, not by GB10's bandwidth: the routed layer reads 1.3-2.5 GB of
    weights and ~2 GB of x' per 8k tokens against ~31 ms of work on the proxy."""
    if path is None or not path.is_file():
        return {}, ""
    machine, records = read_bench_results(path)
    clock = float(gb10.H200_CLOCK) / float(gb10.CLOCK)
    mma = 2.0 * 6 * _expert_weights(5120, 1152) / float(gb10.GB10_BF16_FLOPS) * 1e6
    out = {}
    for r in records:
        T = r.shape.get("T")
        if r.op != "layer" or r.variant != "after proxy" or not is_int(T) or T <= 0:
            continue
        parts = dict(kv.split("=") for kv in r.notes.split("; ") if "=" in kv)
        try:
            routed = float(parts["routed"])
        except (KeyError, ValueError):
            raise ForecastError(f"{path}: the layer record at T={T} has no routed time in its notes ({r.notes!r}); "
                                "re-run `python bench/run.py prefill` on a GPU") from None
        out[T] = (max(routed / T * clock, mma), (r.median_us - routed) / T * clock)
    how = (f"48-SM H200 proxy, {path.name} ({str(machine.get('date', '?'))[:10]}), x {clock:.2f} clock "
           f"(tensor-core floor {mma:.2f} µs)")
    return out, how


def twinspark_kernels(step_results: Path | None, moe_results: Path | None, allreduce_us: float,
                      efficiency: float, prefill_results: Path | None = None) -> Kernels:
    measured, how = ({}, "no decode_step results: bandwidth floors")
    if step_results is not None:
        measured, how = measured_classes(step_results)
    pre, pre_how = moe_prefill_us(moe_results)
    rates, rates_how = prefill_rates(prefill_results)
    return Kernels("twinspark", efficiency, efficiency, float(gb10.UPSTREAM_EFFICIENCY), allreduce_us, pre, pre_how,
                   efficiency, float(gb10.GRAPH_KERNEL_US), 0.0, measured, how, rates, rates_how)


# --------------------------------------------------------------------------------------------------- the terms
MEASURED_CLASS = {"attention": "attention", "compressor + indexer": ("compressor", "indexer"), "shared": "shared",
                  "routed": "routed", "engram wkv": "engram wkv", "lm_head": "lm_head"}


def _weights_us(kn: Kernels, cls: str, nbytes: float, T: int, eff: float, scale: float = 1.0) -> tuple[float, str]:
    """GB10 µs of one byte class: twinspark's proxy measurement at T (scaled by `scale`: the routing overlap) through
    gb10.kernel_us, else the bandwidth floor at `eff`."""
    names = MEASURED_CLASS.get(cls)
    names = (names,) if isinstance(names, str) else names or ()
    got = [kn.measured.get((n, T)) for n in names]
    if names and all(got):
        est = gb10.kernel_us(sum(g[0] for g in got) * scale, sum(g[1] for g in got) * scale, sum(g[2] for g in got),
                             efficiency=eff)
        return est["us"], f"{est['bound']}-bound (proxy {est['proxy_us']:,.0f} µs, floor {est['bw_us']:,.0f})"
    return gb10.bw_floor_us(nbytes, eff), f"{eff * float(gb10.BW) / 1e9:.0f} GB/s"


def kv_read_bytes(m: Model, context: int) -> float:
    """KV bytes one token's attention reads per rank: the sliding window (128) on every layer, up to index_topk (512)
    compressed entries on compressed layers, and the indexer's scan of every compressed key on index-source layers."""
    total = m.layers * min(context, 128) * m.kv_layer_bytes
    for layer, ratio in enumerate(m.compress_ratios[:m.layers]):
        if ratio:
            total += min(context // ratio, 512) * m.kv_layer_bytes
            if layer in m.index_sources:
                total += context // ratio * float(gb10.INDEX_KEY_BYTES)
    return total


def allreduces(m: Model) -> int:
    """After attention and after the MoE on every layer, the embedding, the Engram gathers, the logits gather."""
    return 2 * m.layers + 1 + m.engram_layers + 1


def decode_terms(m: Model, kn: Kernels, *, k: int, context: int, attention_us: float, engram_us: float = 0.0,
                 overhead_us: float = 0.0) -> list[gb10.Term]:
    """One decode step (T = k + 1), per rank."""
    T = k + 1
    t = []
    d = gb10.expected_distinct(m.experts, m.top_k, T)
    scale = d / gb10.expected_distinct(m.experts, m.top_k, T, overlap=1.0)  # real routing against the uniform bench
    t.append(gb10.Term("embedding row", gb10.bw_floor_us(T * m.hidden * 2, kn.other_eff), T * m.hidden * 2,
                       "one bf16 row per token"))
    for cls, label in (("attention", "attention projections"), ("compressor + indexer", "compressor + indexer"),
                       ("shared", "shared experts"), ("routed", "routed experts"), ("engram wkv", "Engram wkv"),
                       ("lm_head", "lm_head")):
        nb = m.nbytes[cls] * (d / m.experts if cls == "routed" else 1.0)
        us, how = _weights_us(kn, cls, nb, T, kn.routed_eff if cls == "routed" else kn.dense_eff,
                              scale if cls == "routed" else 1.0)
        if cls == "routed":
            how += f"; {d:.1f} of {m.experts} experts per layer"
        t.append(gb10.Term(label, us, nb, how))
    rows = m.engram_layers * m.engram_rows * T * 264
    t.append(gb10.Term("Engram rows (NVMe)", engram_us, rows, "on vLLM's prefetch stream, overlapped (--engram-us)",
                       counted=engram_us > 0))
    t.append(gb10.Term("router, mHC, norms (vLLM)", gb10.bw_floor_us(m.nbytes["other"], kn.other_eff),
                       m.nbytes["other"], f"{kn.other_eff * float(gb10.BW) / 1e9:.0f} GB/s"))
    kv = kv_read_bytes(m, context)
    t.append(gb10.Term(f"KV reads at {context:,} tokens", gb10.bw_floor_us(kv, kn.other_eff), kv,
                       "sparse attention's window, top-k entries and indexer keys"))
    act = T * m.layers * (m.hc_mult + 1) * m.hidden * 2 * 4
    t.append(gb10.Term("activations", gb10.bw_floor_us(act, kn.dense_eff), act,
                       "mHC streams in and out, attention and FFN"))
    n_ar = allreduces(m)
    t.append(gb10.Term("all-reduce", n_ar * kn.allreduce_us, 0, f"{n_ar} x {kn.allreduce_us:.0f} µs"))
    if kn.graph_kernel_us:
        calls = 12 * m.layers
        t.append(gb10.Term("graph overhead", calls * kn.graph_kernel_us, 0,
                           f"~{calls} kernels x {kn.graph_kernel_us:.1f} µs"))
    t.append(gb10.Term("attention core (vLLM)", m.layers * attention_us, 0, f"{m.layers} x {attention_us:.0f} µs"))
    if k > 0:
        dd = gb10.expected_distinct(m.mtp_experts, m.mtp_top_k, T)
        nb = m.nbytes["mtp dense"] + m.nbytes["mtp experts"] * dd / m.mtp_experts + m.nbytes["lm_head"]
        us = (gb10.bw_floor_us(nb, kn.draft_eff) + m.mtp_layers * (attention_us + 2 * kn.allreduce_us))
        t.append(gb10.Term(f"DSpark draft ({m.mtp_layers} layers, k={k})", us, nb,
                           f"one parallel pass: weights at {kn.draft_eff * float(gb10.BW) / 1e9:.0f} GB/s, its "
                           "attention cores and all-reduces, lm_head again"))
    if overhead_us:
        t.append(gb10.Term("other per step (--overhead-ms)", overhead_us, 0, "given"))
    return t


DENSE_CLASSES = ("attention", "compressor + indexer", "shared", "engram wkv")


def dense_prefill_floor_us(m: Model, chunk: int) -> float:
    """µs per prompt token of every dense EXL3 projection on GB10 by its floors, the large path's model: W made once per
    `chunk`-token chunk (trellis read, bf16 W written at GB10's bandwidth), then a bf16 matmul at GB10's bandwidth or
    tensor rate, whichever is slower. The 48-SM proxy hides both: its HBM takes the W round trip and its SMs do ~3x
    GB10's assumed tensor work per clock (gb10.tc_ratio)."""
    dense_w = sum(m.params[c] for c in DENSE_CLASSES)
    dense_b = sum(m.nbytes[c] for c in DENSE_CLASSES)
    # every dense matrix at once: large_gemm_us is linear in the weights (k x n = all of them, trellis = all)
    return (gb10.large_gemm_us(1, int(dense_w), chunk, dense_b, 0, 0)["us"] - 2 * float(gb10.LAUNCH_US)) / chunk


def prefill_terms(m: Model, kn: Kernels, *, context: int, chunk: int, attention_us: float) -> list[gb10.Term]:
    """µs per prompt token at a prompt of `context` tokens in chunks of `chunk`, per rank. With measured prefill rates
    (prefill.json) the EXL3 terms are those of the smallest measured T at least `chunk` (else the largest), each at
    least its GB10 floor (the routed experts' tensor-core floor, the dense projections' dense_prefill_floor_us), as
    gb10.kernel_us takes the largest floor."""
    floor = dense_prefill_floor_us(m, chunk)
    floor_how = (f"W made once per {chunk}-token chunk, then a bf16 matmul "
                 f"({float(gb10.GB10_BF16_FLOPS) / 1e12:.0f} TFLOP/s)")
    if kn.prefill_rates:
        T = min((T for T in kn.prefill_rates if T >= chunk), default=max(kn.prefill_rates))
        routed, dense = kn.prefill_rates[T]
        measured = dense * m.layers
        dense_how = (f"{kn.prefill_how}, T={T}" if measured >= floor else
                     f"GB10's floors: {floor_how}; the proxy's {measured:.1f} µs (T={T}) is below them")
        t = [gb10.Term("routed experts", routed * m.layers, 0, f"{kn.prefill_how}, T={T}"),
             gb10.Term("dense projections", max(measured, floor), 0, dense_how)]
    else:
        t = [gb10.Term("routed experts", kn.moe_prefill_us * m.layers, 0, kn.moe_prefill_how),
             gb10.Term("dense projections", floor, 0, floor_how)]
    t.append(gb10.Term(f"attention at {context:,} (vLLM)", attention_us, 0, "calibrated"))
    t.append(gb10.Term("Engram rows (NVMe)", m.engram_rows / float(gb10.ENGRAM_IOPS) * 1e6, 0,
                       f"{m.engram_rows} rows of one layer per token at {float(gb10.ENGRAM_IOPS) / 1e3:.0f}k IOPS; "
                       "the other layer's overlap"))
    t.append(gb10.Term("all-reduce", allreduces(m) * kn.allreduce_us / chunk, 0, f"per {chunk}-token chunk"))
    return t


# ------------------------------------------------------------------------------------------------- calibration
@dataclass
class Row:
    what: str
    predicted: float
    published: tuple[float, float]
    note: str
    anchor: bool = False

    @property
    def residual(self) -> float:
        mid = sum(self.published) / 2
        return self.predicted / mid - 1


@dataclass
class Result:
    model: Model
    kernels: Kernels
    k: int
    length: float
    context: int
    prefill_context: int
    chunk: int
    attention_us: float
    attention_how: str
    prefill_attention_us: float
    decode: list
    prefill: list
    rows: list
    goals: list

    @property
    def decode_tok_s(self) -> float:
        return gb10.tokens_per_step(self.k, self.length) / gb10.total_us(self.decode) * 1e6

    @property
    def prefill_tok_s(self) -> float:
        return 1e6 / sum(t.us for t in self.prefill)


def _tok_s(terms, length) -> float:
    return length / gb10.total_us(terms) * 1e6


def calibrate(m: Model) -> tuple[float, float, list[Row]]:
    """The attention core per layer (decode) and the attention per token (prefill) from seed A's published figures,
    then every published configuration through the same model."""
    a = upstream("seed A, exllamav3 kernels", float(gb10.UPSTREAM_EFFICIENCY), gb10.MOE_PREFILL_E3V2_US)
    base = gb10.total_us(decode_terms(m, a, k=0, context=ANCHOR_CONTEXT, attention_us=0.0))
    attn = max(0.0, (1e6 / 23.0 - base) / m.layers)
    pre_base = sum(t.us for t in prefill_terms(m, a, context=8192, chunk=1536, attention_us=0.0))
    pre_attn = max(0.0, 1e6 / 970.8 - pre_base)
    rows = [Row("A no speculation (anchor: sets the attention core)", _tok_s(decode_terms(
        m, a, k=0, context=ANCHOR_CONTEXT, attention_us=attn), 1.0), (23, 23), f"{SEED_A}: SPEC_METHOD=none", True)]
    moex = replace(a, name="seed A, tuned MoE", routed_eff=float(gb10.MOEX_EFFICIENCY))
    for what, kn, length, pub, note in (
            ("A DSpark k=3, prose", a, PROSE_LENGTH, (31.6, 31.6), f"acceptance {PROSE_LENGTH:.2f} = 31.6 tok/s x "
             "its 72 ms verify step: the residual tests the step time"),
            ("A DSpark k=3, easy prose, exllamav3 MoE", a, EASY_LENGTH, (42, 50), f"acceptance {EASY_LENGTH:.2f} "
             "(the tuned row's); published range over prompts"),
            ("A DSpark k=3, easy prose, tuned MoE kernel", moex, EASY_LENGTH, (63, 66), f"acceptance "
             f"{EASY_LENGTH:.2f} = 64.5 x its 60 ms step")):
        rows.append(Row(what, _tok_s(decode_terms(m, kn, k=3, context=ANCHOR_CONTEXT, attention_us=attn), length),
                        pub, note))
    b_model = m.native("project B", 2.77, 1.0, 2.0, 0.5)
    b_kn = Kernels("project B, B12X kernels", float(gb10.BW_EFFICIENCY), float(gb10.UPSTREAM_EFFICIENCY),
                   float(gb10.UPSTREAM_EFFICIENCY), float(gb10.ALLREDUCE_US), float(gb10.MOE_PREFILL_E3V2_US),
                   gb10.MOE_PREFILL_E3V2_US.source, float(gb10.BW_EFFICIENCY))
    for what, length3, pub in (("B DSpark k=7, code", CODE_LENGTH, (39, 41)), ("B DSpark k=7, prose", PROSE_LENGTH,
                                                                               (29, 29))):
        alpha = gb10.alpha_for(length3, 3)
        length7 = gb10.acceptance_length(alpha, 7)
        rows.append(Row(what, _tok_s(decode_terms(b_model, b_kn, k=7, context=ANCHOR_CONTEXT, attention_us=attn),
                                     length7), pub,
                        f"fp8 attention/shared, 2.77 bpw experts; acceptance {length7:.2f} at k=7 from A's per-token "
                        f"{alpha:.2f}; adaptive verification not modelled"))
    pre = lambda mm, kn, ctx, ch: 1e6 / sum(t.us for t in prefill_terms(mm, kn, context=ctx, chunk=ch,  # noqa: E731
                                                                        attention_us=pre_attn))
    fused = upstream("exllamav3 fused", float(gb10.UPSTREAM_EFFICIENCY), gb10.MOE_PREFILL_FUSED_US)
    rows += [Row("A prefill 8k (anchor: sets the prefill attention)", pre(m, a, 8192, 1536), (970.8, 970.8),
                 f"{SEED_A}: E3 v2 grouped MoE, 1536-token chunks", True),
             Row("independent prefill pp4096 (A's pack)", pre(m, fused, 4096, 1024), (512, 518),
                 "assumes exllamav3's fused MoE path (the run's build and Engram storage are not published)"),
             Row("B prefill 8k", pre(b_model, b_kn, 8192, 2048), (2050, 2050),
                 f"{PROJECT_B}; B12X attention and linear kernels, not vLLM's stock path: the residual is theirs")]
    return attn, pre_attn, rows


# --------------------------------------------------------------------------------------------------- forecast
def _check(name, v, least=0.0, most=math.inf, integer=False):
    ok = (is_int(v) if integer else is_number(v)) and least <= v <= most
    if not ok:
        kind = "an integer" if integer else "a finite number"
        span = f">= {least:g}" if most == math.inf else f"from {least:g} to {most:g}"
        raise ForecastError(f"forecast: {name} must be {kind} {span}, got {v!r:.40}")
    return v


def _results(given: Path | None, default: Path, what: str) -> Path | None:
    """The results file to read: the given one (which must exist), else the default when it exists."""
    if given is None:
        return default if default.is_file() else None
    if not Path(given).is_file():
        raise ForecastError(f"forecast: {given} is not a file; pass a {default.name} from `python bench/run.py {what}`")
    return Path(given)


def forecast(b: Budget, *, k: int = 3, acceptance_length: float = PROSE_LENGTH, context: int = 1024,
             prefill_context: int = 8192, chunk: int = 1024, gb10_gbps: float = float(gb10.BW) / 1e9,
             bw_efficiency: float = float(gb10.BW_EFFICIENCY), allreduce_us: float = float(gb10.ALLREDUCE_US),
             attention_us: float | None = None, engram_us: float = 0.0, overhead_ms: float = 0.0,
             step_results: Path | None = None, moe_results: Path | None = None,
             prefill_results: Path | None = None) -> Result:
    """The forecast for twinspark's kernels on this checkpoint, with the calibration table. step_results /
    moe_results / prefill_results: decode_step.json / exl3_moe.json / prefill.json (default: bench/results' when
    present)."""
    _check("the draft tokens (--draft-tokens)", k, 0, 15, integer=True)
    _check("the acceptance length (--acceptance-length)", acceptance_length, 1.0, k + 1.0)
    for name, v in (("the context (--context)", context), ("the prefill context (--prefill-context)", prefill_context),
                    ("the chunk (--chunk)", chunk)):
        _check(name, v, 1, 1 << 24, integer=True)
    if not (is_number(gb10_gbps) and gb10_gbps > 0):
        raise ForecastError(f"forecast: the GB10 bandwidth (--gb10-gbps) must be a finite number of GB/s > 0, got "
                            f"{gb10_gbps!r:.40}")
    if not (is_number(bw_efficiency) and 0 < bw_efficiency <= 1):
        raise ForecastError(f"forecast: the bandwidth efficiency (--bw-efficiency) must be a fraction in (0, 1], got "
                            f"{bw_efficiency!r:.40}")
    for name, v in (("the all-reduce latency (--allreduce-us)", allreduce_us), ("the Engram lookup time "
                    "(--engram-us)", engram_us), ("the per-step overhead (--overhead-ms)", overhead_ms),
                    ("the attention core (--attention-us)", 0.0 if attention_us is None else attention_us)):
        _check(name, v)
    m = model_from_budget(b)
    attn, pre_attn, rows = calibrate(m)
    how = f"calibrated: seed A's 23 tok/s without speculation, minus every other term ({attn:.0f} µs per layer)"
    if attention_us is not None:
        attn, how = attention_us, "--attention-us"
    # another bandwidth than 273 GB/s: the same efficiency of that bandwidth (published rows keep their own)
    eff = bw_efficiency * gb10_gbps * 1e9 / float(gb10.BW)
    kn = twinspark_kernels(_results(step_results, STEP_RESULTS, "decode_step"),
                           _results(moe_results, MOE_RESULTS, "exl3_moe"), allreduce_us, eff,
                           _results(prefill_results, PREFILL_RESULTS, "prefill"))
    dec = decode_terms(m, kn, k=k, context=context, attention_us=attn, engram_us=engram_us,
                       overhead_us=overhead_ms * 1e3)
    pre = prefill_terms(m, kn, context=prefill_context, chunk=chunk, attention_us=pre_attn)
    goals = goal_lines(dec, pre, k, acceptance_length)
    return Result(m, kn, k, acceptance_length, context, prefill_context, chunk, attn, how, pre_attn, dec, pre, rows,
                  goals)


def goal_lines(dec, pre, k: int, length: float) -> list[str]:
    """>= 70 tok/s decode with DSpark k=3 and >= 2,000 tok/s prefill at 8k: met or not, and what stops it."""
    out = []
    step = gb10.total_us(dec)
    cases = [(f"seed A's headline prose ({PROSE_LENGTH:.2f})", PROSE_LENGTH),
             (f"the easy prose of the 63-66 tok/s figure ({EASY_LENGTH:.2f})", EASY_LENGTH)]
    if all(abs(length - L) > 1e-9 for _, L in cases):
        cases.insert(0, (f"the acceptance given ({length:.2f})", length))
    for what, L in cases:
        if k and L <= k + 1:
            tok = L / step * 1e6
            need = L / 70 * 1e6
            out.append(f"decode at {what}: {tok:.1f} tok/s " + (">= 70: met" if tok >= 70 else
                       f"< 70: the step must lose {step - need:,.0f} µs ({step:,.0f} -> {need:,.0f})"))
    top = sorted((t for t in dec if t.counted), key=lambda t: -t.us)[:3]
    out.append("largest decode terms: " + ", ".join(f"{t.name} {t.us:,.0f} µs" for t in top))
    tok = 1e6 / sum(t.us for t in pre)
    top = sorted(pre, key=lambda t: -t.us)[:2]
    out.append(f"prefill: {tok:,.0f} tok/s " + (">= 2,000: met" if tok >= 2000 else
               f"< 2,000: needs {1e6 / 2000:.0f} µs per token, has {1e6 / tok:.0f}; largest: " +
               ", ".join(f"{t.name} {t.us:.0f} µs" for t in top)))
    return out


# ------------------------------------------------------------------------------------------------------ report
def _table(terms, per: str) -> list[str]:
    lines = [f"  {'term':40s} {'MB':>9s} {'µs ' + per:>12s}  how"]
    for t in terms:
        us = f"{t.us:12,.1f}" if t.counted else f"{'(' + format(t.us, ',.0f') + ')':>12s}"
        lines.append(f"  {t.name:40s} {t.nbytes / 1e6:9.2f} {us}  {t.how}")
    return lines


_SCALED = {"B/s": (1e9, "GB/s"), "Hz": (1e9, "GHz"), "FLOP/s": (1e12, "TFLOP/s"), "rows/s": (1e3, "k rows/s")}


def _param(p: gb10.Param) -> str:
    div, unit = _SCALED.get(p.unit, (1.0, p.unit))
    return f"{float(p) / div:.3g} {unit}"


def report(r: Result, b: Budget) -> str:
    step = gb10.total_us(r.decode)
    T = r.k + 1
    lines = [f"GB10 forecast: {r.model.name}, two Sparks, tensor parallel {b.tp}, per rank; one stream",
             f"GB10 (twinspark.gb10): {float(gb10.BW) / 1e9:.0f} GB/s x {float(gb10.BW_EFFICIENCY):.2f} for tuned "
             f"kernels, {int(gb10.SMS.value)} SMs at {float(gb10.CLOCK) / 1e9:.1f} GHz (assumed), an H200 SM does "
             f"{gb10.tc_ratio():.1f}x a GB10 SM's tensor-core work per clock (the 48-SM proxy is a lower bound "
             "there: the MMA floor covers it)",
             f"twinspark kernels: {r.kernels.measured_how}", "",
             f"decode step, DSpark k={r.k} (T={T} tokens verified), context {r.context:,}:"]
    lines += _table(r.decode, "/step")
    lines += [f"  {'total':40s} {sum(t.nbytes for t in r.decode if t.counted) / 1e6:9.1f} {step:12,.1f}",
              f"  tokens per step {gb10.tokens_per_step(r.k, r.length):.2f} (mean acceptance length) -> "
              f"{gb10.tokens_per_step(r.k, r.length) / step * 1e6:.1f} tok/s",
              f"  attention core: {r.attention_how}", "",
              f"prefill at {r.prefill_context:,} tokens, {r.chunk}-token chunks (µs per prompt token):"]
    lines += _table(r.prefill, "/token")
    pre = sum(t.us for t in r.prefill)
    lines += [f"  {'total':40s} {'':9s} {pre:12,.1f}  -> {1e6 / pre:,.0f} tok/s", "",
              "calibration: published two-Spark figures through the same model (their kernels):",
              f"  {'configuration':52s} {'predicted':>9s} {'published':>11s} {'residual':>8s}  notes"]
    for row in r.rows:
        lo, hi = row.published
        pub = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        res = "anchor" if row.anchor else f"{row.residual:+.0%}"
        lines.append(f"  {row.what:52s} {row.predicted:9.1f} {pub:>11s} {res:>8s}  {row.note}")
    lines += ["", "twinspark's kernels against the goals:"] + [f"  {g}" for g in r.goals]
    lines += ["", "inputs the model cannot know (twinspark.gb10; flags in brackets):"]
    for name, p, flag in (("GB10 bandwidth", gb10.BW, "--gb10-gbps"), ("efficiency", gb10.BW_EFFICIENCY,
                          "--bw-efficiency"), ("all-reduce", gb10.ALLREDUCE_US, "--allreduce-us"),
                          ("SM clock", gb10.CLOCK, None), ("bf16 tensor rate", gb10.GB10_BF16_FLOPS, None),
                          ("graph overhead", gb10.GRAPH_KERNEL_US, None), ("Engram IOPS", gb10.ENGRAM_IOPS, None),
                          ("upstream kernels", gb10.UPSTREAM_EFFICIENCY, None),
                          ("routing overlap", gb10.ROUTING_OVERLAP, None)):
        lines.append(f"  {name} = {_param(p)}{' [' + flag + ']' if flag else ''}: {p.source}")
    lines.append(f"  acceptance length {r.length:.2f} [--acceptance-length], draft tokens {r.k} [--draft-tokens], context [--context], "
                 "attention core [--attention-us], Engram lookup [--engram-us], per-step extra [--overhead-ms]")
    return "\n".join(lines)
