"""DeepSeek V4.1 Flash in EXL3 through vLLM 0.32, with plugin mechanisms only (no vLLM file is patched).

``register()`` (this package) registers the two classes below under vLLM's own architecture names
(``DeepseekV41ForCausalLM``, ``DSparkV41DraftModel``). With any quantization other than ``exl3`` they are vLLM's
classes unchanged. With ``exl3`` they take the modules vLLM 0.32 builds dense, or reads around its quant method,
through twinspark's ops (shared/docs/deepseek-v41.md sections 3-4):

| checkpoint | vLLM 0.32 | here |
|---|---|---|
| ``head.{trellis,suh,svh,mul1}`` (K=6) | ``lm_head`` built without a quant config; the mapper knows only ``head.weight`` | ``lm_head`` rebuilt with the quant config; ``head.*`` mapped to it |
| ``attn.wo_a.slice.{g}.*`` (K=5; draft K=4) | ``_o_proj`` reads ``wo_a.weight`` (bmm); no loader rule for slices | stacked rename ``wo_a.slice.{g}`` -> ``wo_a`` shard g; grouped EXL3 method (grouped.py); ``_o_proj``: inverse RoPE, one grouped EXL3 GEMM, ``wo_b`` |
| ``attn.compressor.wkv`` (+ ``wgate``) | built without a quant config, ``torch.mm(x, weight.T)`` | rebuilt with it; the input projections call the module |
| ``attn.indexer.wk`` (K=8) | built without a quant config | rebuilt with it (vLLM calls the module) |

Everything else (attention projections, shared and routed experts, Engram ``wkv``, the draft's ``main_proj``) is
built by vLLM with the quant config already and reaches Exl3Config as is. Whether each module is EXL3 or dense is
read from the checkpoint's headers (Exl3Config.maybe_update_config).

Weights are staged through one reusable pinned buffer on the way to a CUDA device (twinspark.staging), so mmapped shard
pages are never pinned for DMA (GB10 copy-on-writes them otherwise; deepseek-v41.md section 6).

The compressor and indexer input projections run one after another on the current stream (vLLM overlaps them on
aux streams); ``_o_proj``'s inverse RoPE is vLLM's Triton kernel on a GPU and ``inverse_rope`` below elsewhere.
"""

from __future__ import annotations

import contextlib
import re
import types

import torch
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper
from vllm.models.deepseek_v41.nvidia.dspark import DSparkDeepseekV4ForCausalLM
from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

from twinspark.exl3.format import Exl3FormatError
from twinspark.staging import staged
from twinspark.vllm_plugin.config import Exl3Config
from twinspark.vllm_plugin.engram import StoreEngram, check_layout
from twinspark.vllm_plugin.grouped import Exl3GroupedLinearMethod
from twinspark.vllm_plugin.parts import SUFFIXES

_SUFFIX = "(" + "|".join(SUFFIXES) + ")"
_SLICE = re.compile(r"\.wo_a\.slice\.(\d+)\.")
# vLLM's fused modules of V4.1 and the checkpoint linears each packs (its model's packed_modules_mapping)
PACKED = {"gate_up_proj": ["w1", "w3"], "fused_wqa_wkv": ["wq_a", "wkv"], "fused_wkv_wgate": ["wkv", "wgate"]}


def exl3_mapper(lm_head: str, groups: int) -> WeightsMapper:
    """Rules the published EXL3 pack needs on top of vLLM's: ``head.*`` to ``lm_head``, and each ``wo_a`` slice
    to ``wo_a`` with its group as the shard id (vLLM's stacked rename; ``apply`` sets ``tensor.shard_id``)."""
    return WeightsMapper(orig_to_new_regex={re.compile(rf"^head\.{_SUFFIX}$"): rf"{lm_head}.\1"},
                         orig_to_new_stacked={f".wo_a.slice.{g}.": (".wo_a.", g) for g in range(groups)})


def homed(model: torch.nn.Module, mapper: WeightsMapper, weights):
    """mapper.apply(weights), refusing an EXL3 tensor whose module the model does not have (one sentence naming
    it, instead of vLLM's list of every parameter). A module's home is itself, the fused module vLLM packs it
    into (packed_modules_mapping), or for a routed expert the layer's experts module."""
    modules = {n for n, _ in model.named_modules()}

    def has_home(path: str) -> bool:
        head, _, last = path.rpartition(".")
        if path in modules or any(last in subs and f"{head}.{fused}" in modules for fused, subs in PACKED.items()):
            return True
        m = re.match(r"(.*\.experts)\.\d+\.w[123]$", path)
        return bool(m) and m.group(1) in modules

    for name, t in weights:
        for out_name, data in mapper.apply([(name, t)]):
            path, _, suffix = out_name.rpartition(".")
            if suffix in SUFFIXES and not has_home(path):
                raise Exl3FormatError(f"tensor {name} has no home in {type(model).__name__} (it maps to "
                                      f"{out_name}, a module this model does not have): the checkpoint does not "
                                      f"match config.json, or this vLLM version builds the model differently")
            yield out_name, data


def inverse_rope(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, n_groups: int,
                 nope_dim: int, rope_dim: int) -> torch.Tensor:
    """Undo interleaved RoPE on the last ``rope_dim`` values of each head and group the heads:
    o [T, heads, head_dim] -> [T, n_groups, heads / n_groups * head_dim] in o's dtype (float32 math, the same
    rotation as vLLM's fused_inv_rope_fp8_quant with quantize=False)."""
    x = o.float()
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    half = rope_dim // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    even, odd = x[..., nope_dim::2], x[..., nope_dim + 1::2]
    rot = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    x = torch.cat((x[..., :nope_dim], rot), dim=-1)
    return x.to(o.dtype).reshape(o.shape[0], n_groups, -1)


def _o_proj(self, attn_out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Attention output -> inverse RoPE -> grouped EXL3 wo_a (one launch) -> wo_b."""
    o = attn_out[:, : self.n_local_heads, :]
    cache = self.rotary_emb.cos_sin_cache
    if o.is_cuda:
        from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant

        x, _ = fused_inv_rope_fp8_quant(o, positions, cache, n_groups=self.n_local_groups,
                                        heads_per_group=self.n_local_heads // self.n_local_groups,
                                        nope_dim=self.nope_head_dim, rope_dim=self.rope_head_dim,
                                        quantize=False)
    else:
        x = inverse_rope(o, positions, cache, self.n_local_groups, self.nope_head_dim, self.rope_head_dim)
    z = self.wo_a.quant_method.apply_grouped(self.wo_a, x)
    return self._wo_b_proj(z.flatten(1))


def _input_projections(self, hidden_states: torch.Tensor):
    """fused_wqa_wkv, the compressor's score (its EXL3 module, float32 out as vLLM's torch.mm gives) and the
    indexer's weights, on the current stream."""
    qr_kv = self._fused_wqa_wkv_gemm(hidden_states)
    kv_score = None if self.compressor is None else self.compressor.fused_wkv_wgate(hidden_states).float()
    weights = None if self.indexer is None else self.indexer.weights_proj(hidden_states)[0]
    return qr_kv, kv_score, weights


def adopt_attention(attn, qc: Exl3Config) -> None:
    """Give one V4.1 attention layer its EXL3 modules and forward paths (see the module table)."""
    if isinstance(attn.wo_a.quant_method, Exl3GroupedLinearMethod):
        attn._o_proj = types.MethodType(_o_proj, attn)
    comp = attn.compressor
    if comp is not None:
        old = comp.fused_wkv_wgate
        comp.fused_wkv_wgate = MergedColumnParallelLinear(old.input_size, list(old.output_sizes), bias=False,
                                                          return_bias=False, quant_config=qc, disable_tp=True,
                                                          prefix=old.prefix)
        attn._run_parallel_input_projections = types.MethodType(_input_projections, attn)
    idx = attn.indexer
    if idx is not None and hasattr(idx, "wk"):
        old = idx.wk
        idx.wk = ReplicatedLinear(old.input_size, old.output_size, bias=False, quant_config=qc, prefix=old.prefix)


@contextlib.contextmanager
def _store_engram():
    """While vLLM's V4.1 model builds its decoder layers, their Engram class is StoreEngram (engram.py): the
    tables come from twinspark's store and vLLM's pinned tables are never allocated (nothing else changes)."""
    import vllm.models.deepseek_v41.nvidia.model as v41

    saved, v41.Engram = v41.Engram, StoreEngram
    try:
        yield
    finally:
        v41.Engram = saved


def _model_device(model: torch.nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)


class Exl3DeepseekV41ForCausalLM(DeepseekV41ForCausalLM):
    """vLLM's DeepSeek V4.1 (VL wrapper) serving the published EXL3 pack."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        qc = vllm_config.quant_config
        if not isinstance(qc, Exl3Config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.exl3 = False
            return
        check_layout(vllm_config.model_config.hf_config)
        with _store_engram():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.exl3 = True
        cfg = self.config
        self.hf_to_vllm_mapper = self.hf_to_vllm_mapper | exl3_mapper("language_model.lm_head", cfg.o_groups)
        lm = self.language_model
        if isinstance(lm.lm_head, ParallelLMHead):
            lm.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config=qc,
                                        prefix=f"{prefix + '.' if prefix else ''}language_model.lm_head")
        for layer in lm.model.layers:
            if hasattr(layer, "attn"):
                adopt_attention(layer.attn, qc)

    def load_weights(self, weights):
        """vLLM's wrapper load (map, sort by name, load) with the pinned staging after the sort: the sort keeps
        every mapped tensor alive, so staging before it would hand all of them one buffer."""
        if not self.exl3:
            return super().load_weights(weights)
        mapped = sorted(homed(self, self.hf_to_vllm_mapper, weights), key=lambda x: x[0])
        loaded = AutoWeightsLoader(self).load_weights(staged(mapped, _model_device(self)))
        self._weights_finalized = True  # the child's load_weights ran its post-load step (vLLM's wrapper does too)
        return loaded


def name_mapper() -> WeightsMapper:
    """How the wrapper renames checkpoint names, plus the EXL3 rules (o_groups is not known here: 64 covers any
    count; only stored slices ever match). Exl3Config renames its module sets with it (maybe_update_config)."""
    from vllm.models.deepseek_v41.nvidia.vl_model import _make_deepseek_v4_vl_weights_mapper

    return _make_deepseek_v4_vl_weights_mapper("fp4", "weight_scale_inv") | exl3_mapper("language_model.lm_head", 64)


class Exl3DSparkV41ForCausalLM(DSparkDeepseekV4ForCausalLM):
    """vLLM's DSpark draft of V4.1 (``mtp.{i}.*``) with grouped EXL3 ``wo_a`` (its lm_head is the target's)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        qc = vllm_config.quant_config
        self.exl3 = isinstance(qc, Exl3Config)
        if self.exl3:
            for layer in self.model.layers:
                adopt_attention(layer.attn, qc)

    def load_weights(self, weights):
        if not self.exl3:
            return super().load_weights(weights)
        def renamed():
            for name, t in staged(weights, _model_device(self)):
                m = _SLICE.search(name)
                if m:
                    name = name[: m.start()] + ".wo_a." + name[m.end():]
                    t.shard_id = int(m.group(1))  # a group outside 0..o_groups-1 is named by the loader
                yield name, t

        return super().load_weights(renamed())
