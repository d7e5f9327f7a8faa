"""DeepSeek V4.1 Flash checkpoints in the published EXL3 pack's naming and file layout, for tests and tools.

- ``make_tiny_v41(out_dir)``: a real V4.1 config (``DeepseekV41ForCausalLM``, nested ``text_config``) at tiny
  dimensions (``V41Spec.tiny()``) with random valid EXL3 matrices wherever the pack has EXL3 and native tensors
  where it has native ones, sharded like the pack (``model-0000i-of-0000n.safetensors`` + index), a tokenizer
  trained in-process. Deterministic for a given seed; a few seconds. Writes ``out_dir/exl3``, and
  ``out_dir/engram``: the Engram tables as the original (unquantized) model stores them, which the EXL3 pack does
  not carry (``layers.{L}.engram.embed.weight`` F8_E4M3 [rows, 256] + ``.scale`` [rows, 8], one shard per Engram
  layer, the index and config.json), for ``invoke pack`` and the store-backed Engram of the plugin.
- ``make_shape_only_v41(out_dir)``: the same names at the real dimensions (``V41Spec.real()``, 39 shards, ~197
  GiB of tensor bytes) as sparse files: real headers, no data (reads give zeros). For loading to the weight-shape
  stage, ``invoke budget`` and ``invoke forecast``; takes a few seconds and almost no disk.

Layout source: ``twinspark.v41_layout`` (names, dimensions and K from shared/docs/deepseek-v41.md).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from twinspark.exl3.format import layer_tensors
from twinspark.exl3.layer import random_layer
from twinspark.exl3.reference import words_per_tile
from twinspark.v41_layout import Dense, Linear, V41Spec

REAL_SHARDS = 39
_DT = {"BF16": torch.bfloat16, "F32": torch.float32}
_BYTES = {"BF16": 2, "F32": 4, "F16": 2, "I16": 2, "I32": 4}


def config_json(spec: V41Spec, quant: dict | None) -> dict:
    """config.json of a V4.1 checkpoint: nested text config, a vision config vLLM builds (its tower is not in
    these checkpoints: serve them with ``--limit-mm-per-prompt '{"image": 0}'``)."""
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "text_config": spec.text_config(), "vision_config": {"num_hidden_layers": 1, "hidden_size": 128,
                                                                "num_attention_heads": 2,
                                                                "intermediate_size": 256},
           "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def exl3_quant_config(spec: V41Spec) -> dict:
    lin, _ = spec.tensors()
    bits = sum(m.K * m.k * m.n for m in lin) / sum(m.k * m.n for m in lin)
    return {"quant_method": "exl3", "bits": round(bits, 3), "head_bits": spec.k_head, "mtp_bits": spec.k_mtp,
            "codebook": "mul1"}


def _entries(spec: V41Spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every stored tensor, in file order."""
    lin, den = spec.tensors()
    out = [(d.name, d.dtype, d.shape) for d in den]
    for m in lin:
        out += [(f"{m.name}.trellis", "I16", (m.k // 16, m.n // 16, words_per_tile(m.K))),
                (f"{m.name}.suh", "F16", (m.k,)), (f"{m.name}.svh", "F16", (m.n,)), (f"{m.name}.mul1", "I32", ())]
    return out


def _shards(entries, count: int) -> list[list]:
    """Split entries into `count` runs of about equal bytes (file order kept)."""
    size = lambda e: _BYTES[e[1]] * math.prod(e[2])  # noqa: E731
    total = sum(size(e) for e in entries)
    out, acc = [[] for _ in range(count)], 0
    for e in entries:
        out[min(count - 1, acc * count // max(total, 1))].append(e)
        acc += size(e)
    return [s for s in out if s]


def _write_index(dst: Path, shards: list[list], names: list[str]) -> None:
    weight_map = {e[0]: names[i] for i, s in enumerate(shards) for e in s}
    total = sum(_BYTES[e[1]] * math.prod(e[2]) for s in shards for e in s)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _dense_value(d: Dense, gen: torch.Generator) -> torch.Tensor:
    n = d.name
    if n.endswith("norm.weight"):
        t = 1 + 0.1 * torch.randn(d.shape, generator=gen)
    elif n.endswith("attn_sink"):
        t = torch.randn(d.shape, generator=gen)
    elif ".hc_" in n:
        t = 0.02 * torch.randn(d.shape, generator=gen) + (1.0 if n.endswith("_scale") else 0.0)
    elif n.endswith("gate.bias"):
        t = 0.01 * torch.randn(d.shape, generator=gen)
    else:
        t = torch.randn(d.shape, generator=gen) / math.sqrt(d.shape[-1])
    return t.to(_DT[d.dtype])


def write_engram_tables(dst: Path, spec: V41Spec, cfg: dict, seed: int) -> None:
    """The original model's Engram shards for `spec`'s layers (random E4M3 rows, E8M0 scales), index, config."""
    import numpy as np

    from twinspark.engram.source import INDEX_NAME, scale_name, weight_name
    from twinspark.engram.synth import write_engram_shard

    dst.mkdir(parents=True, exist_ok=True)
    rng, weight_map = np.random.default_rng(seed), {}
    n = len(spec.engram_layers)
    for i, (layer, sizes) in enumerate(spec.engram_head_sizes().items()):
        shard = f"model-{47 + i:05d}-of-{46 + n:05d}.safetensors"
        write_engram_shard(dst / shard, {layer: sum(sizes)}, rng)
        weight_map[weight_name(layer)] = weight_map[scale_name(layer)] = shard
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def make_tiny_v41(out_dir: str | os.PathLike, seed: int = 0, shards: int = 3) -> Path:
    """Write the tiny V4.1 EXL3 checkpoint to ``out_dir/exl3`` and its Engram tables to ``out_dir/engram`` (each
    replaced atomically); return the EXL3 folder."""
    from safetensors.torch import save_file

    from twinspark.tiny import TinySpec, _train_tokenizer, _write_tokenizer

    spec = V41Spec.tiny()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny_v41.", dir=root))
    try:
        gen = torch.Generator().manual_seed(seed)
        tok_spec = TinySpec(vocab_size=spec.vocab, max_position_embeddings=spec.max_position)
        tok = _train_tokenizer(tok_spec, gen)
        lin, den = spec.tensors()
        tensors = {d.name: _dense_value(d, gen) for d in den}
        for m in lin:
            gain = 0.5 if m.name.endswith(("wo_b", "w2")) else 1.0
            tensors.update(layer_tensors(random_layer(m.k, m.n, m.K, "mul1", generator=gen, scale=gain), m.name))
        parts = _shards(_entries(spec), shards)
        names = _shard_names(len(parts))
        for name, part in zip(names, parts):
            save_file({e[0]: tensors[e[0]].contiguous() for e in part}, str(work / name), metadata={"format": "pt"})
        _write_index(work, parts, names)
        cfg = config_json(spec, exl3_quant_config(spec))
        (work / "config.json").write_text(json.dumps(cfg, indent=2))
        (work / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
        _write_tokenizer(tok, work, tok_spec)
        write_engram_tables(work / "engram", spec, config_json(spec, None), seed)
        for sub in ("engram", "exl3"):
            if (root / sub).exists():
                shutil.rmtree(root / sub)
        os.replace(work / "engram", root / "engram")
        os.replace(work, root / "exl3")
        return root / "exl3"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_shape_only_v41(out_dir: str | os.PathLike, spec: V41Spec | None = None, shards: int = REAL_SHARDS) -> Path:
    """Write the shape-only checkpoint (sparse shards: headers, no data) and return its folder."""
    spec = spec or V41Spec.real()
    dst = Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    parts = _shards(_entries(spec), shards)
    names = _shard_names(len(parts))
    for name, part in zip(names, parts):
        header, at = {"__metadata__": {"format": "pt", "twinspark": "shape-only"}}, 0
        for n, dt, shape in part:
            nbytes = _BYTES[dt] * math.prod(shape)
            header[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [at, at + nbytes]}
            at += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=dst)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(blob)) + blob)
                f.truncate(8 + len(blob) + at)  # sparse: no data blocks written
            os.replace(tmp, dst / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _write_index(dst, parts, names)
    (dst / "config.json").write_text(json.dumps(config_json(spec, exl3_quant_config(spec)), indent=2))
    return dst


__all__ = ["Linear", "V41Spec", "config_json", "make_shape_only_v41", "make_tiny_v41"]
