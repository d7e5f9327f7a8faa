"""The compiled module and the one place that decides CUDA kernel vs reference."""

from __future__ import annotations

import functools
import os

try:
    from twinspark import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # running from a source tree that was never built
    _C = None
    _IMPORT_ERROR = exc


class NotBuiltError(RuntimeError):
    """The extension has no kernel image for the GPU an op was called on."""


def module():
    """The compiled module; raises a clear error when the package was never built."""
    if _C is None:
        raise ImportError(
            f"twinspark._C is not built ({_IMPORT_ERROR}); install the package with "
            "'pip install .' (or 'pip install --no-build-isolation -e .' for development)"
        )
    return _C


def built_archs() -> list[str]:
    """CUDA targets inside the module, e.g. ['90a', '121a']; [] for a CPU-only build."""
    return list(_C.built_archs()) if _C is not None else []


def with_cuda() -> bool:
    return _C is not None and bool(_C.with_cuda)


@functools.cache
def force_reference() -> bool:
    """TWINSPARK_FORCE_REFERENCE=1 sends every op to its PyTorch reference (debugging, A/B checks). Read once per
    process, on the first op call: set it before."""
    return os.environ.get("TWINSPARK_FORCE_REFERENCE", "0") not in ("", "0", "false", "False")


@functools.cache
def _check_device(index: int) -> None:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    sm = f"{major}{minor}"
    archs = built_archs()
    rebuild = f"rebuild with TWINSPARK_CUDA_ARCHS={sm}a pip install ." if major >= 9 else (
        f"rebuild with TWINSPARK_CUDA_ARCHS={sm} pip install ."
    )
    if not with_cuda():
        raise NotBuiltError(f"twinspark was not built for sm_{sm} (this build has no CUDA kernels); {rebuild}")
    if not _C.device_has_image(index):
        raise NotBuiltError(
            f"twinspark was not built for sm_{sm} (built for: {', '.join('sm_' + a for a in archs)}); {rebuild}"
        )


def use_kernel(*tensors) -> bool:
    """True when the op should run its CUDA kernel: inputs on a CUDA device, a build for that device, and no
    TWINSPARK_FORCE_REFERENCE. CPU tensors always take the reference. A CUDA tensor on a GPU this build has no
    code for raises NotBuiltError ("twinspark was not built for sm_XX; rebuild with ...")."""
    first = next((t for t in tensors if t is not None), None)
    if first is None or not first.is_cuda or force_reference():
        return False
    _check_device(first.device.index if first.device.index is not None else 0)
    return True


def stream_ptr(device) -> int:
    import torch

    return torch.cuda.current_stream(device).cuda_stream
