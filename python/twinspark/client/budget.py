"""Memory budget of a checkpoint at tensor parallel N, from safetensors headers only (no tensor data is read).

Per rank: bytes by tensor class (routed experts, shared experts, attention, lm_head, MTP, Engram, other);
tensors that vLLM keeps whole on every rank (norms, router, low-rank "a" projections) count in full, the rest
split evenly. Engram tables are not loaded into memory (rows are read from files on demand) and are listed
apart. Then the KV cache: per-token cost from the model config, the tokens a pool of --kv-bytes holds, whether
the context limit fits, and a MemAvailable forecast per rank.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from twinspark.checks import is_int, is_number
from twinspark.fileio import read_json
from twinspark.safetensors_io import SafetensorsError, TensorInfo, index_tensors, shard_files

GiB = 1 << 30
CLASSES = ("routed experts", "shared experts", "attention", "compressor + indexer", "lm_head", "MTP", "Engram",
           "Engram tables", "other")
NOT_LOADED = "Engram tables"  # rows are read from files on demand (twinspark.engram), never loaded
# DeepSeek V4.1 Flash with fp8_ds_mla: the launcher's 2.5 GiB pool holds 774,400 tokens (deployment notes),
# i.e. ~3.4 KiB per token; its compressed-attention layout is not derivable from the MLA fields alone.
KNOWN_KV_TOKEN_BYTES = {("DeepseekV41ForCausalLM", "fp8_ds_mla"): 2_684_354_560 / 774_400}
FP8_DS_MLA_LAYER_BYTES = 656  # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope values, per token per layer
# DeepSeek V4.1 (shared/docs/deepseek-v41.md section 3): fused wq_a + wkv, the compressor, the whole indexer, the
# hc mixing tensors, the draft's context combiner and heads, and the image markers are replicated too
_REPLICATED = re.compile(r"(norm|\.gate\.(weight|e_score_correction_bias|bias_vl)$|\.gate\.bias$|q_a_proj|kv_a_proj|"
                         r"wq_a|wkv_a|weights_proj|\.indexer\.|\.attn\.wkv\.|\.compressor\.|\.hc_|main_proj|"
                         r"markov_head|confidence_head|^image_)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def classify(name: str, num_layers: int | None = None) -> str:
    """The tensor class of a checkpoint tensor name (HF-style or DeepSeek-native names)."""
    m = _LAYER.search(name)
    if name.startswith("mtp.") or ".mtp." in name or (m and num_layers is not None and int(m[1]) >= num_layers):
        return "MTP"
    if ".engram.embed." in name:
        return NOT_LOADED
    if ".engram." in name:
        return "Engram"
    if name.startswith(("lm_head.", "head.")) or ".lm_head." in name:
        return "lm_head"
    if "shared_expert" in name:
        return "shared experts"
    if ".experts." in name:
        return "routed experts"
    if ".compressor." in name or ".indexer." in name:
        return "compressor + indexer"
    if any(k in name for k in (".self_attn.", ".attn.", ".attention.")):
        return "attention"
    return "other"


def replicated(name: str) -> bool:
    """Kept whole on every rank by vLLM (norms, router gate and bias, MLA down-projections, indexer keys)."""
    return _REPLICATED.search(name) is not None


@dataclass
class Budget:
    tp: int
    shards: int
    tensors: int
    total: dict[str, int]
    per_rank: dict[str, int]
    kv_token_bytes: float
    kv_token_source: str
    kv_pool_bytes: int
    kv_tokens: int
    max_model_len: int
    mem_available: int | None
    overhead_bytes: int
    boot_margin_bytes: int
    notes: list[str] = field(default_factory=list)
    params_per_rank: dict[str, int] = field(default_factory=dict)  # weights (EXL3: k*n per trellis), per class
    config: dict = field(default_factory=dict)

    @property
    def weights_per_rank(self) -> int:
        """Bytes each rank loads into memory (Engram excluded: read from files on demand)."""
        return sum(v for k, v in self.per_rank.items() if k != NOT_LOADED)

    @property
    def context_fits(self) -> bool:
        return self.kv_tokens >= self.max_model_len

    @property
    def preflight_needs(self) -> int:
        return self.weights_per_rank + self.boot_margin_bytes

    @property
    def mem_after_boot(self) -> int | None:
        if self.mem_available is None:
            return None
        return self.mem_available - self.weights_per_rank - self.kv_pool_bytes - self.overhead_bytes


# config.json fields the budget and the forecast compute with, and the least each may be (absent or null: unused)
CONFIG_INTS = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
               "hidden_size": 1, "vocab_size": 1, "kv_lora_rank": 1, "qk_rope_head_dim": 0, "num_experts_per_tok": 1,
               "n_routed_experts": 1, "num_experts": 1}


def read_config(model_dir: Path) -> dict:
    """config.json of a checkpoint folder ({} when there is none), its fields in CONFIG_INTS checked."""
    p = model_dir / "config.json"
    if not p.exists():
        return {}
    try:
        cfg = read_json(p)
    except OSError as e:
        raise SafetensorsError(f"cannot read {p}: {e.strerror}; re-download it") from None
    except ValueError as e:
        raise SafetensorsError(f"{p} is not valid JSON ({e}); re-download it") from None
    if not isinstance(cfg, dict):
        raise SafetensorsError(f"{p} is a JSON {type(cfg).__name__}, not an object; re-download it")
    for key, least in CONFIG_INTS.items():
        v = cfg.get(key)
        if v is not None and not (is_int(v) and v >= least):
            raise SafetensorsError(f"{p}: {key} is {v!r:.40}, not an integer >= {least}; fix or re-download it")
    arch = cfg.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise SafetensorsError(f"{p}: architectures is {arch!r:.40}, not a list of names; fix or re-download it")
    return cfg


def kv_token_bytes(cfg: dict, kv_dtype: str, tp: int) -> tuple[float, str]:
    """(bytes per token on one rank, where the number comes from)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    known = KNOWN_KV_TOKEN_BYTES.get((arch, kv_dtype))
    if known:
        return known, f"{arch} with {kv_dtype}: measured pool of the reference launcher (2.5 GiB = 774,400 tokens)"
    layers = int(cfg.get("num_hidden_layers") or 0)
    if not layers:
        raise SafetensorsError("config.json has no num_hidden_layers; pass --kv-token-bytes")
    size = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2, "bfloat16": 2, "float16": 2}
    if cfg.get("kv_lora_rank"):  # MLA: the latent is the same on every rank
        if kv_dtype == "fp8_ds_mla":
            return float(FP8_DS_MLA_LAYER_BYTES * layers), f"MLA fp8_ds_mla, {layers} layers x 656 B"
        if kv_dtype not in size:
            raise SafetensorsError(f"unknown KV cache dtype {kv_dtype!r}; use auto, fp8 or fp8_ds_mla")
        rope = cfg.get("qk_rope_head_dim")
        width = int(cfg["kv_lora_rank"]) + (64 if rope is None else int(rope))
        return float(width * size[kv_dtype] * layers), f"MLA, {layers} layers x {width} values x {size[kv_dtype]} B"
    if kv_dtype not in size:
        raise SafetensorsError(f"KV cache dtype {kv_dtype!r} does not apply to this model; use auto or fp8")
    heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // int(cfg.get("num_attention_heads") or 1))
    per_rank_heads = max(heads // tp, 1) if heads >= tp else heads  # fewer KV heads than ranks: replicated
    b = 2 * per_rank_heads * head_dim * size[kv_dtype] * layers
    if not b:
        raise SafetensorsError(f"config.json gives no KV heads or a head size of 0 ({per_rank_heads} heads x {head_dim}); "
                               "pass --kv-token-bytes")
    return float(b), f"{layers} layers x K+V x {per_rank_heads} heads x {head_dim} x {size[kv_dtype]} B"


def mem_available_now() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def analyze(model_dir: str | os.PathLike, *, tp: int = 2, kv_bytes: int = 2_684_354_560, kv_dtype: str = "fp8_ds_mla",
            kv_token_override: float | None = None, max_model_len: int = 600_000, block_size: int = 64,
            engram_dir: str | os.PathLike | None = None, mem_available: int | None = None,
            overhead_bytes: int = 6 * GiB, boot_margin_bytes: int = 12 * GiB) -> Budget:
    """Read every shard header of model_dir (and engram_dir) and compute the budget for tensor parallel ``tp``."""
    ints = {"tp": (tp, 1), "kv_bytes": (kv_bytes, 0), "max_model_len": (max_model_len, 1),
            "block_size": (block_size, 1), "overhead_bytes": (overhead_bytes, 0),
            "boot_margin_bytes": (boot_margin_bytes, 0), "mem_available": (0 if mem_available is None else mem_available, 0)}
    for name, (v, least) in ints.items():
        if not (is_int(v) and v >= least):
            raise SafetensorsError(f"budget: {name} must be an integer >= {least}, got {v!r:.40}")
    if kv_token_override is not None and not (is_number(kv_token_override) and kv_token_override > 0):
        raise SafetensorsError(f"budget: the KV bytes per token must be a finite number > 0, got "
                               f"{kv_token_override!r:.40}")
    if not isinstance(kv_dtype, str):
        raise SafetensorsError(f"budget: kv_dtype must be a name like fp8_ds_mla, got {kv_dtype!r:.40}")
    d = Path(model_dir)
    if not d.is_dir():
        raise SafetensorsError(f"{d} is not a directory; pass the checkpoint folder")
    cfg = read_config(d)
    files = shard_files(d)
    tensors: dict[str, TensorInfo] = index_tensors(files)
    notes = []
    if engram_dir:
        e_files = [f for f in shard_files(engram_dir)]
        e_tensors = {k: v for k, v in index_tensors(e_files).items() if ".engram." in k}
        if not e_tensors:
            notes.append(f"no Engram tensors in {engram_dir}")
        tensors.update(e_tensors)
        files = files + e_files
    if not any(".engram." in n for n in tensors):
        notes.append("no Engram tensors found (pass --engram-dir with the original shards 47/48 to count them)")
    layers = cfg.get("num_hidden_layers")
    total = dict.fromkeys(CLASSES, 0)
    per_rank = dict.fromkeys(CLASSES, 0)
    params = dict.fromkeys(CLASSES, 0)
    for name, t in tensors.items():
        c = classify(name, layers)
        split = 1 if replicated(name) else tp
        total[c] += t.nbytes
        per_rank[c] += math.ceil(t.nbytes / split)
        params[c] += weight_count(t) // split
    if kv_token_override is not None:
        per_tok, src = float(kv_token_override), "--kv-token-bytes"
    else:
        per_tok, src = kv_token_bytes(cfg, kv_dtype, tp)
    blocks = int(kv_bytes // (per_tok * block_size))
    return Budget(tp=tp, shards=len(files), tensors=len(tensors), total=total, per_rank=per_rank,
                  kv_token_bytes=per_tok, kv_token_source=src, kv_pool_bytes=kv_bytes, kv_tokens=blocks * block_size,
                  max_model_len=max_model_len, mem_available=mem_available if mem_available is not None
                  else mem_available_now(), overhead_bytes=overhead_bytes, boot_margin_bytes=boot_margin_bytes,
                  notes=notes, params_per_rank=params, config=cfg)


def weight_count(t: TensorInfo) -> int:
    """Weights a tensor stands for: k*n for an EXL3 trellis [k/16, n/16, 16K], 0 for its scales, else numel."""
    if t.name.endswith(".trellis") and len(t.shape) == 3:
        return t.shape[0] * t.shape[1] * 256
    if t.name.endswith((".suh", ".svh", ".su", ".sv", ".scale")) or "embed_tokens" in t.name:
        return 0  # scales, and the embedding (a row lookup, no matmul work)
    return math.prod(t.shape)


def report(b: Budget) -> str:
    """Plain-text report (the task prints it)."""
    g = lambda x: f"{x / GiB:,.2f} GiB"  # noqa: E731
    lines = [f"{b.shards} shards, {b.tensors} tensors, tensor parallel {b.tp}", "",
             f"{'class':20s} {'checkpoint':>14s} {'per rank':>14s}"]
    for c in CLASSES:
        if b.total[c]:
            extra = "  (read from files on demand, not loaded)" if c == NOT_LOADED else ""
            lines.append(f"{c:20s} {g(b.total[c]):>14s} {g(b.per_rank[c]):>14s}{extra}")
    lines += [f"{'loaded per rank':20s} {'':>14s} {g(b.weights_per_rank):>14s}", "",
              f"KV cache: {b.kv_token_bytes:,.0f} B per token ({b.kv_token_source}); a pool of {g(b.kv_pool_bytes)} "
              f"holds {b.kv_tokens:,} tokens",
              f"context {b.max_model_len:,}: {'fits' if b.context_fits else 'does NOT fit'}"
              + ("" if b.context_fits else f" (needs {g(b.max_model_len * b.kv_token_bytes)} of KV per rank)"),
              f"preflight needs MemAvailable >= {g(b.preflight_needs)} per node (weights + {g(b.boot_margin_bytes)} margin)"]
    if b.mem_available is not None:
        after = b.mem_after_boot
        lines.append(f"MemAvailable now {g(b.mem_available)}; forecast after boot {g(after)} (weights, KV pool, "
                     f"{g(b.overhead_bytes)} runtime overhead)" + ("  <- below zero: will not boot" if after < 0 else ""))
    lines += [f"note: {n}" for n in b.notes]
    return "\n".join(lines)
