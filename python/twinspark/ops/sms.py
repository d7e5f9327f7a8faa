"""The SM count the launch plans of exl3_gemm, exl3_gemm_grouped and exl3_moe size their grids for.

By default a device's multiprocessor count. A stream of a green context (``torch.cuda.green_contexts``) runs on
fewer SMs while the device still reports all of them, so plans made for the device's count would queue several
waves there: inside ``limit(n)`` (or with ``TWINSPARK_SM_COUNT=n`` in the environment, read once per process) every
plan is made for ``n`` SMs. Used by bench/bench_decode_step.py to run a GB10-sized GPU (48 SMs) on an H200. Plans are
cached by SM count, so calls in and out of a limit never share one. (The plans' other inputs: ``twinspark.ops.plans``.)
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

ENV = "TWINSPARK_SM_COUNT"
_LIMITS: list[int] = []


@functools.cache
def device_sms(index: int) -> int:
    """Multiprocessors the device reports (a green context does not change it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _checked(n, what: str) -> int:
    try:
        value = int(str(n).strip())
    except ValueError:
        value = 0
    if value < 1 or value > 1024:
        raise ValueError(f"{what} must be a number of SMs from 1 to 1024, got {n!r:.40}")
    return value


def from_env(environ=None) -> int | None:
    """$TWINSPARK_SM_COUNT of ``environ`` (default: this process's environment) as a number of SMs; None when unset."""
    env = (os.environ if environ is None else environ).get(ENV, "").strip()
    return _checked(env, ENV) if env else None


@functools.cache
def _env_sms() -> int | None:
    return from_env()  # once per process (an error is raised again at every call, not kept)


def sm_count(index: int) -> int:
    """The SM count plans on device ``index`` are made for: the innermost ``limit``, else $TWINSPARK_SM_COUNT (read
    once per process), else the device's own."""
    if _LIMITS:
        return _LIMITS[-1]
    return _env_sms() or device_sms(index)


@contextlib.contextmanager
def limit(n: int):
    """Plans made inside are sized for ``n`` SMs (run the calls on a stream that has that many, e.g. a green
    context's; capture a CUDA graph on that stream too: a graph captured elsewhere replays on every SM)."""
    _LIMITS.append(_checked(n, "sms.limit"))
    try:
        yield
    finally:
        _LIMITS.pop()


__all__ = ["ENV", "device_sms", "from_env", "limit", "sm_count"]
