"""Reference for twinspark.ops.engram_dequant: Engram rows fp8 e4m3 [n, 256] x E8M0 scales [n, 8] -> bf16.

Value j of a row is ``fp8[j] * 2^(s[j // 32] - 127)``: the scale is the float32 whose bit pattern is ``s << 23``
except s = 0, which is 2^-127 (a float32 subnormal), and s = 255, which is NaN (as torch.float8_e8m0fnu and the
OCP MX spec define E8M0). The product is formed in
float32 (fp8 -> f32 is exact; times a power of two is exact unless float32 underflows) and rounded to bf16 to
nearest even, which is exact for every normal bf16 result (3 mantissa bits fit in 7).
"""

from __future__ import annotations

import torch

ROW_VALUES = 256
BLOCK = 32
SCALES_PER_ROW = ROW_VALUES // BLOCK


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 2^(s-127) (255 -> NaN), same shape."""
    s = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(s == 0, 0x00400000, torch.where(s == 255, 0x7FC00000, s << 23))
    return bits.view(torch.float32)


def engram_dequant(rows_fp8: torch.Tensor, scales_e8m0: torch.Tensor) -> torch.Tensor:
    """rows_fp8 float8_e4m3fn [n, 256], scales_e8m0 uint8/float8_e8m0fnu [n, 8] -> bfloat16 [n, 256]."""
    n = rows_fp8.shape[0]
    values = rows_fp8.to(torch.float32).reshape(n, SCALES_PER_ROW, BLOCK)
    scale = e8m0_to_float32(scales_e8m0).reshape(n, SCALES_PER_ROW, 1)
    return (values * scale).reshape(n, ROW_VALUES).to(torch.bfloat16)
