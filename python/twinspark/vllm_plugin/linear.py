"""vLLM linear method for EXL3 layers (Linear, column/row parallel, fused QKV and gate/up, lm_head).

A fused vLLM layer (qkv_proj, gate_up_proj) is several checkpoint linears ("shards", each with its own K, suh
and svh: suh differs per shard, so shards cannot share one input transform). Each shard runs as its own EXL3
GEMM and the outputs are concatenated in vLLM's shard order. Parameters are created empty and filled as tensors
arrive (shapes, hence K, come from the checkpoint), each cut to this rank's slice on arrival;
process_weights_after_loading checks every shard. ``apply`` calls ``torch.ops.twinspark.exl3_gemm`` (the CUDA
kernel on a GPU, its reference elsewhere), or cpu_ops' decoded mode when TWINSPARK_EXL3_DECODED=1.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase

from twinspark.exl3.format import Exl3FormatError
from twinspark.vllm_plugin import cpu_ops
from twinspark.vllm_plugin.parts import SUFFIXES, Cut, Exl3Parts, register_placeholders


def ckpt_names(prefix: str, n_shards: int, packed: dict[str, list[str]]) -> list[str]:
    """Checkpoint names of the shards of vLLM layer `prefix` (qkv_proj -> q_proj, k_proj, v_proj)."""
    head, _, last = prefix.rpartition(".")
    subs = packed.get(last)
    if subs and len(subs) == n_shards:
        return [f"{head}.{s}" if head else s for s in subs]
    return [prefix] if n_shards == 1 else [f"{prefix}[{i}]" for i in range(n_shards)]


def _cuts(layer, sizes: list[int]) -> list[tuple[Cut | None, Cut | None]]:
    """(cut_k, cut_n) per shard for this rank, from the layer's parallel style."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    rank, world = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if isinstance(layer, VocabParallelEmbedding):  # lm_head: vocabulary rows of this rank (padded)
        return [(None, Cut(layer.shard_indices.padded_org_vocab_start_index, sizes[0]))]
    if world == 1:
        return [(None, Cut(0, s)) for s in sizes]
    if isinstance(layer, QKVParallelLinear):
        kv_rank = rank // layer.num_kv_head_replicas
        return [(None, Cut(r * s, s)) for r, s in zip((rank, kv_rank, kv_rank), sizes)]
    if isinstance(layer, ColumnParallelLinear):
        return [(None, Cut(rank * s, s)) for s in sizes]
    if isinstance(layer, RowParallelLinear):
        k = layer.input_size_per_partition
        return [(Cut(rank * k, k), None) for _ in sizes]
    return [(None, Cut(0, s)) for s in sizes]


def _normalize(cut: Cut | None) -> Cut | None:
    # A whole-dimension cut that is not block aligned (e.g. n=100 at TP 1) keeps the padded checkpoint width and
    # trims the output instead.
    if cut is not None and cut.start == 0 and cut.size % 128:
        return None
    return cut


class Exl3LinearMethod(LinearMethodBase):
    """EXL3 linear method, one instance per layer (created by Exl3Config.get_quant_method)."""

    def __init__(self, quant_config, prefix: str):
        self.quant_config, self.prefix = quant_config, prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        sizes = list(output_partition_sizes)
        names = [self.quant_config.checkpoint_name(n)
                 for n in ckpt_names(self.prefix, len(sizes), self.quant_config.packed_modules_mapping)]
        layer.exl3_parts = [Exl3Parts(nm, _normalize(ck), _normalize(cn), self.quant_config.codebook)
                            for nm, (ck, cn) in zip(names, _cuts(layer, sizes))]
        layer.exl3_out_sizes = sizes
        layer.exl3_in_size = input_size_per_partition
        register_placeholders(layer, self._loader)

    def _loader(self, layer, suffix: str):
        qkv = {"q": 0, "k": 1, "v": 2}

        def load(param, loaded_weight, shard_id=None, *args, **kwargs):
            if shard_id is None:
                shard_id = getattr(loaded_weight, "shard_id", None)
            parts = layer.exl3_parts
            if shard_id is None:
                idx = 0
            elif isinstance(shard_id, str) and shard_id in qkv:
                idx = qkv[shard_id]
            elif isinstance(shard_id, int):
                idx = shard_id
            else:
                raise Exl3FormatError(f"{self.prefix}.{suffix}: the exl3 plugin cannot load shard {shard_id!r}")
            if idx >= len(parts) or (shard_id is None and len(parts) > 1):
                raise Exl3FormatError(f"{self.prefix}.{suffix}: shard {shard_id!r} does not fit a layer of "
                                      f"{len(parts)} shards")
            parts[idx].add(suffix, loaded_weight, device=param.device)

        return load

    def process_weights_after_loading(self, layer) -> None:
        device = next((p.device for p in layer.parameters()), None)
        shards = [p.finish() for p in layer.exl3_parts]
        for suffix in SUFFIXES:
            del layer._parameters[suffix]
        del layer.exl3_parts
        layer.exl3_decoded = cpu_ops.use_decoded(device)
        layer.exl3_shapes = []
        for i, s in enumerate(shards):
            def reg(nm, t, i=i):
                layer.register_parameter(f"exl3_{i}_{nm}", Parameter(t.to(device), requires_grad=False))

            if layer.exl3_decoded:
                reg("w_hat", cpu_ops.decode(s.trellis, s.K, s.codebook))
            else:
                reg("trellis", s.trellis)
            reg("suh", s.suh)
            reg("svh", s.svh)
            layer.exl3_shapes.append((s.k, s.n, s.K, s.codebook))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        ys = []
        for i, (k, n, K, codebook) in enumerate(layer.exl3_shapes):
            xi = x2 if x2.shape[-1] == k else torch.nn.functional.pad(x2, (0, k - x2.shape[-1]))
            suh, svh = getattr(layer, f"exl3_{i}_suh"), getattr(layer, f"exl3_{i}_svh")
            if layer.exl3_decoded:
                y = torch.ops.twinspark.exl3_decoded_linear(xi, getattr(layer, f"exl3_{i}_w_hat"), suh, svh)
            else:
                y = _gemm(xi, getattr(layer, f"exl3_{i}_trellis"), suh, svh, K, codebook)
            want = layer.exl3_out_sizes[i]
            ys.append(y if n == want else y[:, :want])
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, y.shape[-1])


def _gemm(x, trellis, suh, svh, K, codebook):
    """The device GEMM: torch.ops.twinspark.exl3_gemm (twinspark.ops.exl3_gemm; bias is added by apply)."""
    return torch.ops.twinspark.exl3_gemm(x, trellis, suh, svh, None, K, codebook)
