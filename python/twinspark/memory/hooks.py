"""vLLM worker hooks (installed by the plugin's register(), no edits of vLLM's files): memory lines per phase,
allocator release between long prefill chunks, optional page-cache drop after the weights are loaded.

The hooks wrap methods of vLLM's worker classes, so they are tied to the vLLM version they were written for:
install() refuses any other version at start-up with a clear message (TWINSPARK_MEMORY_HOOKS=0 starts without
them).

Internal variables, set for every rank by the deploy suite (twinspark.deploy.vllm_args.rank_env):
TWINSPARK_DROP_PAGE_CACHE=1 drops the page cache of the model's files (TWINSPARK_MODEL_DIR) once the weights are
loaded; the release policy's thresholds (twinspark.memory.policy.ReleasePolicy.from_env)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os

from twinspark.memory import memlog
from twinspark.memory.meminfo import sample
from twinspark.memory.policy import ReleasePolicy

WRITTEN_FOR_VLLM = ("0.32.0",)  # = twinspark.vllm_plugin.TESTED_VLLM (a test keeps them equal)
# worker method -> the memory line written after it returns
PHASE_AFTER = {
    "load_model": "weights_loaded",
    "determine_available_memory": "profiled",
    "initialize_from_config": "kv_allocated",
    "compile_or_warm_up_model": "graphs_captured",
}
_installed = False


class VllmVersionError(RuntimeError):
    pass


def enabled(env=os.environ) -> bool:
    return env.get("TWINSPARK_MEMORY_HOOKS", "1") not in ("0", "false", "False", "")


def check_version(version: str) -> None:
    base = version.split("+")[0]
    if base not in WRITTEN_FOR_VLLM:
        raise VllmVersionError(
            f"twinspark's memory hooks were written for vLLM {', '.join(WRITTEN_FOR_VLLM)} but this is vLLM "
            f"{version}; install vLLM {WRITTEN_FOR_VLLM[-1]} or start with TWINSPARK_MEMORY_HOOKS=0 (no memory "
            f"lines, no allocator release)")


def release_allocator() -> int:
    """Give cached allocator blocks back to the system; returns the bytes the torch CUDA cache shrank by."""
    gc.collect()
    freed = 0
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            before = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            freed = before - torch.cuda.memory_reserved()
    except Exception:
        pass
    try:  # the CPU-side heap (glibc) too: on a unified-memory node host and GPU share the same pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return freed


def _rank(worker) -> int:
    return int(getattr(worker, "rank", 0) or 0)


def _wrap_phase(cls, name: str, phase: str) -> None:
    original = cls.__dict__[name]

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        inside = self.__dict__.setdefault("_twinspark_inside", set())
        if name in inside:  # a subclass override calling super(): log once, at the outermost level
            return original(self, *args, **kwargs)
        inside.add(name)
        try:
            result = original(self, *args, **kwargs)
        finally:
            inside.discard(name)
        memlog.write(phase, _rank(self))
        if phase == "weights_loaded" and os.environ.get("TWINSPARK_DROP_PAGE_CACHE", "0") == "1":
            from twinspark.memory import pagecache

            pagecache.drop_after_load(_rank(self), os.environ.get("TWINSPARK_MODEL_DIR"))
        return result

    setattr(cls, name, wrapper)


def _wrap_execute(cls) -> None:
    original = cls.__dict__["execute_model"]

    @functools.wraps(original)
    def wrapper(self, scheduler_output, *args, **kwargs):
        out = original(self, scheduler_output, *args, **kwargs)
        policy = self.__dict__.get("_twinspark_policy")
        if policy is None:
            policy = self.__dict__["_twinspark_policy"] = ReleasePolicy.from_env()
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        avail = sample().mem_available
        for action in policy.step(tokens, avail):
            if action == "log_chunk":
                memlog.write("prefill_chunk", _rank(self), tokens=tokens)
            else:
                freed = release_allocator()
                memlog.write("release", _rank(self), tokens=tokens, reason=action, freed=freed)
        return out

    cls.execute_model = wrapper


def worker_classes() -> list[type]:
    classes = []
    from vllm.v1.worker.gpu_worker import Worker

    classes.append(Worker)
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    except ImportError:
        pass
    return classes


def install() -> bool:
    """Install the hooks once per process; returns False when disabled. Raises VllmVersionError on another
    vLLM version, and RuntimeError when a hooked method is gone (the hooks would silently do nothing)."""
    global _installed
    if _installed or not enabled():
        return _installed
    import vllm

    check_version(vllm.__version__)
    classes = worker_classes()
    for name in [*PHASE_AFTER, "execute_model"]:
        if not any(name in c.__dict__ for c in classes):
            raise RuntimeError(f"twinspark memory hooks: vLLM {vllm.__version__} has no worker method {name}; "
                               f"start with TWINSPARK_MEMORY_HOOKS=0")
    for cls in classes:
        for name, phase in PHASE_AFTER.items():
            if name in cls.__dict__:
                _wrap_phase(cls, name, phase)
        if "execute_model" in cls.__dict__:
            _wrap_execute(cls)
    _installed = True
    return True
