"""EXL3 for DeepSeek V4.1's grouped ``wo_a``: one EXL3 matrix per output group, applied block-diagonally.

The published pack stores ``wo_a`` as ``attn.wo_a.slice.{g}.{trellis,suh,svh,mul1}``, g = 0 .. o_groups-1, each a
(heads*head_dim/o_groups) x o_lora_rank matrix. vLLM builds ``wo_a`` as one ColumnParallelLinear of width
o_groups * o_lora_rank split by group across tensor-parallel ranks (rank r owns groups r*G/tp .. (r+1)*G/tp - 1),
and its forward multiplies group g's slice of the attention output by group g's matrix (``_o_proj``).

Loading: the model's weights mapper turns ``wo_a.slice.{g}.`` into ``wo_a.`` with shard id g (vLLM's stacked
rename), so each tensor reaches this method's loader with its global group; another rank's group is skipped, a
group id outside 0..G-1 is a load error naming the tensor. ``apply_grouped(layer, x)`` takes x as [T, G_local, k]
(any strides) and returns [T, G_local, n] through ``torch.ops.twinspark.exl3_gemm_grouped`` (one launch for all
groups; its reference off the GPU), or the decoded CPU mode (TWINSPARK_EXL3_DECODED=1).
"""

from __future__ import annotations

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase

from twinspark.exl3.format import Exl3FormatError
from twinspark.vllm_plugin import cpu_ops
from twinspark.vllm_plugin.parts import SUFFIXES, Exl3Parts, register_placeholders


class Exl3GroupedLinearMethod(LinearMethodBase):
    """``groups`` EXL3 matrices (all ranks together), this rank's share stacked for one grouped GEMM."""

    def __init__(self, quant_config, prefix: str, ckpt_prefix: str, groups: int):
        self.quant_config, self.prefix, self.ckpt_prefix, self.groups = quant_config, prefix, ckpt_prefix, groups

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        rank, world = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        if self.groups % world:
            raise Exl3FormatError(f"{self.prefix}: {self.groups} output groups do not split over tensor-parallel "
                                  f"size {world}; use a tensor-parallel size that divides {self.groups}")
        local = self.groups // world
        layer.exl3_first_group, layer.exl3_local_groups = rank * local, local
        layer.exl3_group_n = sum(output_partition_sizes) // local
        layer.exl3_group_k = input_size_per_partition  # vLLM sizes wo_a's input as one group's width
        layer.exl3_parts = [Exl3Parts(f"{self.ckpt_prefix}.slice.{rank * local + i}", None, None,
                                      self.quant_config.codebook) for i in range(local)]
        register_placeholders(layer, self._loader)

    def _loader(self, layer, suffix: str):
        def load(param, loaded_weight, shard_id=None, *args, **kwargs):
            g = getattr(loaded_weight, "shard_id", None) if shard_id is None else shard_id
            if not isinstance(g, int) or not 0 <= g < self.groups:
                raise Exl3FormatError(f"tensor {self.ckpt_prefix}.{suffix}: {self.prefix} is stored as one EXL3 "
                                      f"matrix per output group ({self.ckpt_prefix}.slice.{{0..{self.groups - 1}}}."
                                      f"{suffix}), got group {g!r}; re-download the shard holding it")
            local = g - layer.exl3_first_group
            if 0 <= local < layer.exl3_local_groups:
                layer.exl3_parts[local].add(suffix, loaded_weight, device=param.device)

        return load

    def process_weights_after_loading(self, layer) -> None:
        device = next((p.device for p in layer.parameters()), None)
        missing = [p.name for p in layer.exl3_parts if "trellis" not in p.t]
        if missing:
            raise Exl3FormatError(f"tensor {missing[0]}.trellis is missing: {self.prefix} needs one EXL3 matrix per "
                                  f"output group; re-download the shard that holds {missing[0]}")
        from twinspark.ops.exl3_gemm_grouped import stack_layers

        mats = [p.finish() for p in layer.exl3_parts]
        try:
            g = stack_layers(mats, name=self.ckpt_prefix)
        except ValueError as exc:  # names the first group whose K, codebook, k or n differs
            raise Exl3FormatError(f"{self.prefix}: {exc}; re-quantize the layer") from None
        if (mats[0].k, mats[0].n) != (layer.exl3_group_k, layer.exl3_group_n):
            raise Exl3FormatError(f"tensor {mats[0].name} is {mats[0].k}x{mats[0].n}, but {self.prefix} needs "
                                  f"{layer.exl3_group_k}x{layer.exl3_group_n} per group: the checkpoint does not "
                                  f"match config.json")
        for suffix in SUFFIXES:
            del layer._parameters[suffix]
        del layer.exl3_parts
        layer.exl3_decoded = cpu_ops.use_decoded(device)
        layer.exl3_shape = (mats[0].k, mats[0].n, g.K, g.codebook)
        reg = lambda nm, t: layer.register_parameter(nm, Parameter(t.to(device), requires_grad=False))  # noqa: E731
        if layer.exl3_decoded:
            reg("exl3_w_hat", torch.stack([cpu_ops.decode(m.trellis, m.K, m.codebook) for m in mats]))
        else:
            reg("exl3_trellis", g.trellis)
        reg("exl3_suh", g.suh)
        reg("exl3_svh", g.svh)

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        """x [T, G_local, k] -> [T, G_local, n] in x's dtype."""
        k, n, K, codebook = layer.exl3_shape
        if layer.exl3_decoded:
            ys = [torch.ops.twinspark.exl3_decoded_linear(x[:, g], layer.exl3_w_hat[g], layer.exl3_suh[g],
                                                          layer.exl3_svh[g]) for g in range(x.shape[1])]
            return torch.stack(ys, dim=1)
        return torch.ops.twinspark.exl3_gemm_grouped(x, layer.exl3_trellis, layer.exl3_suh, layer.exl3_svh, None, K,
                                                     codebook)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """As a plain linear layer: x [..., G_local * k] (groups side by side) -> [..., G_local * n]."""
        k, n = layer.exl3_shape[:2]
        lead = x.shape[:-1]
        y = self.apply_grouped(layer, x.reshape(-1, layer.exl3_local_groups, k)).reshape(*lead, -1)
        return y if bias is None else y + bias
