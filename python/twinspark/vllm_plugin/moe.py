"""vLLM MoE method for EXL3 routed experts (vLLM's RoutedExperts / FusedMoE layer).

Checkpoints store each expert as three linears ``{layer}.{e}.{gate,up,down}_proj.*`` (exl3-format.md); vLLM's
expert loader maps them to ``w13_*`` (gate = shard w1, up = w3) and ``w2_*`` with the expert id. Tensor
parallelism splits the intermediate dimension (moe_layout.shard_intermediate: gate/up column tiles + svh slice,
down row tiles + suh slice). After loading, the experts become twinspark.moe_layout's stacked layout and
``apply`` calls ``twinspark.ops.exl3_moe`` (torch.ops.twinspark.exl3_moe: the CUDA kernel on a GPU, its reference
elsewhere), or the decoded mode of cpu_ops when TWINSPARK_EXL3_DECODED=1. Routed output is this rank's partial sum: vLLM's MoE runner all-reduces it.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

from twinspark.exl3.format import Exl3FormatError
from twinspark.vllm_plugin import cpu_ops
from twinspark.vllm_plugin.parts import SUFFIXES, Cut, Exl3Parts, register_placeholders

_PROJ = {"w1": 0, "w3": 1, "w2": 2}  # moe_layout GATE, UP, DOWN


class Exl3MoEMethod(FusedMoEMethodBase):
    """EXL3 routed experts, one instance per MoE layer."""

    def __init__(self, quant_config, moe_config, prefix: str):
        super().__init__(moe_config)
        self.quant_config, self.prefix = quant_config, prefix

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        act = getattr(getattr(layer, "activation", None), "value", "silu")
        if act != "silu":
            raise NotImplementedError(f"{self.prefix}: exl3 routed experts support the silu activation "
                                      f"(SiLU(gate) * up), this layer uses {act}")
        inter = intermediate_size_per_partition
        rank = self.moe.tp_rank if self.moe.tp_size > 1 else 0
        names = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
        cut = Cut(rank * inter, inter) if self.moe.tp_size > 1 else None
        layer.exl3_hidden, layer.exl3_inter = hidden_size, inter
        layer.exl3_parts = {}
        for e in range(num_experts):
            for proj, nm in enumerate(names):
                ck, cn = (None, cut) if proj < 2 else (cut, None)
                layer.exl3_parts[(e, proj)] = Exl3Parts(f"{self.prefix}.{e}.{nm}", ck, cn,
                                                        self.quant_config.codebook)
        for group in ("w13", "w2"):
            register_placeholders(layer, self._loader, f"{group}_")

    def _loader(self, layer, suffix: str):
        def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, return_success=False,
                 **kwargs):
            if shard_id not in _PROJ or expert_id is None:
                raise Exl3FormatError(f"{weight_name}: the exl3 plugin expects per-expert gate/up/down tensors "
                                      f"(shard w1/w3/w2 with an expert id), got shard {shard_id!r}")
            local = int(expert_id)
            mapper = getattr(layer, "_map_global_expert_id_to_local_expert_id", None)
            if mapper is not None:
                local = mapper(local)
            if local < 0:  # another rank's expert (expert parallelism)
                return False if return_success else None
            layer.exl3_parts[(local, _PROJ[shard_id])].add(suffix, loaded_weight, device=param.device)
            return True if return_success else None

        return load

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        from twinspark import moe_layout

        device = next((p.device for p in layer.parameters()), None)
        num_experts = 1 + max(e for e, _ in layer.exl3_parts)
        triples = [[layer.exl3_parts[(e, p)].finish() for p in range(3)] for e in range(num_experts)]
        codebooks = {m.codebook for t in triples for m in t}
        if len(codebooks) > 1:
            odd = next(m for t in triples for m in t if m.codebook != triples[0][0].codebook)
            raise Exl3FormatError(f"tensor {odd.name} uses codebook {odd.codebook} while "
                                  f"{triples[0][0].name} uses {triples[0][0].codebook}: all experts of one "
                                  f"layer must share a codebook; re-quantize the layer")
        for group in ("w13", "w2"):
            for suffix in SUFFIXES:
                del layer._parameters[f"{group}_{suffix}"]
        del layer.exl3_parts
        try:
            experts = moe_layout.from_layers([tuple(t) for t in triples], first_expert=0, device=device)
        except moe_layout.MoeLayoutError as exc:
            raise Exl3FormatError(f"{self.prefix}: {exc}") from None
        layer.exl3_decoded = cpu_ops.use_decoded(device)
        layer.exl3_codebook, layer.exl3_max_words = experts.codebook, experts.max_words
        layer.exl3_words13, layer.exl3_words2 = experts.words13, experts.words2  # rate kernels where uniform
        reg = lambda nm, t: layer.register_parameter(nm, Parameter(t.to(device), requires_grad=False))  # noqa: E731
        for nm in ("suh13", "svh13", "suh2", "svh2"):
            reg(f"exl3_{nm}", getattr(experts, nm))
        if layer.exl3_decoded:
            hat = lambda m: cpu_ops.decode(m.trellis, m.K, m.codebook)  # noqa: E731
            reg("exl3_w13_hat", torch.stack([torch.stack([hat(g), hat(u)]) for g, u, _ in triples]))
            reg("exl3_w2_hat", torch.stack([hat(d) for _, _, d in triples]))
        else:
            for nm in ("trellis", "offsets", "words"):
                reg(f"exl3_{nm}", getattr(experts, nm))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        limit = getattr(layer, "swiglu_limit", None)
        first = 0
        if layer.exl3_decoded:
            return torch.ops.twinspark.exl3_decoded_moe(
                x, topk_ids, topk_weights, layer.exl3_w13_hat, layer.exl3_w2_hat, layer.exl3_suh13,
                layer.exl3_svh13, layer.exl3_suh2, layer.exl3_svh2, first, limit)
        return torch.ops.twinspark.exl3_moe(
            x, topk_ids, topk_weights, layer.exl3_trellis, layer.exl3_offsets, layer.exl3_words,
            layer.exl3_suh13, layer.exl3_svh13, layer.exl3_suh2, layer.exl3_svh2, first,
            layer.exl3_max_words, layer.exl3_words13, layer.exl3_words2, layer.exl3_codebook, "silu", limit)
