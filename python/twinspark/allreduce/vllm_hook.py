"""Route vLLM's tensor-parallel all-reduce through twinspark (the hook the vLLM plugin calls).

Usage, in the plugin after vLLM made its process groups (every TP rank calls it; it is collective)::

    from twinspark.allreduce import vllm_hook
    vllm_hook.install()            # reads configs/allreduce.json (or $TWINSPARK_ALLREDUCE_CONFIG)
    ...
    vllm_hook.uninstall()          # back to vLLM's own all-reduce

``install`` does nothing and returns None unless the config says ``"vllm": {"enabled": true}``
(``TWINSPARK_ALLREDUCE=0`` / ``=1`` in the environment overrides the file). When enabled it makes a
communicator for the TP group (transport from ``vllm.transport``: auto picks CUDA IPC when both ranks share a
host, else the pinned host-memory path with the configured backend), then wraps the TP group's
``device_communicator.all_reduce``: contiguous fp32/fp16/bf16 tensors up to the crossover size go through
twinspark, everything else through the original. Buffers are made here, before vLLM captures CUDA graphs, so
captured decode steps replay the one-shot kernel.
"""

from __future__ import annotations

import os

from twinspark.allreduce.config import AllreduceConfig
from twinspark.reference.allreduce import DTYPES

_installed: dict = {}


def enabled(cfg: AllreduceConfig) -> bool:
    env = os.environ.get("TWINSPARK_ALLREDUCE")
    if env is not None and env != "":
        return env not in ("0", "false", "False", "off")
    return cfg.vllm.enabled


def install(group_coordinator=None, config: AllreduceConfig | None = None):
    """Wrap the TP group's all-reduce; returns the Communicator, or None when disabled or already installed."""
    cfg = config or AllreduceConfig.load()
    if not enabled(cfg):
        return None
    if group_coordinator is None:
        from vllm.distributed.parallel_state import get_tp_group

        group_coordinator = get_tp_group()
    if group_coordinator.world_size == 1 or id(group_coordinator) in _installed:
        return None
    from twinspark.allreduce.communicator import create

    comm = create(group_coordinator.cpu_group, transport=cfg.vllm.transport, config=cfg,
                  device=group_coordinator.device)
    devcomm = group_coordinator.device_communicator
    original = devcomm.all_reduce
    fast = comm.fast

    def all_reduce(input_):
        nbytes = input_.numel() * input_.element_size()
        if (fast is not None and input_.dtype in DTYPES and input_.is_contiguous()
                and input_.device == getattr(fast, "device", input_.device) and nbytes <= comm.crossover_bytes
                and (fast.max_bytes is None or nbytes <= fast.max_bytes)):
            return fast.allreduce(input_)
        return original(input_)

    devcomm.all_reduce = all_reduce
    _installed[id(group_coordinator)] = (group_coordinator, devcomm, original, comm)
    return comm


def uninstall() -> None:
    """Restore every wrapped all-reduce and close the communicators."""
    for _key, (_gc, devcomm, original, comm) in list(_installed.items()):
        devcomm.all_reduce = original
        comm.close()
    _installed.clear()
