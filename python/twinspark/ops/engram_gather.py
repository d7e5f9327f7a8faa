"""twinspark.ops.engram_gather: gather Engram table rows by global id and dequantize them to bf16 in one pass;
ids outside this rank's rows (and the dead id -1) give zero rows. Bit-exact with
twinspark.reference.engram_gather (CPU tensors run the reference, CUDA tensors the kernel)."""

from __future__ import annotations

import torch

from twinspark import _ext
from twinspark.ops.engram_dequant import check_out, check_rows, kernel_out_ok, kernel_rows, kernel_scales
from twinspark.reference.engram_dequant import ROW_VALUES
from twinspark.reference.engram_gather import engram_gather as _reference

_ID_DTYPES = (torch.int64, torch.int32)


@torch.library.custom_op("twinspark::engram_gather", mutates_args=("out",))
def _engram_gather(table_fp8: torch.Tensor, table_scales: torch.Tensor, ids: torch.Tensor, first_row: int,
                   out: torch.Tensor) -> None:
    n = ids.shape[0]
    if n == 0:
        return
    if not _ext.use_kernel(table_fp8, table_scales, ids, out):
        out.copy_(_reference(table_fp8, table_scales, ids, first_row))
        return
    rows, scales = kernel_rows(table_fp8), kernel_scales(table_scales)
    ids = ids.contiguous()
    dst = out if kernel_out_ok(out) else torch.empty(n, ROW_VALUES, dtype=torch.bfloat16, device=out.device)
    _ext.module().engram_gather(rows.data_ptr(), rows.stride(0), scales.data_ptr(), scales.stride(0),
                                rows.shape[0], ids.data_ptr(), ids.dtype == torch.int32, first_row, n,
                                dst.data_ptr(), dst.stride(0), _ext.stream_ptr(out.device))
    if dst is not out:
        out.copy_(dst)


@_engram_gather.register_fake
def _(table_fp8, table_scales, ids, first_row, out):
    return None


def engram_gather(table_fp8: torch.Tensor, table_scales: torch.Tensor, ids: torch.Tensor, first_row: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` of an Engram table (or of a staging buffer holding a rank's rows), dequantized to bf16.

    Args:
        table_fp8: ``torch.float8_e4m3fn`` ``[N, 256]`` holding global rows ``[first_row, first_row + N)``;
            anything not typed float8_e4m3fn is refused with TypeError.
        table_scales: ``torch.uint8`` (or ``float8_e8m0fnu``) ``[N, 8]`` E8M0 bytes.
        ids: ``int64`` or ``int32`` ``[n]`` global row ids on the table's device; ids outside the table and -1
            give zero rows.
        first_row: global id of the table's row 0 (>= 0).
        out: optional ``torch.bfloat16`` ``[n, 256]``, written in place.
    Returns:
        ``[n, 256]`` bf16 (``out`` when given).
    """
    op = "engram_gather"
    check_rows(op, "table_fp8", table_fp8, "table_scales", table_scales)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _ID_DTYPES or ids.dim() != 1:
        got = f"{ids.dtype} with {ids.dim()} dims" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{op}: expected ids to be a 1-D int64 or int32 tensor, got {got}")
    if ids.device != table_fp8.device:
        raise ValueError(f"{op}: expected ids on {table_fp8.device} like table_fp8, got {ids.device}")
    if not isinstance(first_row, int) or first_row < 0:
        raise ValueError(f"{op}: expected first_row to be an int >= 0, got {first_row!r}")
    n = ids.shape[0]
    if out is None:
        out = torch.empty(n, ROW_VALUES, dtype=torch.bfloat16, device=table_fp8.device)
    else:
        check_out(op, out, n, table_fp8.device)
    _engram_gather(table_fp8, table_scales, ids, first_row, out)
    return out
