"""Engram gather + dequant on the GPU: random rows of a 4,194,304-row fp8 table -> bf16 [rows, 256].

Cases (issue 5, anchors-h200.md): 4,096 and 65,536 rows gathered by id from the table (engram_gather), the same
in plain torch (index_select, to bf16, times 2^(s-127): the anchor's method) measured in this run, and the plain
dequant of rows already staged contiguously (engram_dequant, what the file-backed store feeds). Target: <= 25 µs
at 65,536 rows (torch anchor 163.7 µs). Bytes per row as the anchor counts them: 256 + 8 read, 512 written (the
ids, 8 bytes a row, are left out). The table (1.1 GB) is far larger than L2 and every call gets fresh random ids
and a fresh output (a ring of >= 256 MB), so the gathers are L2-cold.

    python bench/bench_engram_dequant.py          # writes engram_dequant.json through benchkit
"""

from __future__ import annotations

import benchkit as bk
import torch
from twinspark.ops import engram_dequant, engram_gather
from twinspark.reference.engram_dequant import e8m0_to_float32

TABLE_ROWS = 4_194_304
ROW_BYTES = 256 + 8 + 512  # read weight + scale, write bf16


def torch_gather_dequant(table_u8: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The anchor's plain-torch method (as in anchors-h200.md)."""
    w = table_u8.index_select(0, ids).view(torch.float8_e4m3fn).to(torch.bfloat16)
    s = e8m0_to_float32(scales.index_select(0, ids)).to(torch.bfloat16)
    return (w.view(-1, 8, 32) * s.view(-1, 8, 1)).view(-1, 256)


def main() -> None:
    dev = torch.device("cuda")
    copy = bk.copy_ceiling_gbps(dev)
    anchors = bk.load_anchors()
    g = torch.Generator(device=dev).manual_seed(0)
    table_u8 = torch.randint(0, 256, (TABLE_ROWS, 256), dtype=torch.uint8, device=dev, generator=g)
    table_u8[(table_u8 & 0x7F) == 0x7F] = 0  # no NaN codes: a plain comparison below
    table = table_u8.view(torch.float8_e4m3fn)
    scales = torch.randint(112, 135, (TABLE_ROWS, 8), dtype=torch.uint8, device=dev, generator=g)

    records = []
    for rows in (4096, 65536):
        def make(rows=rows):
            ids = torch.randint(0, TABLE_ROWS, (rows,), device=dev, generator=g)
            return ids, torch.empty(rows, 256, dtype=torch.bfloat16, device=dev)

        ring = bk.rotate(make)
        ids0, out0 = ring[0]
        engram_gather(table, scales, ids0, out=out0)
        want = torch_gather_dequant(table_u8, scales, ids0)
        if not torch.equal(out0.view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"engram_gather differs from the torch method at {rows} rows: not timing a wrong kernel")
        a = anchors.engram(rows=rows)
        nbytes = rows * ROW_BYTES
        t = bk.time_cuda(lambda ids, out: engram_gather(table, scales, ids, out=out), args=ring)
        records.append(bk.Record(op="engram_gather", shape={"rows": rows, "table_rows": TABLE_ROWS}, timing=t,
                                 bytes=nbytes, anchor_us=a.us if a else None,
                                 notes="gather + dequant, one kernel"))
        t_torch = bk.time_cuda(lambda ids, out: torch_gather_dequant(table_u8, scales, ids), args=ring)
        records.append(bk.Record(op="engram_gather", shape={"rows": rows, "table_rows": TABLE_ROWS},
                                 timing=t_torch, bytes=nbytes, anchor_us=a.us if a else None, variant="torch",
                                 notes="index_select + to bf16 x 2^(s-127), this run"))

        def make_staged(rows=rows):
            return (torch.randint(0, 256, (rows, 256), dtype=torch.uint8, device=dev, generator=g)
                    .view(torch.float8_e4m3fn),
                    torch.randint(112, 135, (rows, 8), dtype=torch.uint8, device=dev, generator=g),
                    torch.empty(rows, 256, dtype=torch.bfloat16, device=dev))

        staged = bk.rotate(make_staged)
        t_deq = bk.time_cuda(lambda w, s, out: engram_dequant(w, s, out=out), args=staged)
        records.append(bk.Record(op="engram_dequant", shape={"rows": rows}, timing=t_deq, bytes=nbytes,
                                 notes="contiguous staged rows (store output) -> bf16"))
        del ring, staged

    print(f"copy ceiling {copy:.0f} GB/s (read + write)")
    print(f"{'op':<15}{'variant':<11}{'rows':>7}{'µs':>9}{'GB/s':>8}{'% copy':>8}{'anchor µs':>11}")
    for r in records:
        print(f"{r.op:<15}{r.variant:<11}{r.shape['rows']:>7}{r.median_us:>9.1f}{r.gbps:>8.0f}"
              f"{100 * r.gbps / copy:>8.1f}{(r.anchor_us or float('nan')):>11.1f}")
    bk.write_results("engram_dequant", records, ceilings={"copy_gbps": copy})


if __name__ == "__main__":
    main()
