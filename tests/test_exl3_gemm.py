"""twinspark.ops.exl3_gemm against twinspark.exl3.reference.linear (fp32): the reference path on the CPU
everywhere (small shapes, seconds), the CUDA kernels on a GPU (marker gpu; the kernel part skips with a reason)."""

from __future__ import annotations

import threading
from math import nan

import exl3_spec as spec
import pytest
import torch
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import Exl3Layer, random_layer
from twinspark.ops import exl3_gemm, plans
from twinspark.ops.exl3_gemm import FUSED_BLOCKS, M_SLICE, fused_available, plan
from twinspark.ops.workspace import workspace
from twinspark.testing import need_cuda, poison_allocator, rel_l2

# Tolerances (relative L2 vs the fp32 reference): the kernels round x' = H(x ⊙ suh) to fp16 (~2^-12 RMS
# relative) and the result once to the output dtype (fp16 2^-11, bf16 2^-8 half-ulp): ~3e-4 for fp16 and
# ~1.5e-3 for bf16 expected; wrong indexing or a lost split gives O(1).
TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
MS = (1, 2, 3, 8, 16, 17, 33, 64, 300, 1024)
ANCHOR_SHAPES = ((1152, 5120), (5120, 1152), (4096, 5120), (5120, 4096), (5120, 12288))
AWKWARD_SHAPES = ((128, 128), (384, 1280), (6144, 128))


TABLE = plans.DEFAULT.exl3_gemm  # the table tests below run with it (the module skips where $TWINSPARK_PLAN changes it)


def _plan(monkeypatch, spec: str) -> None:
    """The rest of the test runs with these exl3_gemm plan keys on top of the current ones (undone at its end)."""
    monkeypatch.setattr(plans, "_current", plans.parse(spec, plans.current(), "test plan"))


def _dense(x: torch.Tensor, layer: Exl3Layer) -> torch.Tensor:
    """Independent of the factored reference: x @ (full fp32 weight) + bias."""
    y = x.float() @ layer.weight()
    return y + layer.bias.float() if layer.bias is not None else y


# ------------------------------------------------------------------------------------------- CPU (reference)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
@pytest.mark.parametrize("K", [2, 4])
def test_cpu_path_matches_dense_weight(K, codebook, dtype, gen):
    layer = random_layer(128, 256, K, codebook, bias=True, generator=gen)
    x = torch.randn(2, 3, 128, generator=gen).to(dtype)
    y = exl3_gemm(x, layer)
    assert y.dtype == dtype and y.shape == (2, 3, 256)
    assert rel_l2(y, _dense(x, layer)) <= TOL[dtype]


def test_cpu_out_argument_and_half_rate(gen):
    layer = random_layer(128, 128, 2.5, "mul1", generator=gen)
    x = torch.randn(5, 128, generator=gen).half()
    out = torch.full((5, 128), float("nan"), dtype=torch.float16)
    assert exl3_gemm(x, layer, out=out) is out
    assert rel_l2(out, _dense(x, layer)) <= TOL[torch.float16]


def test_opcheck(gen):
    layer = random_layer(128, 128, 3, "mcg", bias=True, generator=gen)
    x = torch.randn(3, 128, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.twinspark.exl3_gemm.default,
                          (x, layer.trellis, layer.suh, layer.svh, layer.bias, 3.0, "mcg"))


@pytest.mark.parametrize("fused", [False, True])
def test_plan_table_is_consistent(fused):
    """Every split covers >= 1 chunk, all chunks are covered, token groups hold the slice; prefill goes to the
    fused kernel where it runs (sm_90) up to fused_max_m and to the large path above; elsewhere (GB10) to the fused
    mma.sync kernel up to no_wgmma_mma_max_m, the large path above."""
    for m in (1, 7, 8, 9, 16, 33, 63, 64, 65, 128, 129, 256, 257, 4096):
        for k, n in ANCHOR_SHAPES + AWKWARD_SHAPES:
            p = plan(m, k, n, 3, sms=132, fused=fused)
            if m > TABLE.large_m:
                if fused:
                    assert p.variant == ("fused" if m <= TABLE.fused_max_m else "large")
                else:
                    assert p.variant == ("fused_mma" if m <= TABLE.no_wgmma_mma_max_m else "large")
                if p.variant == "large":
                    assert (p.block, p.splits) == (0, 0)
                elif not p.stream_k:  # stream-K: splits is its block count
                    assert (p.splits - 1) * p.chunks_per_split < k // 64 <= p.splits * p.chunks_per_split
                continue
            chunks = k // 128
            assert p.variant == "small" and p.groups in (1, 2, 4, 8)
            assert p.m_slice == min(m, M_SLICE) and p.m_slice <= 8 * p.groups < 2 * max(p.m_slice, 8)
            assert (p.splits - 1) * p.chunks_per_split < chunks <= p.splits * p.chunks_per_split
            assert p.prep == (p.groups >= TABLE.prep_groups and n // 128 * k >= TABLE.prep_work)


@pytest.mark.parametrize(("make", "message"), [
    (lambda L: (torch.randn(2, 128), L), "expected x to be a float16 or bfloat16"),
    (lambda L: (torch.randn(2, 256).half(), L), r"expected x of shape \[\.\.\., 128\]"),
    (lambda L: (torch.randn(2, 128).half(), Exl3Layer(L.trellis, L.suh.float(), L.svh, L.K, L.codebook)),
     "expected suh to be float16"),
    (lambda L: (torch.randn(2, 128).half(), Exl3Layer(L.trellis, L.suh, L.svh, L.K, "foo")), "expected codebook"),
    (lambda L: (torch.randn(2, 128).half(), Exl3Layer(L.trellis, L.suh, L.svh, 3.0, L.codebook)),
     "does not match K=3"),
])
def test_bad_inputs(make, message, gen):
    layer = random_layer(128, 128, 2, "mul1", generator=gen)
    with pytest.raises((TypeError, ValueError), match=message):
        exl3_gemm(*make(layer))


def test_k_n_not_multiple_of_128(gen):
    layer = random_layer(144, 128, 2, "mul1", generator=gen)
    with pytest.raises(ValueError, match="must be multiples of 128"):
        exl3_gemm(torch.randn(1, 144).half(), layer)


def test_fused_split_k(monkeypatch):
    """k is split only when the blocks leave SMs idle, never past one round of blocks, every split >= one 64-row
    chunk (the launcher refuses an empty split); stream-K (block 0 only) runs at most one block per SM, each with
    >= sk_min_chunks chunks, never more blocks than iterations (forced counts are capped there too)."""
    seen = set()
    for m in (65, 128, 256, 300, 1024, 4096):
        for k, n in ANCHOR_SHAPES + AWKWARD_SHAPES:
            p = plan(m, k, n, 2, 132, variant="fused", fused=True)
            seen.add(p.block)
            cols, tokens, per_sm = FUSED_BLOCKS[p.block]
            blocks = -(-n // cols) * -(-m // tokens)
            if p.stream_k:
                assert p.block == 0
                iterations = blocks * (k // 64)
                assert 1 <= p.splits <= min(132, iterations)
                assert p.splits == 1 or iterations // p.splits >= TABLE.sk_min_chunks
            else:
                assert p.splits * blocks <= max(132 * per_sm, blocks)
                assert (p.splits - 1) * p.chunks_per_split < k // 64 <= p.splits * p.chunks_per_split
    assert seen == set(FUSED_BLOCKS)
    p = plan(256, 5120, 12288, 2, 132, fused=True)
    assert p.stream_k and p.splits == 132  # 96 tiles: stream-K fills all 132 SMs
    p = plan(256, 4096, 5120, 2, 132, fused=True)
    assert not p.stream_k and p.splits > 1  # 40 tiles: k split (stream-K would spread a tile over 3.3 blocks)
    assert not plan(512, 1152, 5120, 2, 132, fused=True).stream_k  # 18 chunks per tile: the k split
    assert plan(512, 4096, 5120, 2, 132, fused=True).stream_k
    _plan(monkeypatch, "exl3_gemm.block=0,exl3_gemm.sk_blocks=100000")
    p = plan(256, 128, 128, 2, 132, variant="fused", fused=True)
    assert p.stream_k and p.splits == 2  # one tile of two chunks
    _plan(monkeypatch, "exl3_gemm.sk_blocks=0")
    assert not plan(256, 5120, 12288, 2, 132, fused=True).stream_k
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        plan(256, 128, 128, 2, 132, variant="fused", fused=False)


def test_bad_out(gen):
    layer = random_layer(128, 128, 2, "mul1", generator=gen)
    with pytest.raises(ValueError, match="expected out to be"):
        exl3_gemm(torch.randn(2, 128).half(), layer, out=torch.empty(2, 128, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------ GPU kernel
# A GPU test draws all its inputs from `gen` first and runs its reference part (everywhere): the reference on a few
# rows (the first of each m) against the spec's float64 y (tests/exl3_spec.py: its own decoder and Hadamards), for the
# whole layer where it is small, else for its last 128 output columns (decoding a whole anchor layer on a CPU takes
# seconds to minutes). Then need_cuda() (skips without a GPU) and the kernel part: the kernel against the whole
# reference. fp32 reference vs float64: products and sums of k terms, each rounded by <= 2^-24 relative, give ~1e-6
# relative L2 (k <= 6144); a wrong decode, scale, Hadamard or bias gives O(1).
REF_TOL = 1e-5
WHOLE_LAYER_MAX_WEIGHTS = 1 << 20


def _column_block(layer: Exl3Layer, j: int) -> Exl3Layer:
    """Output columns 128j .. 128j+127 as a layer of their own (Hn is block-diagonal: nothing else feeds them)."""
    cols = slice(128 * j, 128 * j + 128)
    return Exl3Layer(layer.trellis[:, 8 * j:8 * j + 8].contiguous(), layer.suh, layer.svh[cols], layer.K,
                     layer.codebook, None if layer.bias is None else layer.bias[cols])


def _check_reference(layer: Exl3Layer, x: torch.Tensor, label: str = "") -> None:
    """The reference part: ref.linear on rows x [r, k] (fp16/bf16) against the spec's float64 y, bias included."""
    j = None if layer.k * layer.n <= WHOLE_LAYER_MAX_WEIGHTS else layer.n // 128 - 1
    part = layer if j is None else _column_block(layer, j)
    got = ref.linear(x, part.trellis, part.suh, part.svh, part.K, part.codebook, part.bias)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], part.n)
    err = rel_l2(got, spec.linear(x, part.trellis, part.suh, part.svh, part.K, part.codebook, part.bias))
    where = "all columns" if j is None else f"columns {128 * j}..{128 * j + 127}"
    assert err <= REF_TOL, f"{label} {where}: reference vs spec, rel L2 {err:.3g}"


def _draw_case(layer: Exl3Layer, dtype, ms, gen, label=""):
    """Fresh x for every m, drawn at once: a case for _reference_part and _check_case."""
    return layer, dtype, ms, torch.randn(sum(ms), layer.k, generator=gen).to(dtype), label


def _reference_part(cases) -> None:
    """Per layer, one reference check on the first row of each m of every case drawn for it (fp16 and bf16 rows both
    exact in fp32, where the reference takes x)."""
    rows: dict[int, tuple] = {}
    for layer, _, ms, x_all, label in cases:
        starts = [sum(ms[:i]) for i in range(len(ms))]
        rows.setdefault(id(layer), (layer, label, []))[2].append(x_all[starts].float())
    for layer, label, xs in rows.values():
        _check_reference(layer, torch.cat(xs), label)


def _check_case(case, cuda):
    """The kernel part: x per m (all m in one reference call), poisoned outputs, rel L2 vs reference.linear in fp32."""
    layer, dtype, ms, x_all, label = case
    want_all = ref.linear(x_all.to(cuda), layer.trellis.to(cuda), layer.suh.to(cuda), layer.svh.to(cuda), layer.K,
                          layer.codebook, None if layer.bias is None else layer.bias.to(cuda))
    lg = layer.to(cuda)
    r0 = 0
    for m in ms:
        x = x_all[r0:r0 + m].to(cuda)
        want = want_all[r0:r0 + m]
        r0 += m
        poison_allocator(cuda, m * layer.n * 2)
        got = exl3_gemm(x, lg)
        err = rel_l2(got.float(), want)
        assert err <= TOL[dtype], f"{label} m={m} {dtype}: rel L2 {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
@pytest.mark.parametrize("K", [2, 3, 4, 5, 6])
def test_kernel_parity(K, codebook, gen):
    cases = []
    for i, (k, n) in enumerate(ANCHOR_SHAPES + AWKWARD_SHAPES):
        layer = random_layer(k, n, K, codebook, bias=(i % 2 == 0), generator=gen)
        for dtype in (torch.float16, torch.bfloat16):
            cases.append(_draw_case(layer, dtype, MS, gen, f"{codebook} K={K} {k}x{n}"))
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [1, 7, 8])
def test_kernel_parity_other_rates(K, gen):
    cases = [_draw_case(random_layer(1152, 640, K, codebook, bias=True, generator=gen), torch.bfloat16,
                        (1, 9, 64, 200), gen, f"{codebook} K={K}") for codebook in ref.CODEBOOKS]
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["small", "fused", "fused_mma", "large"])
def test_every_variant_at_every_m(variant, gen, monkeypatch):
    """The table sends m > large_m to 'fused' (sm_90) or 'large'; force each variant at the others' m (small
    slices 64 tokens; fused takes 128- and 256-token blocks, fused_mma 128-token blocks, partial ones included)."""
    _plan(monkeypatch, f"exl3_gemm.variant={variant}")
    cases = [_draw_case(random_layer(1024, 768, K, codebook, bias=True, generator=gen), torch.float16,
                        (1, 17, 65, 300), gen, f"{variant} {codebook} K={K}")
             for K, codebook in ((3, "mul1"), (2, "3inst"), (5, "mcg"))]
    _reference_part(cases)
    cuda = need_cuda()
    if variant == "fused" and not fused_available(cuda):
        pytest.skip("the fused kernel needs an sm_90 GPU and a build with sm_90a (reference part ran)")
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("block", sorted(FUSED_BLOCKS))
def test_fused_block_shapes_and_split_k(block, gen, monkeypatch):
    """Every fused block shape, split k / stream-K (few tiles) and partial token blocks."""
    _plan(monkeypatch, f"exl3_gemm.variant=fused,exl3_gemm.block={block}")
    cases = [_draw_case(random_layer(1152, 640, K, codebook, bias=True, generator=gen), torch.bfloat16,
                        (65, 129, 300, 513), gen, f"block={block} {codebook} K={K}")
             for K, codebook in ((2, "mul1"), (4, "mcg"), (1, "3inst"))]
    _reference_part(cases)
    cuda = need_cuda()
    if not fused_available(cuda):
        pytest.skip("the fused kernel needs an sm_90 GPU and a build with sm_90a (reference part ran)")
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", ["64", "128", "256"])
def test_fused_mma_token_tiles_and_split_k(tokens, gen, monkeypatch):
    """The mma.sync prefill kernel at both token tiles, every rate, split k (fp32 partials) and one split (a
    4-chunk k: y' in fp16), partial token tiles, fp16 and bf16."""
    _plan(monkeypatch, f"exl3_gemm.variant=fused_mma,exl3_gemm.mma_tokens={tokens}")
    cases = []
    for i, (K, codebook) in enumerate(((1, "3inst"), (2, "mul1"), (3, "mcg"), (4, "mul1"), (5, "3inst"), (6, "mcg"),
                                       (7, "mul1"), (8, "3inst"))):
        k = 256 if i % 2 else 1152
        dtype = torch.bfloat16 if i % 3 else torch.float16
        cases.append(_draw_case(random_layer(k, 768, K, codebook, bias=i % 2 == 0, generator=gen), dtype,
                                (65, 129, 300, 513), gen, f"tokens={tokens} {codebook} K={K} k={k}"))
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_large_path_every_rate(dtype, gen, monkeypatch):
    """The whole-weight path (dequant_w + dense matmul) at every rate and codebook in x's dtype, on shapes whose
    128 x 128 blocks form odd grids both ways (TMA stores of both 64-column halves at every block position)."""
    _plan(monkeypatch, "exl3_gemm.variant=large")
    cases = []
    for i, (K, codebook) in enumerate(((1, "mul1"), (2, "3inst"), (3, "mcg"), (4, "mul1"), (5, "mul1"), (6, "3inst"),
                                       (7, "mcg"), (8, "mul1"))):
        k, n = (384, 640) if i % 2 else (640, 384)
        cases.append(_draw_case(random_layer(k, n, K, codebook, bias=i % 3 == 0, generator=gen), dtype, (1, 300),
                                gen, f"large {codebook} K={K} {k}x{n}"))
    _reference_part(cases)
    cuda = need_cuda()
    ws = workspace(cuda)
    for case in cases:
        layer = case[0]  # the weight buffer NaN first: a block the stores miss shows (the buffer outlives calls)
        ws.buffer("gemm_w_bf16" if dtype == torch.bfloat16 else "gemm_w_fp16", layer.k * layer.n, dtype).fill_(nan)
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("sk_blocks", ["1", "7", "50", "180"])
def test_fused_stream_k_block_counts(sk_blocks, gen, monkeypatch):
    """Stream-K (block 0) at forced block counts on 5 strips x 2 token tiles x 18 chunks = 180 iterations: one
    block for all, runs across tiles (7), tiles shared by 3-5 blocks (50), one chunk per block (180, more blocks
    than an H200 holds at once: heads wait on blocks that start only when others finish). Twice in a row: the
    flags must be left zero."""
    _plan(monkeypatch, f"exl3_gemm.variant=fused,exl3_gemm.block=0,exl3_gemm.sk_blocks={sk_blocks}")
    cases = []
    for K, codebook in ((2, "mul1"), (3, "mcg")):
        layer = random_layer(1152, 640, K, codebook, bias=True, generator=gen)
        for _ in range(2):
            cases.append(_draw_case(layer, torch.bfloat16, (300,), gen, f"sk={sk_blocks} {codebook} K={K}"))
    _reference_part(cases)
    cuda = need_cuda()
    if not fused_available(cuda):
        pytest.skip("the fused kernel needs an sm_90 GPU and a build with sm_90a (reference part ran)")
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("prep", ["0", "1"])
def test_small_variant_with_and_without_prepared_x(prep, gen, monkeypatch):
    """The small kernel reads x' made once by the prep kernel (default from prep_groups groups) or makes it per
    strip itself: both at every token-group count, half rates excluded (whole rates only)."""
    _plan(monkeypatch, f"exl3_gemm.variant=small,exl3_gemm.prep={prep}")
    cases = [_draw_case(random_layer(1280, 384, K, codebook, bias=True, generator=gen), torch.bfloat16,
                        (1, 9, 17, 33, 64, 100), gen, f"prep={prep} {codebook} K={K}")
             for K, codebook in ((2, "mul1"), (4, "3inst"), (8, "mcg"))]
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
def test_leading_dims_strided_x_and_out(gen):
    layer = random_layer(512, 384, 4, "3inst", bias=True, generator=gen)
    wide32 = torch.randn(2, 3, 640, generator=gen)
    _check_reference(layer, wide32[..., :512].to(torch.bfloat16).reshape(6, 512))
    cuda = need_cuda()
    layer = layer.to(cuda)
    wide = wide32.to(cuda, torch.bfloat16)
    x = wide[..., :512]  # row stride 640: no copy needed
    out = torch.full((2, 3, 384), float("nan"), dtype=torch.bfloat16, device=cuda)
    assert exl3_gemm(x, layer, out=out) is out
    want = ref.linear(x.float(), layer.trellis, layer.suh, layer.svh, 4, "3inst", layer.bias)
    assert rel_l2(out.float(), want) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_half_rate_runs_reference_with_notice(gen):
    layer = random_layer(256, 128, 2.5, "mul1", generator=gen)
    x32 = torch.randn(3, 256, generator=gen)
    _check_reference(layer, x32.half())
    cuda = need_cuda()
    layer = layer.to(cuda)
    x = x32.to(cuda, torch.float16)
    with pytest.warns(UserWarning, match="half rate"):
        y = exl3_gemm(x, layer)
    want = ref.linear(x, layer.trellis, layer.suh, layer.svh, 2.5, "mul1")
    assert rel_l2(y.float(), want) <= TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("m,shapes", [(4, ((5120, 1152), (4096, 5120))), (300, ((5120, 12288), (5120, 4096)))])
def test_two_streams_concurrently(m, shapes, gen):
    """Two GEMMs on two streams at once (separate workspaces): both finish and both are right. m=300 on sm_90:
    stream-K (its head blocks wait on later blocks) beside a k-split fused GEMM, competing for SMs."""
    (k0, n0), (k1, n1) = shapes
    layers = [random_layer(k0, n0, 2, "mul1", generator=gen), random_layer(k1, n1, 3, "mcg", generator=gen)]
    xs32 = [torch.randn(m, L.k, generator=gen) for L in layers]
    for L, x in zip(layers, xs32):
        _check_reference(L, x[[0, m - 1]].to(torch.bfloat16), f"{L.k}x{L.n}")
    cuda = need_cuda()
    layers = [L.to(cuda) for L in layers]
    xs = [x.to(cuda, torch.bfloat16) for x in xs32]
    want = [exl3_gemm(x, L).float() for x, L in zip(xs, layers)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs: list[list[torch.Tensor]] = [[], []]

    def work(i):
        with torch.cuda.stream(streams[i]):
            for _ in range(50):
                outs[i].append(exl3_gemm(xs[i], layers[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a stream's GEMMs did not finish"
    torch.cuda.synchronize()
    for i in range(2):
        for o in outs[i]:
            # same kernel and inputs: only the fp32 split-k atomic order differs, which can flip bf16 roundings
            # (seen: 1.4e-5 at 3 blocks/SM, 1.3e-4 at 6); a race or a shared workspace gives O(1)
            assert rel_l2(o.float(), want[i]) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1, 5120, 1152), (16, 5120, 1152), (300, 5120, 1152), (300, 5120, 4096),
                                   (512, 4096, 5120)])
def test_cuda_graph_capture_and_replay(m, k, n, gen):
    """Capture once, replay with fresh x. m >= 300 on sm_90 covers the fused kernel's modes: both block shapes
    with k split (5120x1152: 128 x 128, 5120x4096: 128 x 256), stream-K (4096x5120 at m=512)."""
    layer = random_layer(k, n, 3, "mul1", bias=True, generator=gen)
    xs32 = [torch.randn(m, layer.k, generator=gen) for _ in range(4)]  # the capture's x, then one per replay
    _check_reference(layer, torch.cat([x[:1] for x in xs32]).half())
    cuda = need_cuda()
    layer = layer.to(cuda)
    x = xs32[0].to(cuda, torch.float16)
    exl3_gemm(x, layer)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = exl3_gemm(x, layer)
    for x32 in xs32[1:]:
        x.copy_(x32.to(cuda, torch.float16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.linear(x, layer.trellis, layer.suh, layer.svh, 3, "mul1", layer.bias)
        assert rel_l2(y.float(), want) <= TOL[torch.float16]
    # eager calls after the graph still see a clean workspace
    assert rel_l2(exl3_gemm(x, layer).float(), want) <= TOL[torch.float16]


@pytest.mark.gpu
def test_graph_never_replayed_does_not_poison_the_next(gen):
    """A workspace allocated inside capture A (never replayed) must still be clean for graph B and eager calls."""
    small = random_layer(256, 256, 2, "mcg", generator=gen)
    big = random_layer(256, 128 * 300, 2, "mcg", generator=gen)  # n larger than any before: grows
    x32 = torch.randn(3, 256, generator=gen)
    _check_reference(big, x32.to(torch.bfloat16))
    cuda = need_cuda()
    small, big = small.to(cuda), big.to(cuda)
    x = x32.to(cuda, torch.bfloat16)
    exl3_gemm(x, small)
    torch.cuda.synchronize()
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga):
        exl3_gemm(x, big)
    with torch.cuda.graph(gb):
        yb = exl3_gemm(x, big)
    yb.fill_(float("nan"))
    gb.replay()
    torch.cuda.synchronize()
    want = ref.linear(x, big.trellis, big.suh, big.svh, 2, "mcg")
    assert rel_l2(yb.float(), want) <= TOL[torch.bfloat16]
    del ga


if plans.current().exl3_gemm != TABLE:  # skews the table tests
    pytestmark = pytest.mark.skip(reason=f"$TWINSPARK_PLAN changes exl3_gemm's table ({plans.changes()})")
