"""twinspark.ops.engram_gather: rows by global id, dequantized; -1 and other ranks' ids give zero rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engram_dequant import OPCHECK_UTILS, e4m3_f64, e8m0_f64, random_rows, same_bits
from twinspark.ops import engram_gather
from twinspark.reference.engram_dequant import engram_dequant
from twinspark.reference.engram_gather import engram_gather as reference
from twinspark.testing import need_cuda, poison_allocator


def random_ids(n: int, first_row: int, table_rows: int, gen: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    """Ids mostly inside [first_row, first_row + table_rows), with -1, the other rank's rows and the edges."""
    ids = torch.randint(first_row, first_row + table_rows, (n,), generator=gen)
    special = torch.tensor([-1, first_row - 1, first_row, first_row + table_rows - 1, first_row + table_rows,
                            first_row + 10 * table_rows, -5])
    k = min(n, special.numel())
    pos = torch.randperm(n, generator=gen)[:k]
    ids[pos] = special[:k]
    return ids.to(dtype)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_reference_rows_and_zero_rows(id_dtype, gen):
    table, scales = random_rows(50, gen)
    first = 1000
    ids = random_ids(200, first, 50, gen, id_dtype)
    got = engram_gather(table, scales, ids, first_row=first)
    inside = (ids >= first) & (ids < first + 50)
    assert (got[~inside] == 0).all() and (~inside).sum() >= 5  # -1, first-1, end, far, -5
    local = ids[inside].long() - first
    assert same_bits(got[inside], engram_dequant(table[local], scales[local]))


def test_all_foreign_and_empty(gen):
    table, scales = random_rows(8, gen)
    assert (engram_gather(table, scales, torch.tensor([-1, 8, 9, 100])) == 0).all()
    assert engram_gather(table, scales, torch.empty(0, dtype=torch.int64)).shape == (0, 256)


def test_out_given(gen):
    table, scales = random_rows(20, gen)
    ids = random_ids(30, 0, 20, gen)
    out = torch.full((30, 256), float("nan"), dtype=torch.bfloat16)
    assert engram_gather(table, scales, ids, out=out) is out
    assert same_bits(out, reference(table, scales, ids))


def test_opcheck(gen):
    table, scales = random_rows(6, gen)
    args = (table, scales, torch.tensor([-1, 3, 5, 7]), 2, torch.empty(4, 256, dtype=torch.bfloat16))
    torch.library.opcheck(torch.ops.twinspark.engram_gather.default, args, test_utils=OPCHECK_UTILS)


def test_uint8_table_refused(gen):
    table, scales = random_rows(6, gen)
    with pytest.raises(TypeError, match="engram_gather: expected table_fp8 to be torch.float8_e4m3fn.*got torch.uint8"):
        engram_gather(table.view(torch.uint8), scales, torch.tensor([1]))


@pytest.mark.parametrize(("ids", "first_row", "message"), [
    (torch.tensor([1.0]), 0, "expected ids to be a 1-D int64 or int32 tensor"),
    (torch.tensor([[1]]), 0, "expected ids to be a 1-D int64 or int32 tensor"),
    (torch.tensor([1]), -3, "expected first_row to be an int >= 0"),
])
def test_bad_inputs(ids, first_row, message, gen):
    table, scales = random_rows(6, gen)
    with pytest.raises((TypeError, ValueError), match=message):
        engram_gather(table, scales, ids, first_row=first_row)


# ------------------------------------------------------------------------------------------------------ GPU
# A GPU test draws its inputs first and runs its reference part everywhere (the reference on them, bit for bit against
# a float64 decode of the rows the ids select, zeros for the others), then need_cuda() and the kernel part.
def _reference_part(table, scales, ids, first=0) -> torch.Tensor:
    want = reference(table, scales, ids, first)
    local = ids.long() - first
    inside = (local >= 0) & (local < table.shape[0])
    f64 = np.zeros((ids.shape[0], 256))
    sel = local[inside].numpy()
    f64[inside.numpy()] = e4m3_f64(table.view(torch.uint8).numpy()[sel]) * np.repeat(e8m0_f64(scales.numpy()[sel]),
                                                                                     32, axis=1)
    assert same_bits(want, torch.from_numpy(f64).to(torch.bfloat16)), "reference vs float64 rows"
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("table_rows", "n"), [(1, 1), (37, 17), (1000, 33), (5000, 4097)])
def test_kernel_bit_exact(table_rows, n, id_dtype, gen):
    first = 123_457
    table, scales = random_rows(table_rows, gen, 0, 256)
    calls = []
    for _ in range(2):
        ids = random_ids(n, first, table_rows, gen, id_dtype)
        calls.append((ids, _reference_part(table, scales, ids, first)))
    cuda = need_cuda()
    t, s = table.to(cuda), scales.to(cuda)
    for ids, want in calls:
        poison_allocator(cuda, n * 512)
        got = engram_gather(t, s, ids.to(cuda), first_row=first)
        torch.cuda.synchronize()
        assert same_bits(got.cpu(), want)


@pytest.mark.gpu
def test_kernel_strided_table_and_out(gen):
    table, scales = random_rows(300, gen)
    ids = random_ids(100, 0, 150, gen)
    want = _reference_part(table[::2], scales[::2], ids)
    cuda = need_cuda()
    t, s = table.to(cuda), scales.to(cuda)
    wide = torch.full((100, 260), float("nan"), dtype=torch.bfloat16, device=cuda)
    got = engram_gather(t[::2], s[::2], ids.to(cuda), out=wide[:, :256])  # row stride 512 bytes: read in place
    torch.cuda.synchronize()
    assert same_bits(got.cpu(), want) and torch.isnan(wide[:, 256:]).all()


@pytest.mark.gpu
def test_kernel_in_cuda_graph(gen):
    table, scales = random_rows(500, gen)
    ids_cpu = random_ids(64, 100, 500, gen)
    new_ids = random_ids(64, 100, 500, gen)  # copied in before the replay
    want = _reference_part(table, scales, new_ids, 100)
    cuda = need_cuda()
    t, s = table.to(cuda), scales.to(cuda)
    ids = ids_cpu.to(cuda)
    out = torch.empty(64, 256, dtype=torch.bfloat16, device=cuda)
    engram_gather(t, s, ids, first_row=100, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engram_gather(t, s, ids, first_row=100, out=out)
    ids.copy_(new_ids.to(cuda))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out.cpu(), want)
