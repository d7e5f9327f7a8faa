"""twinspark.ops.engram_dequant: fp8 e4m3 x E8M0 -> bf16, exact; non-E4M3 input refused.

The reference is checked against an independent float64 decode of every E4M3 code under every E8M0 code; the
kernel (GPU tests) is checked bit for bit against the reference on fresh random rows with poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from twinspark.ops import engram_dequant
from twinspark.reference.engram_dequant import engram_dequant as reference
from twinspark.testing import need_cuda, poison_allocator

OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# opcheck's test_schema compares inputs before/after with torch.allclose, which has no float8 CPU kernel; the
# "inputs are not mutated" half of it is checked by test_inputs_untouched instead.


def e4m3_f64(code: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bytes -> float64 from the format's definition (bias 7, subnormals, 0x7F/0xFF NaN)."""
    code = code.astype(np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    return np.where((code & 0x7F) == 0x7F, np.nan, sign * val)


def e8m0_f64(s: np.ndarray) -> np.ndarray:
    return np.where(s == 255, np.nan, np.exp2(s.astype(np.float64) - 127))


def random_rows(n: int, gen: torch.Generator, lo: int = 100, hi: int = 150):
    rows = torch.randint(0, 256, (n, 256), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    scales = torch.randint(lo, hi, (n, 8), dtype=torch.uint8, generator=gen)
    return rows, scales


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical bf16, except that any NaN matches any NaN (payloads differ between CPU and GPU)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = torch.isnan(got) & torch.isnan(want)
    return bool(((got.view(torch.int16) == want.view(torch.int16)) | nan).all())


def test_reference_exact_for_every_code_and_scale():
    """All 256 E4M3 codes under all 256 E8M0 scales: the reference equals float64 math rounded once to bf16."""
    codes = np.arange(256, dtype=np.uint8)
    rows = torch.from_numpy(np.tile(codes, (256, 1))).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1))
    want = e4m3_f64(codes)[None, :] * e8m0_f64(np.arange(256))[:, None]
    got = reference(rows, scales)
    assert same_bits(got, torch.from_numpy(want).to(torch.bfloat16))


@pytest.mark.parametrize("n", [0, 1, 17, 33, 300])
def test_cpu_path_matches_float64(n, gen):
    rows, scales = random_rows(n, gen)
    got = engram_dequant(rows, scales)
    want = e4m3_f64(rows.view(torch.uint8).numpy()) * np.repeat(e8m0_f64(scales.numpy()), 32, axis=1)
    assert got.shape == (n, 256) and got.dtype == torch.bfloat16
    assert same_bits(got, torch.from_numpy(want).to(torch.bfloat16))


def test_out_and_strided_inputs(gen):
    rows, scales = random_rows(40, gen)
    want = reference(rows, scales)
    wide = torch.zeros(40, 300, dtype=torch.bfloat16)
    out = wide[:, 10:266]
    assert engram_dequant(rows[::1], scales, out=out) is out
    assert same_bits(out, want) and (wide[:, :10] == 0).all() and (wide[:, 266:] == 0).all()
    assert same_bits(engram_dequant(rows[::2], scales[::2]), want[::2])
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:
        assert same_bits(engram_dequant(rows, scales.view(e8m0)), want)


def test_inputs_untouched(gen):
    rows, scales = random_rows(9, gen)
    r0, s0 = rows.view(torch.uint8).clone(), scales.clone()
    engram_dequant(rows, scales)
    assert torch.equal(rows.view(torch.uint8), r0) and torch.equal(scales, s0)


def test_opcheck(gen):
    rows, scales = random_rows(5, gen)
    out = torch.empty(5, 256, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.twinspark.engram_dequant.default, (rows, scales, out), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bfloat16, torch.float8_e5m2])
def test_non_e4m3_rows_refused(dtype, gen):
    """The deployment that read these bytes as uint8 served garbage for weeks: every other dtype is refused."""
    rows, scales = random_rows(4, gen)
    bad = rows.view(torch.uint8).to(dtype) if dtype.is_floating_point else rows.view(torch.uint8).view(dtype)
    with pytest.raises(TypeError, match=rf"engram_dequant: expected rows_fp8 to be torch.float8_e4m3fn .*got "
                                        rf"{dtype}"):
        engram_dequant(bad, scales)


@pytest.mark.parametrize(("args", "message"), [
    (lambda r, s: (r[:, :128], s), r"expected rows_fp8 to be \[rows, 256\]"),
    (lambda r, s: (r, s.to(torch.int32)), "expected scales_e8m0 to be torch.uint8"),
    (lambda r, s: (r, s[:2]), r"expected scales_e8m0 to be \[4, 8\]"),
    (lambda r, s: (r, s, torch.empty(4, 256, dtype=torch.float16)), "expected out to be torch.bfloat16"),
    (lambda r, s: (r, s, torch.empty(3, 256, dtype=torch.bfloat16)), r"expected out to be \[4, 256\]"),
])
def test_bad_inputs(args, message, gen):
    rows, scales = random_rows(4, gen)
    with pytest.raises((TypeError, ValueError), match=message):
        engram_dequant(*args(rows, scales))


# ------------------------------------------------------------------------------------------------------ GPU
# A GPU test draws its inputs first and runs its reference part everywhere (the reference on them, bit for bit against
# the float64 decode above), then need_cuda() (skips without a GPU) and the kernel part.
def _reference_part(rows, scales) -> torch.Tensor:
    want = reference(rows, scales)
    f64 = e4m3_f64(rows.view(torch.uint8).numpy()) * np.repeat(e8m0_f64(scales.numpy()), 32, axis=1)
    assert same_bits(want, torch.from_numpy(f64).to(torch.bfloat16)), "reference vs float64 decode"
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17, 33, 4097])
def test_kernel_bit_exact(n, gen):
    calls = []
    for _ in range(3):  # fresh inputs each time
        rows, scales = random_rows(n, gen, 0, 256)  # every scale code, NaN and inf results included
        calls.append((rows, scales, _reference_part(rows, scales)))
    cuda = need_cuda()
    for rows, scales, want in calls:
        poison_allocator(cuda, n * 512)
        got = engram_dequant(rows.to(cuda), scales.to(cuda))
        torch.cuda.synchronize()
        assert same_bits(got.cpu(), want)


@pytest.mark.gpu
def test_kernel_strided_and_out(gen):
    rows, scales = random_rows(64, gen)
    want = _reference_part(rows, scales)
    cuda = need_cuda()
    r, s = rows.to(cuda), scales.to(cuda)
    # rows with a padded row stride (kernel reads them in place), every other row (copied), scales strided
    padded = torch.empty(64, 272, dtype=torch.uint8, device=cuda).view(torch.float8_e4m3fn)[:, :256]
    padded.view(torch.uint8).copy_(r.view(torch.uint8))
    wide = torch.full((64, 264), float("nan"), dtype=torch.bfloat16, device=cuda)
    out = wide[:, :256]
    engram_dequant(padded, s, out=out)
    assert same_bits(out.cpu(), want) and torch.isnan(wide[:, 256:]).all()
    assert same_bits(engram_dequant(r[1::2], s[1::2]).cpu(), want[1::2])
    s2 = torch.empty(64, 16, dtype=torch.uint8, device=cuda)[:, ::2]
    s2.copy_(s)
    assert same_bits(engram_dequant(r, s2).cpu(), want)
    odd = torch.full((64, 257), float("nan"), dtype=torch.bfloat16, device=cuda)[:, 1:]  # misaligned out
    assert same_bits(engram_dequant(r, s, out=odd).cpu(), want)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:
        assert same_bits(engram_dequant(r, s.view(e8m0)).cpu(), want)


@pytest.mark.gpu
def test_kernel_refuses_uint8_on_gpu(gen):
    rows, scales = random_rows(4, gen)
    with pytest.raises(TypeError, match="expected rows_fp8 to be torch.float8_e4m3fn"):  # as the CPU path does
        engram_dequant(rows.view(torch.uint8), scales)
    cuda = need_cuda()
    with pytest.raises(TypeError, match="expected rows_fp8 to be torch.float8_e4m3fn"):
        engram_dequant(rows.view(torch.uint8).to(cuda), scales.to(cuda))


@pytest.mark.gpu
def test_kernel_in_cuda_graph(gen):
    rows, scales = random_rows(100, gen)
    rows2, scales2 = random_rows(100, gen)  # copied in before the replay
    want2 = _reference_part(rows2, scales2)
    cuda = need_cuda()
    r, s = rows.to(cuda), scales.to(cuda)
    out = torch.empty(100, 256, dtype=torch.bfloat16, device=cuda)
    engram_dequant(r, s, out=out)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        engram_dequant(r, s, out=out)
    r.copy_(rows2.to(cuda))
    s.copy_(scales2.to(cuda))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out.cpu(), want2)
