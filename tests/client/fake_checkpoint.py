"""Header-only safetensors checkpoints shaped like the real DeepSeek V4.1 Flash EXL3 pack (2.9 bpw, 39 shards):
real headers, sparse files of the right size (no tensor data is written; ext4/tmpfs store no blocks for them)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

HIDDEN, INTER, EXPERTS, VOCAB = 5120, 2304, 384, 129280
LAYERS = 42  # with K2_LAYERS below: ~197 GiB, like the real pack
K2_LAYERS = set(range(0, LAYERS, 4))  # "routed experts 3 (2 on some layers)"


def _exl3(name: str, k: int, n: int, K: int) -> dict:
    return {f"{name}.trellis": ("I16", [k // 16, n // 16, 16 * K]), f"{name}.suh": ("F16", [k]),
            f"{name}.svh": ("F16", [n])}


def tensors() -> dict[str, tuple[str, list[int]]]:
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [VOCAB, HIDDEN]),
                                            "model.norm.weight": ("BF16", [HIDDEN])}
    t.update(_exl3("lm_head", HIDDEN, VOCAB, 6))

    def layer(p: str, routed_k: int) -> None:
        t[f"{p}.input_layernorm.weight"] = ("BF16", [HIDDEN])
        t[f"{p}.post_attention_layernorm.weight"] = ("BF16", [HIDDEN])
        a = f"{p}.self_attn"
        t.update(_exl3(f"{a}.q_a_proj", HIDDEN, 1536, 5))
        t.update(_exl3(f"{a}.q_b_proj", 1536, 128 * 192, 5))
        t.update(_exl3(f"{a}.kv_a_proj_with_mqa", HIDDEN, 576, 5))
        t.update(_exl3(f"{a}.kv_b_proj", 512, 128 * 256, 5))
        t.update(_exl3(f"{a}.o_proj", 128 * 128, HIDDEN, 5))
        t[f"{a}.q_a_layernorm.weight"] = ("BF16", [1536])
        t[f"{a}.kv_a_layernorm.weight"] = ("BF16", [512])
        t.update(_exl3(f"{a}.indexer.wq_b", 1536, 64 * 128, 8))
        t[f"{a}.indexer.wk.weight"] = ("BF16", [128, HIDDEN])
        t[f"{a}.indexer.weights_proj.weight"] = ("BF16", [64, HIDDEN])
        m = f"{p}.mlp"
        t[f"{m}.gate.weight"] = ("BF16", [EXPERTS, HIDDEN])
        t[f"{m}.gate.e_score_correction_bias"] = ("F32", [EXPERTS])
        for e in range(EXPERTS):
            t.update(_exl3(f"{m}.experts.{e}.gate_proj", HIDDEN, INTER, routed_k))
            t.update(_exl3(f"{m}.experts.{e}.up_proj", HIDDEN, INTER, routed_k))
            t.update(_exl3(f"{m}.experts.{e}.down_proj", INTER, HIDDEN, routed_k))
        for w, (k, n) in {"gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}.items():
            t.update(_exl3(f"{m}.shared_experts.{w}", k, n, 4))

    for i in range(LAYERS):
        layer(f"model.layers.{i}", 2 if i in K2_LAYERS else 3)
    layer(f"model.layers.{LAYERS}", 4)  # the MTP block sits after the last layer (DeepSeek layout), K=4
    t[f"model.layers.{LAYERS}.eh_proj.weight"] = ("BF16", [HIDDEN, 2 * HIDDEN])
    return t


def nbytes(dtype: str, shape: list[int]) -> int:
    size = {"I16": 2, "F16": 2, "BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[dtype]
    n = size
    for s in shape:
        n *= s
    return n


def write_shards(out: Path, items: dict[str, tuple[str, list[int]]], n_shards: int, prefix: str = "model") -> list[Path]:
    """Split items in order into n_shards sparse files with real headers; plus the index json."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(items)
    total = sum(nbytes(*items[k]) for k in names)
    per = total / n_shards
    groups: list[list[str]] = [[]]
    acc = 0
    for k in names:
        if acc >= per * len(groups) and len(groups) < n_shards:
            groups.append([])
        groups[-1].append(k)
        acc += nbytes(*items[k])
    paths, weight_map = [], {}
    for i, g in enumerate(groups, 1):
        p = out / f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for k in g:
            dt, shape = items[k]
            header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nbytes(dt, shape)]}
            off += nbytes(dt, shape)
            weight_map[k] = p.name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # sparse: the data region takes no disk blocks
        paths.append(p)
    (out / f"{prefix}.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return paths


def write_v41_pack(out: Path, n_shards: int = 39) -> dict[str, tuple[str, list[int]]]:
    items = tensors()
    write_shards(out, items, n_shards)
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "hidden_size": HIDDEN,
           "num_hidden_layers": LAYERS, "n_routed_experts": EXPERTS, "num_experts_per_tok": 6,
           "moe_intermediate_size": INTER, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "vocab_size": VOCAB,
           "num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(cfg))
    return items


ENGRAM_ROWS = {1: 384_006_168, 14: 384_016_682}


def write_engram_shards(out: Path) -> dict[str, tuple[str, list[int]]]:
    """The original shards 47 and 48: the two Engram tables (fp8 rows + E8M0 scales)."""
    items = {}
    for layer, rows in ENGRAM_ROWS.items():
        items[f"layers.{layer}.engram.embed.weight"] = ("F8_E4M3", [rows, 256])
        items[f"layers.{layer}.engram.embed.scale"] = ("U8", [rows, 8])
    out.mkdir(parents=True, exist_ok=True)
    for i, layer in enumerate(ENGRAM_ROWS, 47):
        sub = {k: v for k, v in items.items() if k.startswith(f"layers.{layer}.")}
        p = write_shards(out / f"tmp{i}", sub, 1)[0]
        p.rename(out / f"model-{i:05d}-of-00048.safetensors")
        (out / f"tmp{i}" / "model.safetensors.index.json").unlink()
        (out / f"tmp{i}").rmdir()
    return items
