"""Small synthetic Engram checkpoints with the real tensor names, dtypes and shard names (tests, benchmarks).

``write_synthetic_checkpoint(dir, head_sizes)`` writes layer 1 into ``model-00047-of-00048.safetensors`` and layer
14 into ``model-00048-of-00048.safetensors`` (``layers.{L}.engram.embed.weight`` F8_E4M3 [rows, 256] and
``layers.{L}.engram.embed.scale`` U8 [rows, 8]), ``model.safetensors.index.json`` and a ``config.json`` holding
``engram_head_sizes``. Shards are streamed in chunks, so multi-GB tables need little memory; safetensors reads
them back (tests check that). Weight bytes are random E4M3 values without NaN codes; scales are E8M0 bytes in
[112, 134] (2^-15 .. 2^7), the magnitude range of trained embeddings.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from twinspark.engram.layout import EngramLayout, is_prime
from twinspark.engram.source import INDEX_NAME, SCALE_BYTES, WEIGHT_BYTES, scale_name, weight_name

SHARD_OF_LAYER = {1: "model-00047-of-00048.safetensors", 14: "model-00048-of-00048.safetensors"}
_CHUNK_ROWS = 1 << 18


def synthetic_head_sizes(rows_per_layer: int, heads: int = 24) -> list[int]:
    """`heads` distinct primes near rows_per_layer/heads (like the real tables: every head a prime slice)."""
    sizes, p = [], max(2, rows_per_layer // heads)
    while len(sizes) < heads:
        if is_prime(p):
            sizes.append(p)
        p += 1
    return sizes


def write_engram_shard(path: str | Path, layers: dict[int, int], rng: np.random.Generator) -> None:
    """One safetensors file holding the Engram tensors of `layers` ({layer: rows}), streamed, temp + rename."""
    path = Path(path)
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for layer, rows in layers.items():
        meta[weight_name(layer)] = {"dtype": "F8_E4M3", "shape": [rows, WEIGHT_BYTES],
                                    "data_offsets": [offset, offset + rows * WEIGHT_BYTES]}
        offset += rows * WEIGHT_BYTES
        meta[scale_name(layer)] = {"dtype": "U8", "shape": [rows, SCALE_BYTES],
                                   "data_offsets": [offset, offset + rows * SCALE_BYTES]}
        offset += rows * SCALE_BYTES
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for rows in layers.values():
            for start in range(0, rows, _CHUNK_ROWS):
                k = min(_CHUNK_ROWS, rows - start)
                # raw 64-bit draws viewed as bytes: ~20x faster than rng.bytes for multi-GB benchmark tables
                w = rng.bit_generator.random_raw(k * WEIGHT_BYTES // 8).view(np.uint8)
                nan = np.equal(w & 0x7F, 0x7F).view(np.uint8)  # E4M3 NaN codes 0x7F/0xFF -> 0x7E/0xFE (finite)
                f.write((w - nan).tobytes())
            for start in range(0, rows, _CHUNK_ROWS):
                k = min(_CHUNK_ROWS, rows - start)
                f.write(rng.integers(112, 135, size=k * SCALE_BYTES, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_synthetic_checkpoint(out_dir: str | Path, head_sizes: dict[int, list[int]] | None = None, *,
                               seed: int = 0) -> EngramLayout:
    """Write shards 47/48, the index and config.json into out_dir; returns the layout (head sizes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if head_sizes is None:
        head_sizes = {1: synthetic_head_sizes(2400), 14: synthetic_head_sizes(2600)}
    layout = EngramLayout({int(k): tuple(v) for k, v in head_sizes.items()})
    rng = np.random.default_rng(seed)
    weight_map = {}
    for layer in layout.layers:
        shard = SHARD_OF_LAYER.get(layer, f"model-engram-layer{layer:02d}.safetensors")
        write_engram_shard(out / shard, {layer: layout.rows(layer)}, rng)
        weight_map[weight_name(layer)] = weight_map[scale_name(layer)] = shard
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = {"model_type": "synthetic-engram", "engram_head_sizes": {str(k): list(v) for k, v in head_sizes.items()}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return layout
