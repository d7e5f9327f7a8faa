"""Reference for twinspark.ops.exl3_gemm: y = x @ W + bias through twinspark.exl3.reference.linear (fp32),
rounded once to x's dtype."""

from __future__ import annotations

import torch

from twinspark.exl3 import reference as exl3_ref


def exl3_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
              bias: torch.Tensor | None, K: float, codebook: str) -> torch.Tensor:
    """x [..., k] -> [..., n] in x.dtype (the fp32 reference result, rounded once)."""
    return exl3_ref.linear(x, trellis, suh, svh, K, codebook, bias).to(x.dtype)
