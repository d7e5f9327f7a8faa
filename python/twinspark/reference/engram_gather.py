"""Reference for twinspark.ops.engram_gather: rows of a table picked by global row id, then dequantized.

The table holds global rows [first_row, first_row + table_rows) (this rank's whole hash heads). Output row i is
the dequantized table row ``ids[i] - first_row`` when that is inside the table, else a zero row (the dead id -1
and ids owned by the other rank).
"""

from __future__ import annotations

import torch

from twinspark.reference.engram_dequant import ROW_VALUES, engram_dequant


def engram_gather(table_fp8: torch.Tensor, table_scales: torch.Tensor, ids: torch.Tensor,
                  first_row: int = 0) -> torch.Tensor:
    """table_fp8 float8_e4m3fn [N, 256], table_scales [N, 8], ids int64/int32 [n] -> bfloat16 [n, 256]."""
    local = ids.to(torch.int64) - first_row
    inside = (ids.to(torch.int64) >= first_row) & (local < table_fp8.shape[0])
    out = torch.zeros(ids.shape[0], ROW_VALUES, dtype=torch.bfloat16, device=ids.device)
    if inside.any():
        pick = local[inside]
        out[inside] = engram_dequant(table_fp8[pick], table_scales[pick])
    return out
