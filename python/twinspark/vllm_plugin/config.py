"""The ``exl3`` quantization config: chosen by vLLM when config.json has
``quantization_config.quant_method == "exl3"``.

What is EXL3 and what stays dense: for a local checkpoint directory the safetensors headers decide (a module with
``.trellis`` tensors is EXL3, one with a ``.weight`` is dense: an experts-only pack keeps attention dense); without
them every linear layer, the routed experts and the lm_head are EXL3. Always dense by name: router gates
(``mlp.gate``, ``shared_expert_gate``), embeddings, norms, and anything matching a pattern in
``quantization_config.modules_to_not_convert``. K comes from each tensor's trellis shape. The codebook comes from each tensor's marker; when config.json
names one (``codebook``), a tensor whose marker disagrees is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from twinspark.exl3.format import Exl3FormatError
from twinspark.exl3.reference import CODEBOOKS
from twinspark.vllm_plugin.grouped import Exl3GroupedLinearMethod
from twinspark.vllm_plugin.linear import Exl3LinearMethod, ckpt_names
from twinspark.vllm_plugin.moe import Exl3MoEMethod

DENSE_PATTERNS = (
    r"(^|\.)gate$",  # MoE router
    r"shared_expert_gate$",
    r"embed",
    r"norm",
)


def is_dense(prefix: str, extra: list[str]) -> bool:
    return any(re.search(p, prefix) for p in DENSE_PATTERNS) or any(p and p in prefix for p in extra)


@register_quantization_config("exl3")
class Exl3Config(QuantizationConfig):
    """EXL3 (trellis-coded, per-tensor K) checkpoints, served through twinspark's ops."""

    def __init__(self, codebook: str | None = None, bits: float | None = None, head_bits: float | None = None,
                 modules_to_not_convert: list[str] | None = None):
        super().__init__()
        if codebook is not None and codebook not in CODEBOOKS:
            raise ValueError(f"config.json quantization_config.codebook is {codebook!r}; expected one of "
                             f"{', '.join(CODEBOOKS)} (or no codebook key: the per-tensor markers decide)")
        self.codebook, self.bits, self.head_bits = codebook, bits, head_bits
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        # From the checkpoint's safetensors headers (maybe_update_config): module prefixes holding EXL3 tensors
        # and prefixes holding dense `.weight`s. None: no local checkpoint seen, the name patterns decide.
        self.exl3_modules: set[str] | None = None
        self.dense_modules: set[str] = set()
        # The same in the checkpoint's own names (before any model mapper): a DSpark draft layer
        # (model.layers.{L+i}) is looked up as mtp.{i} there (draft_name); num_layers: the backbone's layers.
        self.raw_exl3: set[str] = set()
        self.raw_dense: set[str] = set()
        self.num_layers: int | None = None
        self.o_groups: int | None = None
        self.ckpt_of: dict[str, str] = {}  # vLLM module name -> checkpoint name (apply_vllm_mapper), for messages

    def __repr__(self) -> str:
        return f"Exl3Config(codebook={self.codebook}, bits={self.bits}, head_bits={self.head_bits})"

    @classmethod
    def get_name(cls) -> str:
        return "exl3"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # the kernels build for sm_90a and sm_121a; the CPU path has no capability check

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # config.json's quantization_config is enough

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        from twinspark.vllm_plugin import check_vllm_version

        check_vllm_version(strict=True)
        return cls(codebook=config.get("codebook"), bits=config.get("bits"), head_bits=config.get("head_bits"),
                   modules_to_not_convert=config.get("modules_to_not_convert"))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        self.num_layers = getattr(hf_config, "num_hidden_layers", None)
        self.o_groups = getattr(hf_config, "o_groups", None)
        if os.path.isdir(model_name):
            from twinspark.safetensors_io import SafetensorsError, index_tensors

            try:
                names = list(index_tensors(model_name))  # headers only
            except SafetensorsError as exc:
                raise Exl3FormatError(str(exc)) from None
            self.raw_exl3 = {n.rsplit(".", 1)[0] for n in names if n.endswith(".trellis")}
            self.raw_dense = {n.rsplit(".", 1)[0] for n in names if n.endswith(".weight")}
            self.exl3_modules, self.dense_modules = set(self.raw_exl3), set(self.raw_dense)
            if "DeepseekV41ForCausalLM" in (getattr(hf_config, "architectures", None) or []):
                # vLLM's V4.1 class has no class-level mapper, so configure_quant_config never renames for us
                from twinspark.vllm_plugin.deepseek_v41 import PACKED, name_mapper

                self.packed_modules_mapping = PACKED
                self.apply_vllm_mapper(name_mapper().get_rename_mapper())  # names only, as vLLM passes it

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        """Rename the checkpoint's module prefixes the way the model renames its weights."""
        if self.exl3_modules is None:
            return

        def rename(prefixes: set[str], suffix: str) -> set[str]:
            out = set()
            for p in prefixes:
                mapped = hf_to_vllm_mapper.map_name(f"{p}.{suffix}")
                if mapped is not None:
                    out.add(mapped[: -len(suffix) - 1])
                    self.ckpt_of[mapped[: -len(suffix) - 1]] = p
            return out

        self.exl3_modules = rename(self.exl3_modules, "trellis")
        self.dense_modules = rename(self.dense_modules, "weight")

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of vLLM module `name` (as the error messages should say it)."""
        return self.ckpt_of.get(name, name)

    def stored_groups(self, key: str, raw: bool) -> int:
        """How many output groups layer `key` is stored as (``key.slice.{g}``, DeepSeek V4.1's ``wo_a``); 0 when
        it is stored whole. The count is config.json's ``o_groups`` when it has one, so a missing slice is a load
        error naming it."""
        exl3 = self.raw_exl3 if raw else (self.exl3_modules or set())
        head = key + ".slice."
        found = [int(m[len(head):]) for m in exl3 if m.startswith(head) and m[len(head):].isdigit()]
        if not found:
            return 0
        return self.o_groups or max(found) + 1

    def draft_name(self, prefix: str) -> str | None:
        """The checkpoint name of a DSpark draft module (DeepSeek V4.1: the draft's layers are numbered after the
        backbone's and stored as ``mtp.{i}``; its context combiner is ``mtp.0.main_proj``), else None."""
        m = re.search(r"(?:^|\.)layers\.(\d+)\.(.+)$", prefix)
        if m and self.num_layers is not None and int(m.group(1)) >= self.num_layers:
            return f"mtp.{int(m.group(1)) - self.num_layers}.{m.group(2)}"
        if re.search(r"(?:^|\.)main_proj$", prefix) and "mtp." not in prefix:
            return "mtp.0.main_proj"
        return None

    def is_exl3(self, prefix: str, ckpt_names: list[str], experts: bool = False, raw: bool = False) -> bool:
        """Whether vLLM layer `prefix` (checkpoint modules `ckpt_names`) is EXL3: from the checkpoint's tensors when
        they were indexed (a pack may quantize only the routed experts), else from the name patterns. ``raw``:
        `prefix` and `ckpt_names` are checkpoint names (a draft module, ``draft_name``), not vLLM names."""
        if is_dense(prefix, self.modules_to_not_convert):
            return False
        if self.exl3_modules is None:
            return True
        exl3, dense_set = (self.raw_exl3, self.raw_dense) if raw else (self.exl3_modules, self.dense_modules)
        if experts:
            head = prefix + "."
            if any(m.startswith(head) for m in exl3):
                return True
            return not any(m.startswith(head) for m in dense_set)
        quant = [n for n in ckpt_names if n in exl3]
        dense = [n for n in ckpt_names if n in dense_set]
        if quant and dense:
            raise Exl3FormatError(f"layer {prefix} mixes EXL3 shards ({', '.join(quant)}) with dense ones "
                                  f"({', '.join(dense)}); vLLM fuses them into one layer, so quantize all of them "
                                  f"or none")
        return bool(quant) or not dense

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
        from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        draft = self.draft_name(prefix)
        key, raw = draft or prefix, draft is not None
        if isinstance(layer, ParallelLMHead):
            return Exl3LinearMethod(self, key) if self.is_exl3(key, [key], raw=raw) else None
        if isinstance(layer, LinearBase):
            groups = self.stored_groups(key, raw)
            if groups:
                return Exl3GroupedLinearMethod(self, prefix, self.checkpoint_name(key), groups)
            n_shards = len(getattr(layer, "output_sizes", None) or [0])
            if isinstance(layer, QKVParallelLinear):
                n_shards = 3
            names = ckpt_names(key, n_shards, self.packed_modules_mapping)
            exl3 = self.is_exl3(key, names, raw=raw)
            return Exl3LinearMethod(self, key) if exl3 else UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            if self.is_exl3(key, [], experts=True, raw=raw):
                return Exl3MoEMethod(self, layer.moe_config, prefix)
            return UnquantizedFusedMoEMethod(layer.moe_config)
        return None  # embeddings, attention: dense
