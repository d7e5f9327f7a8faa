"""twinspark.ops.exl3_reconstruct: the reference and the CPU path bit-exact with the spec decoder (tests/exl3_spec.py,
written from the format's text), the kernel (GPU tests) bit-exact with the reference.

GPU tests: the reference part (trellises drawn, the reference checked bit for bit against the spec decoder) runs
everywhere; the kernel part skips with a reason without a CUDA GPU."""

from __future__ import annotations

import types

import exl3_spec as spec
import pytest
import torch
from twinspark import _ext
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import random_trellis
from twinspark.ops import exl3_reconstruct
from twinspark.testing import need_cuda, poison_allocator

CASES = [(cb, K) for cb in ref.CODEBOOKS for K in list(ref.WHOLE_RATES) + list(ref.HALF_RATES)
         if cb == "mul1" or K in ref.WHOLE_RATES]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("codebook", "K"), CASES)
def test_cpu_path_and_reference_match_spec(codebook, K, out_dtype, gen):
    trellis = random_trellis(3, 2, K, gen)
    want = spec.inner_weight_as(trellis, K, codebook, out_dtype)
    assert want.shape == (48, 32) and want.dtype == out_dtype
    assert _same_bits(exl3_reconstruct(trellis, K, codebook, out_dtype), want), "the CPU path differs from the spec"
    assert _same_bits(ref.inner_weight(trellis, K, codebook).to(out_dtype), want), "the reference differs from the spec"


def test_opcheck(gen):
    trellis = random_trellis(2, 3, 3, gen)
    torch.library.opcheck(torch.ops.twinspark.exl3_reconstruct.default, (trellis, 3.0, "mul1", torch.bfloat16))


@pytest.mark.parametrize(("args", "message"), [
    ((torch.zeros(2, 2, 32, dtype=torch.int32), 2, "mul1"), "exl3_reconstruct: expected trellis to be int16"),
    ((torch.zeros(2, 32, dtype=torch.int16), 2, "mul1"), "expected trellis to be 3-D"),
    ((torch.zeros(2, 2, 48, dtype=torch.int16), 2, "mul1"), "last dimension 48 does not match K=2"),
    ((torch.zeros(2, 2, 32, dtype=torch.int16), 2, "foo"), "expected codebook in"),
])
def test_bad_inputs(args, message):
    with pytest.raises((TypeError, ValueError), match=message):
        exl3_reconstruct(*args)


def test_not_built_for_this_gpu_names_the_arch(monkeypatch):
    """A GPU the build has no cubin for gets 'twinspark was not built for sm_XX; rebuild with ...'."""
    monkeypatch.setattr(_ext, "_C", types.SimpleNamespace(with_cuda=True, built_archs=lambda: ["90a"],
                                                          device_has_image=lambda i: False))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (12, 1))
    _ext._check_device.cache_clear()
    try:
        with pytest.raises(_ext.NotBuiltError, match=r"twinspark was not built for sm_121 \(built for: sm_90a\); "
                                                     r"rebuild with TWINSPARK_CUDA_ARCHS=121a"):
            _ext._check_device(0)
    finally:
        _ext._check_device.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("codebook", "K"), CASES)
def test_kernel_bit_exact(codebook, K, out_dtype, gen):
    cases = []
    for tiles_k, tiles_n in [(1, 1), (3, 5), (64, 80), (17, 33)]:  # awkward tile counts, a block tail
        trellis = random_trellis(tiles_k, tiles_n, K, gen)
        want = ref.inner_weight(trellis, K, codebook).to(out_dtype)
        assert _same_bits(want, spec.inner_weight_as(trellis, K, codebook, out_dtype)), \
            f"reference vs spec: {codebook} K={K} {out_dtype} {tiles_k}x{tiles_n} tiles"
        cases.append((tiles_k, tiles_n, trellis, want))
    cuda = need_cuda()
    for tiles_k, tiles_n, trellis, want in cases:
        poison_allocator(cuda, want.numel() * 2)
        got = exl3_reconstruct(trellis.to(cuda), K, codebook, out_dtype)
        torch.cuda.synchronize()
        assert _same_bits(got.cpu(), want), f"{codebook} K={K} {out_dtype} {tiles_k}x{tiles_n} tiles"


@pytest.mark.gpu
def test_kernel_in_cuda_graph(gen):
    first = random_trellis(16, 16, 4, gen)
    new = random_trellis(16, 16, 4, gen)  # copied in before the replay
    want = ref.inner_weight(new, 4, "mul1")
    assert _same_bits(want, spec.inner_weight(new, 4, "mul1")), "reference vs spec"
    cuda = need_cuda()
    trellis = first.to(cuda)
    exl3_reconstruct(trellis, 4, "mul1")  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = exl3_reconstruct(trellis, 4, "mul1")
    trellis.copy_(new.to(cuda))
    graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(out.cpu(), want)
