"""Helpers for twinspark's own tests and parity checks (importable from any test folder)."""

from __future__ import annotations

import torch


def cuda_reason() -> str | None:
    """None when a kernel test can run here, else the reason it cannot (used to skip with that reason)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine: the kernel part runs with `nox -s parity` on a GPU"
    from twinspark import _ext

    if not _ext.with_cuda():
        return "twinspark was built without CUDA kernels"
    return None


def need_cuda() -> torch.device:
    """The CUDA device for a GPU test's kernel part, called after its reference part has run; without a usable GPU
    it skips the rest of the test with a reason that says the reference part ran."""
    import pytest

    reason = cuda_reason()
    if reason:
        pytest.skip(f"kernel part skipped, reference part ran: {reason}")
    return torch.device("cuda")


def poison_allocator(device, nbytes: int) -> None:
    """Fill the caching allocator's next free block with NaN so an op's torch.empty output starts poisoned:
    elements a kernel forgets to write stay NaN and fail the comparison."""
    t = torch.empty(nbytes // 2 + 1024, dtype=torch.float16, device=device)
    t.fill_(float("nan"))
    del t


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; NaN anywhere gives inf (never passes a tolerance)."""
    g, w = got.double(), want.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return ((g - w).norm() / w.norm().clamp_min(1e-300)).item()
