"""twinspark.ops.exl3_reconstruct: EXL3 trellis -> W_hat (fp16 or bf16), the inner weight before scales and
Hadamard transforms. Bit-exact with twinspark.exl3.reference.inner_weight."""

from __future__ import annotations

import torch

from twinspark import _ext
from twinspark.exl3.reference import CODEBOOKS, rate_from_last_dim, split_rate
from twinspark.reference.exl3_reconstruct import exl3_reconstruct as _reference

_OUT_DTYPES = (torch.float16, torch.bfloat16)


def _check(trellis: torch.Tensor, K: float, codebook: str, out_dtype: torch.dtype) -> None:
    # Contract: trellis int16 [k/16, n/16, words] contiguous with words = 16*K (16*KA+8 for half rates);
    # codebook in 3inst|mcg|mul1; out_dtype float16 or bfloat16.
    op = "exl3_reconstruct"
    if trellis.dtype != torch.int16:
        raise TypeError(f"{op}: expected trellis to be int16, got {trellis.dtype}")
    if trellis.dim() != 3:
        raise ValueError(f"{op}: expected trellis to be 3-D [k/16, n/16, words], got {trellis.dim()} dims")
    if rate_from_last_dim(trellis.shape[-1]) != K:
        raise ValueError(f"{op}: trellis last dimension {trellis.shape[-1]} does not match K={K}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"{op}: expected codebook in {CODEBOOKS}, got {codebook!r}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: expected out_dtype float16 or bfloat16, got {out_dtype}")


@torch.library.custom_op("twinspark::exl3_reconstruct", mutates_args=())
def _exl3_reconstruct(trellis: torch.Tensor, K: float, codebook: str, out_dtype: torch.dtype) -> torch.Tensor:
    if not _ext.use_kernel(trellis):
        return _reference(trellis, K, codebook, out_dtype)
    tk, tn, _ = trellis.shape
    trellis = trellis.contiguous()
    out = torch.empty(tk * 16, tn * 16, dtype=out_dtype, device=trellis.device)
    ka, half = split_rate(K)
    _ext.module().exl3_reconstruct(
        trellis.data_ptr(), tk, tn, ka, half, CODEBOOKS.index(codebook), out.data_ptr(),
        out_dtype == torch.bfloat16, _ext.stream_ptr(trellis.device),
    )
    return out


@_exl3_reconstruct.register_fake
def _(trellis, K, codebook, out_dtype):
    tk, tn, _ = trellis.shape
    return trellis.new_empty(tk * 16, tn * 16, dtype=out_dtype)


def exl3_reconstruct(trellis: torch.Tensor, K: float, codebook: str = "mul1",
                     out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W_hat of one EXL3 tensor.

    Args:
        trellis: int16 ``[k/16, n/16, 16*K]`` (half rates ``16*KA + 8``), CPU or CUDA.
        K: bits per weight (1..8, or 1.5 / 2.5 / 3.5).
        codebook: ``"3inst"``, ``"mcg"`` or ``"mul1"``.
        out_dtype: ``torch.float16`` (exact) or ``torch.bfloat16`` (the fp16 value rounded to nearest even).
    Returns:
        ``[k, n]`` in ``out_dtype`` on the trellis' device.
    """
    _check(trellis, K, codebook, out_dtype)
    return _exl3_reconstruct(trellis, float(K), codebook, out_dtype)
