"""Reference for twinspark.ops.exl3_reconstruct: W_hat from a trellis (see twinspark.exl3.reference)."""

from __future__ import annotations

import torch

from twinspark.exl3 import reference as exl3_ref


def exl3_reconstruct(trellis: torch.Tensor, K: float, codebook: str, out_dtype: torch.dtype) -> torch.Tensor:
    """float16 W_hat rounded once to out_dtype (fp16: exact; bf16: round to nearest even)."""
    return exl3_ref.inner_weight(trellis, K, codebook).to(out_dtype)
