"""twinspark.ops.engram_dequant: Engram rows fp8 e4m3 [n, 256] x E8M0 scales [n, 8] -> bf16 [n, 256].
Bit-exact with twinspark.reference.engram_dequant (CPU tensors run the reference, CUDA tensors the kernel)."""

from __future__ import annotations

import torch

from twinspark import _ext
from twinspark.reference.engram_dequant import ROW_VALUES, SCALES_PER_ROW
from twinspark.reference.engram_dequant import engram_dequant as _reference

_SCALE_DTYPES = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def check_rows(op: str, rows_name: str, rows: torch.Tensor, scales_name: str, scales: torch.Tensor) -> None:
    """Contract of an Engram row table: rows float8_e4m3fn [N, 256] (inner stride 1 for the kernel, or it is
    copied), scales uint8 or float8_e8m0fnu [N, 8], same N and device. Anything not typed float8_e4m3fn is
    refused: Engram bytes read as uint8 give values ~30x too large and all positive, and the model still talks."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float8_e4m3fn:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise TypeError(
            f"{op}: expected {rows_name} to be torch.float8_e4m3fn (Engram rows are FP8 E4M3), got {got}; "
            "reading these bytes as any other type gives plausible garbage, so pass the tensor as stored in the "
            "checkpoint (or .view(torch.float8_e4m3fn) raw bytes that really are E4M3)")
    if rows.dim() != 2 or rows.shape[1] != ROW_VALUES:
        raise ValueError(f"{op}: expected {rows_name} to be [rows, {ROW_VALUES}], got {list(rows.shape)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in _SCALE_DTYPES:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"{op}: expected {scales_name} to be torch.uint8 E8M0 bytes (or float8_e8m0fnu), got {got}")
    if scales.dim() != 2 or scales.shape[1] != SCALES_PER_ROW or scales.shape[0] != rows.shape[0]:
        raise ValueError(f"{op}: expected {scales_name} to be [{rows.shape[0]}, {SCALES_PER_ROW}] (one E8M0 byte per "
                         f"32 values of {rows_name}), got {list(scales.shape)}")
    if scales.device != rows.device:
        raise ValueError(f"{op}: expected {scales_name} on {rows.device} like {rows_name}, got {scales.device}")


def check_out(op: str, out: torch.Tensor, n: int, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{op}: expected out to be torch.bfloat16, got {got}")
    if tuple(out.shape) != (n, ROW_VALUES):
        raise ValueError(f"{op}: expected out to be [{n}, {ROW_VALUES}], got {list(out.shape)}")
    if out.device != device:
        raise ValueError(f"{op}: expected out on {device}, got {out.device}")


def kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows as the kernel reads them: inner stride 1, row stride a multiple of 16 bytes, 16-byte aligned."""
    if rows.stride(1) != 1 or rows.stride(0) % 16 or rows.data_ptr() % 16:
        rows = rows.contiguous()
    return rows


def kernel_scales(scales: torch.Tensor) -> torch.Tensor:
    scales = scales.view(torch.uint8)
    return scales if scales.stride(1) == 1 else scales.contiguous()


def kernel_out_ok(out: torch.Tensor) -> bool:
    return out.stride(1) == 1 and out.stride(0) % 8 == 0 and out.data_ptr() % 16 == 0


@torch.library.custom_op("twinspark::engram_dequant", mutates_args=("out",))
def _engram_dequant(rows_fp8: torch.Tensor, scales_e8m0: torch.Tensor, out: torch.Tensor) -> None:
    n = rows_fp8.shape[0]
    if n == 0:
        return
    if not _ext.use_kernel(rows_fp8, scales_e8m0, out):
        out.copy_(_reference(rows_fp8, scales_e8m0))
        return
    rows, scales = kernel_rows(rows_fp8), kernel_scales(scales_e8m0)
    dst = out if kernel_out_ok(out) else torch.empty(n, ROW_VALUES, dtype=torch.bfloat16, device=out.device)
    _ext.module().engram_dequant(rows.data_ptr(), rows.stride(0), scales.data_ptr(), scales.stride(0), n,
                                 dst.data_ptr(), dst.stride(0), _ext.stream_ptr(out.device))
    if dst is not out:
        out.copy_(dst)


@_engram_dequant.register_fake
def _(rows_fp8, scales_e8m0, out):
    return None


def engram_dequant(rows_fp8: torch.Tensor, scales_e8m0: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize Engram rows to bf16.

    Args:
        rows_fp8: ``torch.float8_e4m3fn`` ``[n, 256]`` (anything else is refused with TypeError), CPU or CUDA.
        scales_e8m0: ``torch.uint8`` (or ``float8_e8m0fnu``) ``[n, 8]``: one E8M0 byte per 32 values,
            scale = 2^(s-127).
        out: optional ``torch.bfloat16`` ``[n, 256]`` on the same device, written in place.
    Returns:
        ``[n, 256]`` bf16 (``out`` when given); bit-exact with ``twinspark.reference.engram_dequant``.
    """
    op = "engram_dequant"
    check_rows(op, "rows_fp8", rows_fp8, "scales_e8m0", scales_e8m0)
    n = rows_fp8.shape[0]
    if out is None:
        out = torch.empty(n, ROW_VALUES, dtype=torch.bfloat16, device=rows_fp8.device)
    else:
        check_out(op, out, n, rows_fp8.device)
    _engram_dequant(rows_fp8, scales_e8m0, out)
    return out
