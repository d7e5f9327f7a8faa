"""DeepSeek V4.1's Engram tables served by twinspark's row store inside vLLM 0.32 (shared/docs/engram.md).

vLLM's ``Engram`` module (vllm/models/deepseek_v41/common/engram.py) keeps each rank's share of a table (~47 GiB
per layer per rank) in pinned host memory and reads it with a Triton UVA lookup. The EXL3 pack does not carry the
tables at all (they are in the original model's shards 47/48), and vLLM skips its missing-weights check for
quantized models, so without this module a deployment would serve with uninitialised tables.

What is ours and what stays vLLM's: the model subclass (deepseek_v41.py) builds its decoder layers with
``StoreEngram``, vLLM's ``Engram`` with one factory replaced: the table (``embed_tokens``) is a
``StoreEngramEmbedding`` with no parameters, whose ``lookup`` reads the rank's rows through
``twinspark.engram.EngramStore`` (a per-rank pack file from ``invoke pack``, or the original shards) and
dequantizes them with twinspark's kernel, graph-capturable on a GPU (``EngramStaging.fetch``). Hashing, the head
all-gather, ``wkv`` (EXL3 through the quant config) and the gate stay vLLM's.

Settings (environment of the vLLM processes; the deploy suite sets them from ENGRAM_* in its config):
- ``TWINSPARK_ENGRAM_PACK_DIR``: folder of pack files ``engram-layerLL-rankRofW.tspack`` (preferred: one read
  per row, local NVMe).
- ``TWINSPARK_ENGRAM_DIR``: the original shards 47/48 with their index (used where a layer has no pack file).
- ``TWINSPARK_ENGRAM_CACHE_GIB`` (0), ``TWINSPARK_ENGRAM_THREADS`` (16), ``TWINSPARK_ENGRAM_QUEUE_DEPTH`` (32).

At construction every Engram layer of the rank gets its table checked (pack header, checksum, layer, row range and
size against this rank's share; or the shards' dtype and shape) or the load stops with one sentence naming the
layer, the file and what to run. The host memory each table costs is logged: the store's cache and I/O buffers
plus the pinned staging.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.models.deepseek_v41.common.engram import Engram

from twinspark.engram.errors import EngramError
from twinspark.engram.layout import EngramLayout

_log = logging.getLogger("twinspark.vllm_plugin")
PACK_DIR, SHARD_DIR = "TWINSPARK_ENGRAM_PACK_DIR", "TWINSPARK_ENGRAM_DIR"


@dataclass(frozen=True)
class EngramSettings:
    pack_dir: Path | None = None
    shard_dir: Path | None = None
    cache_gib: float = 0.0
    threads: int = 16
    queue_depth: int = 32

    @classmethod
    def from_env(cls) -> EngramSettings:
        env = os.environ

        def num(name, cast, default):
            raw = env.get(name, "")
            try:
                return cast(raw) if raw.strip() else default
            except ValueError:
                kind = "whole number" if cast is int else "number"
                raise EngramError(f"{name}={raw!r:.40} is not a {kind}; set it to a {kind} (default {default})") from None

        path = lambda name: Path(env[name]) if env.get(name, "").strip() else None  # noqa: E731
        return cls(path(PACK_DIR), path(SHARD_DIR), num("TWINSPARK_ENGRAM_CACHE_GIB", float, 0.0),
                   num("TWINSPARK_ENGRAM_THREADS", int, 16), num("TWINSPARK_ENGRAM_QUEUE_DEPTH", int, 32))


def open_store(layer: int, rows: tuple[int, int], table_rows: int, rank: int, world: int, s: EngramSettings):
    """The EngramStore of this rank's rows [first, end) of `layer`: its pack file when PACK_DIR has one (checked
    against exactly this share), else the original shards in SHARD_DIR; anything else stops the load."""
    from twinspark.engram import EngramStore
    from twinspark.engram.pack import PackHeader, pack_name

    kw = dict(threads=s.threads, queue_depth=s.queue_depth, cache_gib=s.cache_gib)
    first, end = rows
    if s.pack_dir is not None:
        path = s.pack_dir / pack_name(layer, rank, world)
        if path.exists() or s.shard_dir is None:
            expect = PackHeader(layer=layer, first_row=first, last_row=end - 1, table_rows=table_rows)
            return EngramStore.from_pack(path, expect, **kw), str(path)
    if s.shard_dir is not None:
        store = EngramStore.from_checkpoint(s.shard_dir, layer, (first, end), **kw)
        if store.end_row - store.first_row != end - first:
            raise EngramError(f"Engram layer {layer}: {s.shard_dir} does not hold rows [{first}, {end})")
        return store, str(s.shard_dir)
    raise EngramError(f"DeepSeek V4.1 Engram layer {layer} has no table for rank {rank}: the EXL3 pack does not carry "
                      f"the tables; set {PACK_DIR} to the pack files of `invoke pack` (or {SHARD_DIR} to the original "
                      f"model's shards 47/48) before starting vLLM")


class StoreEngramEmbedding(torch.nn.Module):
    """Stands in for vLLM's ParallelEngramEmbedding (same attributes Engram reads; no parameters): this rank's
    whole hash heads, rows read from files by an EngramStore."""

    dp_size = 1
    _packed = None

    def __init__(self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...], layer: int,
                 settings: EngramSettings, max_tokens: int):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        super().__init__()
        self.num_embeddings, self.dim, self.block_size, self.layer = num_embeddings, dim, 32, layer
        # On a GPU, vLLM's Engram then runs the lookup on its prefetch stream (the path it takes for its own
        # host-memory tables) and waits for it only at this layer: the reads overlap the layers before. On a CPU
        # it looks up inline.
        self.cpu_offload = torch.cuda.is_available()
        self.n_hash_cols = len(head_sizes)
        self.tp_size, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if self.n_hash_cols % self.tp_size:
            raise EngramError(f"Engram layer {layer}: {self.n_hash_cols} hash heads do not split over tensor "
                              f"parallel {self.tp_size}; ranks own whole heads")
        self.part_n_hash_cols = self.n_hash_cols // self.tp_size
        self.head_start = rank * self.part_n_hash_cols
        self.vocab_start_idx = sum(head_sizes[: self.head_start])
        self.vocab_end_idx = sum(head_sizes[: self.head_start + self.part_n_hash_cols])
        if dim != 256:
            raise EngramError(f"Engram layer {layer}: rows of {dim} values; twinspark's row store serves the "
                              "published 256-value rows (engram.md)")
        self.store, self.source = open_store(layer, (self.vocab_start_idx, self.vocab_end_idx),
                                             sum(head_sizes), rank, self.tp_size, settings)
        self.max_rows = max_tokens * self.part_n_hash_cols
        self._staging: dict[int, object] = {}  # one pinned staging buffer per CUDA stream
        _log.info("twinspark Engram layer %d rank %d: rows [%d, %d) from %s (%s, %d threads x queue depth %d); "
                  "host memory %.1f MiB (cache + I/O buffers) + %.1f MiB pinned staging", layer, rank,
                  self.vocab_start_idx, self.vocab_end_idx, self.source, self.store.io_path, self.store.threads,
                  self.store.queue_depth, self.store.host_bytes / 2**20, self.staging_bytes / 2**20)

    @property
    def staging_bytes(self) -> int:
        from twinspark.engram.store import staging_pinned_bytes

        return staging_pinned_bytes(self.max_rows) if torch.cuda.is_available() else 0

    def collapse_huge_pages(self) -> None:  # vLLM calls it after load with use_thp; nothing is resident here
        pass

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """indices [T, n_hash_cols] global row ids (-1 dead) -> out [T, part_n_hash_cols, dim] bf16, this rank's
        heads (ids outside its rows give zero rows)."""
        ids = indices[:, self.head_start: self.head_start + self.part_n_hash_cols].reshape(-1)
        flat = out.view(-1, self.dim)
        if not ids.numel():
            return
        if ids.is_cuda:
            stream = torch.cuda.current_stream(ids.device).cuda_stream
            if stream not in self._staging:
                self._staging[stream] = self.store.staging(self.max_rows)
            self._staging[stream].fetch(ids.contiguous(), out=flat)
        else:
            from twinspark.ops import engram_dequant

            weight, scale = self.store.lookup(ids.contiguous())
            flat.copy_(engram_dequant(weight, scale))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_gather

        out = torch.empty(indices.shape[0], self.part_n_hash_cols, self.dim, dtype=torch.bfloat16,
                          device=indices.device)
        self.lookup(indices, out)
        return out if self.tp_size == 1 else tensor_model_parallel_all_gather(out, dim=1)


class StoreEngram(Engram):
    """vLLM's Engram with its table from twinspark's store (the only change: ``_create_embedding``)."""

    def _create_embedding(self, layout, layer_hash_index):
        from vllm.config import get_current_vllm_config

        layer = layout.layer_ids[layer_hash_index]
        sizes = tuple(s for order in layout.primes[layer_hash_index] for s in order)
        max_tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
        return StoreEngramEmbedding(layout.num_embeddings[layer_hash_index], layout.head_dim, sizes, layer,
                                    EngramSettings.from_env(), max_tokens)


def check_layout(hf_config) -> None:
    """vLLM's prime walk and twinspark's (engram/layout.py, which `invoke pack` uses) must agree on every head:
    the config's Engram fields are checked (types, bounds) and its row counts recomputed."""
    if not getattr(hf_config, "engram_layer_ids", None):
        return
    fields = {k: getattr(hf_config, k, None) for k in ("engram_vocab_size", "engram_n_heads", "engram_max_ngram_size")}
    fields |= {k: list(getattr(hf_config, k, None) or []) for k in ("engram_layer_ids", "engram_num_embeddings")}
    EngramLayout.from_dict(fields, "config.json")
