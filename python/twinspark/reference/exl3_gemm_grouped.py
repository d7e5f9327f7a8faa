"""Reference for twinspark.ops.exl3_gemm_grouped: y[..., g, :] = x[..., g, :] @ W_g + bias_g for every group g,
each through the exl3_gemm reference (fp32, rounded once to x's dtype)."""

from __future__ import annotations

import torch

from twinspark.reference.exl3_gemm import exl3_gemm


def exl3_gemm_grouped(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                      bias: torch.Tensor | None, K: float, codebook: str) -> torch.Tensor:
    """x [..., G, k], trellis [G, k/16, n/16, 16*K], suh [G, k], svh [G, n], bias [G, n] or None -> [..., G, n]."""
    return torch.stack([exl3_gemm(x[..., g, :], trellis[g], suh[g], svh[g], None if bias is None else bias[g], K,
                                  codebook) for g in range(trellis.shape[0])], dim=-2)
