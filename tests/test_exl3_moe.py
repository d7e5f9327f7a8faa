"""twinspark.ops.exl3_moe: the layout, the reference (against per-pair EXL3 linears), the op on the CPU, and the
CUDA kernels against the reference (marker gpu: the kernel part skips with a reason without a GPU)."""

from __future__ import annotations

import dataclasses
import itertools

import exl3_spec as spec
import pytest
import torch
from twinspark import _ext, gb10
from twinspark import moe_layout as ml
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import random_layer
from twinspark.ops import exl3_moe, plans
from twinspark.ops.exl3_moe import (
    GATE_UP4_BLOCKS_PER_SM,
    GATE_UP_BLOCKS_PER_SM,
    RATE_WORDS,
    gate_up_pdl,
    kernel_residency,
    launch_plan,
    plan_launch,
)
from twinspark.ops.workspace import workspace
from twinspark.reference.exl3_moe import exl3_moe as reference_moe
from twinspark.testing import need_cuda, rel_l2


def _plan(monkeypatch, spec: str) -> None:
    """The rest of the test runs with these exl3_moe plan keys on top of the current ones (undone at its end)."""
    monkeypatch.setattr(plans, "_current", plans.parse(spec, plans.current(), "test plan"))


# bf16 output: one rounding of the result (2^-9 relative, ~1.1e-3 RMS) plus the kernels' fp16 rounding of the
# Hadamard-transformed activations (~3e-4 each) and fp32 accumulation: 5e-3 leaves room, garbage is ~1.
TOL = 5e-3


def _pair_loop(x, ids, w, layers, first=0, limit=None):
    """Independent of the reference: per (token, slot), the factored EXL3 linears of exl3.reference."""
    out = torch.zeros(x.shape[0], layers[0][0].k, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if not 0 <= e < len(layers):
                continue
            g, u, d = layers[e]
            xt = x[t: t + 1].float()
            a = ref.linear(xt, g.trellis, g.suh, g.svh, g.K, g.codebook)
            b = ref.linear(xt, u.trellis, u.suh, u.svh, u.K, u.codebook)
            if limit is not None:
                a, b = a.clamp(max=limit), b.clamp(-limit, limit)
            h = torch.nn.functional.silu(a) * b
            out[t] += float(w[t, j]) * ref.linear(h, d.trellis, d.suh, d.svh, d.K, d.codebook)[0].double()
    return out


def _layers(E, H, inter, rates, gen, codebook="mul1"):
    return [tuple(random_layer(k, n, K, codebook, generator=gen) for (k, n), K in
                  zip([(H, inter), (H, inter), (inter, H)], rates[e % len(rates)])) for e in range(E)]


def _routing(T, top_k, E, gen, first=0, spread=None):
    spread = E if spread is None else spread
    ids = torch.stack([torch.randperm(spread, generator=gen)[:top_k] for _ in range(T)]) if T else \
        torch.zeros(0, top_k, dtype=torch.int64)
    w = torch.rand(T, top_k, generator=gen) + 0.1
    return (ids + first).to(torch.int32), (w / w.sum(1, keepdim=True)).float()


# ---------------------------------------------------------------- layout


def test_layout_round_trip_mixed_rates(gen):
    layers = _layers(3, 128, 256, [(2, 3, 4), (2.5, 3.5, 1.5), (8, 1, 5)], gen)
    ex = ml.from_layers(layers)
    assert ex.num_experts == 3 and ex.hidden == 128 and ex.inter == 256 and ex.max_words == 128
    assert (ex.offsets % ml.ALIGN == 0).all()
    assert ex.rates() == [[2.0, 3.0, 4.0], [2.5, 3.5, 1.5], [8.0, 1.0, 5.0]]
    for e, triple in enumerate(layers):
        for proj, layer in enumerate(triple):
            view = ex.layer(e, proj)
            assert view.K == layer.K and torch.equal(view.trellis, layer.trellis)
            assert torch.equal(view.suh, layer.suh) and torch.equal(view.svh, layer.svh)
    # matrices do not overlap
    spans = sorted((int(ex.offsets[e, p]), ex.matrix_bytes(e, p) // 2) for e in range(3) for p in range(3))
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] <= ex.trellis.numel()


def test_layout_uniform_rates():
    """words13 / words2: the one rate of every gate/up / down matrix (the decode kernels compiled for that rate
    alone), 0 where rates differ; construction refuses a value `words` does not bear out, and the op refuses one
    that is no rate."""
    ex = ml.empty([(3, 3, 2)] * 4, 128, 256)
    assert (ex.words13, ex.words2) == (48, 32)
    assert (ex.to("cpu").words13, ex.with_first_expert(4).words2) == (48, 32)
    assert (ml.empty([(3, 3, 2), (3, 3, 2.5)], 128, 256).words13, ml.empty([(3, 3, 2), (3, 3, 2.5)], 128, 256).words2) \
        == (48, 0)
    assert (ml.empty([(3, 2, 2)] * 2, 128, 256).words13, ml.empty([(3, 2, 2)] * 2, 128, 256).words2) == (0, 32)
    assert ml.empty([(2.5, 2.5, 1.5)], 128, 256).words13 == 40
    with pytest.raises(ml.MoeLayoutError, match="words13=32 but not every gate/up matrix has 32 words per tile"):
        dataclasses.replace(ex, words13=32)
    with pytest.raises(ml.MoeLayoutError, match="words2=48 but not every down matrix"):
        dataclasses.replace(ex, words2=48)
    bad = dataclasses.replace(ex)
    object.__setattr__(bad, "words2", 33)  # past the constructor's check
    x, ids, w = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="experts.words2 is 33, expected 0 or one rate's words per tile"):
        exl3_moe(x, ids, w, bad)


def test_layout_packed_strides():
    """With both rates uniform the decode kernels compute a matrix's place (packed_strides) instead of reading
    offsets: the strides are those of plan's layout, and construction refuses offsets that are not (a reordered
    layout) unless words13 / words2 are 0."""
    for rates, hidden, inter in (((3, 3, 2), 128, 256), ((2.5, 2.5, 1.5), 256, 128), ((4, 4, 4), 5120, 1152)):
        ex = ml.empty([rates] * 5, hidden, inter)
        e_stride, m_stride = ml.packed_strides(ex.words13, ex.words2, hidden, inter)
        assert torch.equal(ex.offsets, torch.arange(5)[:, None] * e_stride + torch.arange(3) * m_stride), rates
        assert e_stride * 5 == ex.trellis.numel()
    assert ml.packed_strides(48, 0, 128, 256) == ml.packed_strides(0, 32, 128, 256) == (0, 0)
    ex = ml.empty([(3, 3, 2)] * 4, 128, 256)
    reordered = ex.offsets.flip(0).contiguous()
    with pytest.raises(ml.MoeLayoutError, match="offsets are not the packed layout moe_layout.plan makes"):
        dataclasses.replace(ex, offsets=reordered)
    assert dataclasses.replace(ex, offsets=reordered, words13=0, words2=0).words13 == 0


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda g, u, d: (random_layer(128, 128, 3, generator=None), u, d), "is 128x128, the layout expects 128x256"),
    (lambda g, u, d: (g, random_layer(128, 256, 4), d), "expert 0 up has K=4.0, the layout was planned with K=3.0"),
    (lambda g, u, d: (g, u, random_layer(256, 128, 3, codebook="mcg")), "uses codebook mcg"),
    (lambda g, u, d: (g, u, random_layer(256, 128, 3, bias=True)), "has a bias"),
])
def test_layout_refuses_mismatches(gen, mutate, message):
    g, u, d = _layers(1, 128, 256, [(3, 3, 3)], gen)[0]
    ex = ml.empty([[3, 3, 3]], 128, 256)
    with pytest.raises(ml.MoeLayoutError, match=message):
        ml.set_expert(ex, 0, *mutate(g, u, d))


def test_layout_refuses_bad_dims_and_rates():
    with pytest.raises(ml.MoeLayoutError, match="multiples of 128"):
        ml.empty([[3, 3, 3]], 128, 192)
    with pytest.raises(ml.MoeLayoutError, match="expert 1 down: K=4.5 is not an EXL3 rate"):
        ml.plan([[3, 3, 3], [3, 3, 4.5]], 128, 128)


def test_tensor_parallel_split_sums_to_the_whole(gen):
    """Rank outputs of the intermediate split add up to the unsplit layer (the caller's all-reduce)."""
    H, inter, E, world = 128, 256, 3, 2
    layers = _layers(E, H, inter, [(3, 2, 4)], gen)
    x = torch.randn(5, H, generator=gen).bfloat16()
    ids, w = _routing(5, 2, E, gen)
    whole = reference_moe(x.float(), ids, w, ml.from_layers(layers)).double()
    parts = []
    for rank in range(world):
        shard = [tuple(ml.shard_intermediate(m, p, rank, world) for p, m in enumerate(t)) for t in layers]
        assert shard[0][0].n == inter // world and shard[0][2].k == inter // world
        parts.append(reference_moe(x.float(), ids, w, ml.from_layers(shard)).double())
    assert rel_l2(parts[0] + parts[1], whole) < 1e-5
    with pytest.raises(ml.MoeLayoutError, match="does not split into 4 slices of a multiple of 128"):
        ml.shard_intermediate(layers[0][0], ml.GATE, 0, 4)


# ---------------------------------------------------------------- reference and the CPU op


@pytest.mark.parametrize(("T", "top_k", "limit"), [(1, 1, None), (3, 2, None), (4, 3, 0.5), (0, 2, None)])
def test_reference_matches_per_pair_linears(T, top_k, limit, gen):
    E, H, inter = 4, 128, 256
    layers = _layers(E, H, inter, [(3, 3, 3), (2, 4, 2.5)], gen)
    ex = ml.from_layers(layers)
    x = torch.randn(T, H, generator=gen).float()
    ids, w = _routing(T, top_k, E, gen)
    got = reference_moe(x, ids, w, ex, limit=limit)
    want = _pair_loop(x, ids, w, layers, limit=limit)
    assert got.shape == (T, H)
    if T:
        assert rel_l2(got, want) < 1e-5


def test_cpu_op_duplicates_range_and_dtype(gen):
    """Duplicate ids in a row count twice; ids outside this rank's range (and -1) count nothing."""
    E, H, inter, first = 3, 128, 128, 5
    layers = _layers(E, H, inter, [(3, 3, 3)], gen)
    ex = ml.from_layers(layers, first_expert=first)
    x = torch.randn(4, H, generator=gen).bfloat16()
    ids = torch.tensor([[5, 5, 7], [0, 6, -1], [8, 9, 1], [7, 7, 7]], dtype=torch.int64)
    w = torch.rand(4, 3, generator=gen)
    got = exl3_moe(x, ids, w, ex)
    assert got.dtype == torch.bfloat16 and got.shape == (4, H)
    want = _pair_loop(x, ids, w, layers, first=first)
    assert rel_l2(got, want) < TOL
    assert torch.count_nonzero(got[2]) == 0  # no local expert in row 2


def test_opcheck_and_fake_tracing(gen):
    ex = ml.random_experts(3, 128, 128, rates=[(3, 3, 3), (2, 2, 2), (4, 4, 4)], generator=gen)
    x = torch.randn(2, 128, generator=gen).bfloat16()
    ids, w = _routing(2, 2, 3, gen)
    args = (x, ids, w, ex.trellis, ex.offsets, ex.words, ex.suh13, ex.svh13, ex.suh2, ex.svh2, 0, ex.max_words,
            ex.words13, ex.words2, "mul1", "silu", None)
    torch.library.opcheck(torch.ops.twinspark.exl3_moe.default, args)
    # vLLM traces apply(): the wrapper must trace with fake tensors (no .tolist(), no data-dependent branch).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(lambda a, b, c: exl3_moe(a, b, c, ex, limit=7.0))(x, ids, w)
    assert any("twinspark.exl3_moe" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize(("args", "message"), [
    (lambda x, i, w: (x.float(), i, w), "exl3_moe: expected x to be bfloat16 or float16"),
    (lambda x, i, w: (x[:, :64], i, w), r"expected x to be 2-D \[T, 128\]"),
    (lambda x, i, w: (x, i.float(), w), "expected topk_ids to be int32 or int64"),
    (lambda x, i, w: (x, i[:1], w), r"expected topk_ids to be \[T=2, top_k\]"),
    (lambda x, i, w: (x, i, w[:, :1]), "expected topk_weights to have topk_ids' shape"),
])
def test_bad_inputs(args, message, gen):
    ex = ml.random_experts(2, 128, 128, generator=gen)
    x = torch.randn(2, 128, generator=gen).bfloat16()
    ids, w = _routing(2, 2, 2, gen)
    with pytest.raises((TypeError, ValueError), match=message):
        exl3_moe(*args(x, ids, w), ex)
    with pytest.raises(ValueError, match="expected activation in"):
        exl3_moe(x, ids, w, ex, activation="gelu")


def test_plan_launch_covers_every_item():
    """The item bound the grids cover is never below the item count of the worst routing: one row on each of
    min(E, P) experts, the rest stacked into as many extra full items as they fill; for both gate/up sizings."""
    for T, top_k, E, gub in itertools.product((1, 2, 3, 8, 17, 64, 512, 2048, 8192), (1, 6, 8), (1, 3, 384),
                                               (GATE_UP_BLOCKS_PER_SM, GATE_UP4_BLOCKS_PER_SM)):
        cfg = plan_launch(T, top_k, E, 5120, 1152, sms=132, gate_up_blocks=gub)
        P, rows = T * top_k, 16 * cfg["mt"]
        used = min(E, P)
        assert cfg["max_items"] >= used + (P - used) // rows, (T, top_k, E, cfg)
        kbs, s = 5120 // 128, cfg["splitk"]
        assert 1 <= s <= kbs and (s - 1) * -(-kbs // s) < kbs, "an empty k-split part"
        assert cfg["mt"] == 1 or P > 64
        assert cfg["down_min_blocks"] in (2, 3)
        assert cfg["gate_up_blocks"] == (gub if P <= 64 else GATE_UP_BLOCKS_PER_SM)
        groups, ns = cfg["max_items"] * (1152 // 128), cfg["short_groups"]
        assert 0 <= ns <= groups and (ns == 0 or (cfg["mt"] == 1 and s >= 2)), cfg
        if ns:  # the short groups' parts are whole too, and the mixed grid fits the SMs' gate/up slots
            assert (s - 2) * -(-kbs // (s - 1)) < kbs, cfg
            assert 2 * ns * (s - 1) + 2 * (groups - ns) * s <= cfg["gate_up_blocks"] * 132, cfg


def test_plan_launch_mixed_split_fills_the_gpu_at_one_token():
    """T=1, top-6 at the model's shapes on an H200: 18 (item, 128 columns) groups in 3 parts and 36 in 4 make
    exactly the 396 blocks that are resident at once; a forced split stays uniform."""
    cfg = plan_launch(1, 6, 384, 5120, 1152, sms=132)
    assert (cfg["splitk"], cfg["short_groups"], cfg["max_items"]) == (4, 18, 6)
    assert 2 * 18 * 3 + 2 * 36 * 4 == GATE_UP_BLOCKS_PER_SM * 132
    assert plan_launch(4, 6, 384, 5120, 1152, sms=132)["short_groups"] == 0  # already two waves


def test_plan_launch_four_gate_up_blocks_per_sm():
    """With mul1's one-rate gate/up kernels at 4 blocks per SM, T=1 splits 6 groups into 4 parts and 48 into 5:
    exactly 528 resident blocks; from T=2 on the parts are those of 3 per SM. Any other sizing is refused."""
    cfg = plan_launch(1, 6, 384, 5120, 1152, sms=132, gate_up_blocks=4)
    assert (cfg["splitk"], cfg["short_groups"], cfg["gate_up_blocks"]) == (5, 6, 4)
    assert 2 * 6 * 4 + 2 * 48 * 5 == 4 * 132
    for T in (2, 4, 8):
        three, four = (plan_launch(T, 6, 384, 5120, 1152, sms=132, gate_up_blocks=b) for b in (3, 4))
        assert (four["splitk"], four["short_groups"]) == (three["splitk"], three["short_groups"]), T
    with pytest.raises(ValueError, match="gate_up_blocks is 5, expected 3 or 4"):
        plan_launch(1, 6, 384, 5120, 1152, sms=132, gate_up_blocks=5)


def test_plan_launch_forced_split(monkeypatch):
    """The sweep key: N forces N uniform parts, "Nm" N parts with the mixed split on top (T=2 at 4 blocks per SM:
    60 groups in 2 parts and 48 in 3 = 528 resident blocks); anything else is refused with one sentence."""
    _plan(monkeypatch, "exl3_moe.split_k=2")
    cfg = plan_launch(2, 6, 384, 5120, 1152, sms=132, gate_up_blocks=4)
    assert (cfg["splitk"], cfg["short_groups"]) == (2, 0)
    _plan(monkeypatch, "exl3_moe.split_k=2m")
    cfg = plan_launch(2, 6, 384, 5120, 1152, sms=132, gate_up_blocks=4)
    assert (cfg["splitk"], cfg["short_groups"]) == (3, 60)
    assert 2 * 60 * 2 + 2 * 48 * 3 == 4 * 132
    with pytest.raises(ValueError, match="exl3_moe.split_k='two' is not accepted"):
        _plan(monkeypatch, "exl3_moe.split_k=two")


def test_plan_launch_four_down_blocks_per_sm():
    """With mul1's one-rate down kernel at 4 blocks per SM available (down4), decode runs it wherever 2 per SM would
    take more than one wave (T >= 2 at 5120 / top-6 on 132 SMs); one token keeps 2, prefill never takes it."""
    for T, want in ((1, 2), (2, 4), (4, 4), (8, 4)):
        assert plan_launch(T, 6, 384, 5120, 1152, sms=132, down4=True)["down_min_blocks"] == want, T
        assert plan_launch(T, 6, 384, 5120, 1152, sms=132)["down_min_blocks"] in (2, 3), T
    assert plan_launch(2048, 6, 384, 5120, 1152, sms=132, down4=True)["down_min_blocks"] == 3


def test_plan_launch_early_down_past_one_wave(monkeypatch):
    """Down blocks start per item (early_down) where gate/up takes more than one wave; at one token (gate/up in one
    wave) they wait for the grid; the plan key forces either; 64-row items never start early."""
    _plan(monkeypatch, "exl3_moe.early_down=auto")
    assert not plan_launch(1, 6, 384, 5120, 1152, sms=132)["early_down"]
    assert plan_launch(2, 6, 384, 5120, 1152, sms=132)["early_down"]
    assert plan_launch(4, 6, 384, 5120, 1152, sms=132)["early_down"]
    assert not plan_launch(2048, 6, 384, 5120, 1152, sms=132)["early_down"]  # 64-row items
    _plan(monkeypatch, "exl3_moe.early_down=1")
    assert plan_launch(1, 6, 384, 5120, 1152, sms=132)["early_down"]
    _plan(monkeypatch, "exl3_moe.early_down=0")
    assert not plan_launch(4, 6, 384, 5120, 1152, sms=132)["early_down"]


def test_rate_words_match_the_kernels():
    """Python's rate list (what the layout check accepts for words13 / words2) is the list of rates the extension
    has decode kernels for (exl3_moe.h kExl3MoeRateWords)."""
    if not _ext.with_cuda():
        pytest.skip("no CUDA build of the extension here (CPU-only or not built): no decode kernels to compare with")
    assert tuple(_ext.module().exl3_moe_rate_words) == RATE_WORDS


# Shared memory per SM (bytes) of the H200 and of GB10 (compute capability 12.x, the CUDA programming guide's table),
# the driver's reservation per block on both, and the 16-row kernels' static shared memory (ptxas -v: 800 B).
H200_SMEM, GB10_SMEM, RESERVED, STATIC = 228 * 1024, int(gb10.SMEM_PER_SM.value), 1024, 800
A_KB = 16 * 136 * 2  # one 16-row k-block of fp16 A (moe_gemm.cuh kAKbBytes)


def _ring(words):
    return 3 * 64 * words * 2  # kStages trellis buffers of 64 tiles


def test_a_region_fits_the_residency():
    """The 16-row kernels' A region (moe_gemm.cuh fit_a_bytes): the full one where the blocks per SM the registers
    allow fit beside it, else the most whole k-blocks that leave room for them (never under two). On the H200 the
    model's rates keep the full region; on GB10 at K=3 gate/up gets 3 k-blocks (3 blocks per SM instead of 1) and the
    one-token down kernel 7 (2 instead of 1)."""
    if not _ext.with_cuda():
        pytest.skip("no CUDA build of the extension here (CPU-only or not built): nothing to size")
    fit = _ext.module().exl3_moe_a_bytes
    full = {False: 8 * A_KB, True: 10 * A_KB}
    for words in (32, 48, 64):  # K = 2, 3, 4
        assert fit(False, words, STATIC, RESERVED, H200_SMEM, 3) == full[False]
        assert fit(True, words, STATIC, RESERVED, H200_SMEM, 2) == full[True]
    assert fit(False, 48, STATIC, RESERVED, GB10_SMEM, 3) == 3 * A_KB
    assert fit(True, 48, STATIC, RESERVED, GB10_SMEM, 2) == 7 * A_KB
    for per_sm in (GB10_SMEM, H200_SMEM, 164 * 1024):
        for down in (False, True):
            for words in RATE_WORDS:
                for blocks in (1, 2, 3):
                    a = fit(down, words, STATIC, RESERVED, per_sm, blocks)
                    fixed = _ring(words) + STATIC + RESERVED
                    assert a % A_KB == 0 and 2 * A_KB <= a <= full[down], (per_sm, down, words, blocks, a)
                    assert blocks * (a + fixed) <= per_sm or a == 2 * A_KB, (per_sm, down, words, blocks, a)
                    if a < full[down]:  # shrunk: the most that fits (per_sm // blocks each), or the floor
                        assert blocks * (a + A_KB + fixed) > blocks * (per_sm // blocks) or a == 2 * A_KB, (
                            per_sm, down, words, blocks, a)
    assert fit(False, 8, STATIC, RESERVED, GB10_SMEM, 3) == -1
    assert fit(False, 48, STATIC, RESERVED, GB10_SMEM, 0) == -1


def test_smem_per_sm_override_is_checked(monkeypatch):
    """The plan's exl3_moe.smem_per_sm must be a device's byte count: anything else is one clear error."""
    _plan(monkeypatch, f"exl3_moe.smem_per_sm={GB10_SMEM}")
    assert plan_launch(1, 6, 384, 5120, 1152, 132)["smem_per_sm"] == GB10_SMEM
    for bad in ("100KB", "4096", "-1", str(10**7)):
        with pytest.raises(ValueError, match=f"exl3_moe.smem_per_sm='{bad}' is not accepted"):
            _plan(monkeypatch, f"exl3_moe.smem_per_sm={bad}")
    _plan(monkeypatch, "exl3_moe.smem_per_sm=0")
    assert plan_launch(1, 6, 384, 5120, 1152, 132)["smem_per_sm"] == 0


def test_gate_up_pdl_only_under_capture(monkeypatch):
    """gate/up launches with programmatic dependent launch inside a CUDA graph capture, plainly in eager calls (the
    launch costs the host more); the plan key forces either."""
    _plan(monkeypatch, "exl3_moe.pdl=auto")
    assert gate_up_pdl(True) and not gate_up_pdl(False)
    _plan(monkeypatch, "exl3_moe.pdl=1")
    assert gate_up_pdl(False)
    _plan(monkeypatch, "exl3_moe.pdl=0")
    assert not gate_up_pdl(True)


# ---------------------------------------------------------------- kernels (GPU)
# The reference runs in float32 on float32 copies of the inputs (no rounding of its result), the kernel returns
# bf16/fp16: TOL covers the kernel's output rounding and its fp16 activations.


def _inputs(gen, T, top_k, E, H, first=0, dtype=torch.bfloat16, ids=None):
    x = torch.randn(T, H, generator=gen).to(dtype)
    if ids is None:
        ids, w = _routing(T, top_k, E, gen, first=first)
    else:
        w = torch.rand(ids.shape, generator=gen)
    return x, ids, w


def _check_kernel(cuda, ex, exd, x, ids, w, limit=None):
    # The reference runs on the GPU too (pure torch, quicker than the CPU for these sizes).
    want = reference_moe(x.float().to(cuda), ids.to(cuda), w.to(cuda), exd, limit=limit).double().cpu()
    got = exl3_moe(x.to(cuda), ids.to(cuda), w.to(cuda), exd, limit=limit)
    torch.cuda.synchronize()
    assert got.dtype == x.dtype and got.shape == x.shape
    return got.cpu(), want


# The reference part of every GPU test (runs everywhere, before need_cuda()): the reference on a few tokens of each
# input set the test draws (the first and last; the first only at hidden x inter above 2^20) against a float64 loop
# over their (token, slot) pairs through the spec decoder's weights (tests/exl3_spec.py), in one reference call per
# layer. Past inter = 256 both take the first 128 intermediate columns (the rank-0 slice of an inter/128-way tensor
# parallel split: gate/up columns and down rows 0..127), which add up to the whole with the other slices
# (test_tensor_parallel_split_sums_to_the_whole): decoding whole experts of the model's size on a CPU takes minutes.
# fp32 reference vs float64: two GEMMs of <= 5120 terms, each rounding by <= 2^-24 relative: ~1e-6; a wrong decode,
# route, weight or activation gives O(1).
REF_TOL = 1e-5


def _slice_inter(ex: ml.Exl3MoeExperts) -> ml.Exl3MoeExperts:
    if ex.inter <= 256:
        return ex
    world = ex.inter // 128
    return ml.from_layers([tuple(ml.shard_intermediate(ex.layer(e, p), p, 0, world) for p in range(3))
                           for e in range(ex.num_experts)], first_expert=ex.first_expert)


def _pairs_f64(ex: ml.Exl3MoeExperts, x, ids, w, limit=None) -> torch.Tensor:
    """Independent of the reference: per (token, slot), y += w * down(silu(gate(x)) * up(x)) in float64 with the spec
    decoder's W (each matrix decoded once)."""
    weights: dict[tuple[int, int], torch.Tensor] = {}

    def weight(e, p):
        if (e, p) not in weights:
            m = ex.layer(e, p)
            weights[e, p] = torch.from_numpy(spec.weight(m.trellis, m.suh, m.svh, m.K, m.codebook))
        return weights[e, p]

    out = torch.zeros(x.shape[0], ex.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - ex.first_expert
            if not 0 <= e < ex.num_experts:
                continue
            xt = x[t].double()
            a, b = xt @ weight(e, 0), xt @ weight(e, 1)
            if limit is not None:
                a, b = a.clamp(max=limit), b.clamp(-limit, limit)
            out[t] += float(w[t, j]) * ((a * torch.sigmoid(a) * b) @ weight(e, 2))
    return out


def _reference_part(ex: ml.Exl3MoeExperts, inputs, limit=None, label="") -> None:
    """inputs: [(x, ids, w)] the kernel part will run on ex; their probe tokens in one reference call, ids padded
    with -1 (no expert) to the widest top_k."""
    big = ex.hidden * ex.inter > 1 << 20
    xs, idss, ws = [], [], []
    for x, ids, w in inputs:
        T = x.shape[0]
        assert x.shape == (T, ex.hidden) and x.dtype in (torch.bfloat16, torch.float16)
        assert ids.shape == w.shape and ids.shape[0] == T and ids.dtype == torch.int32 and torch.isfinite(w).all()
        rows = [0] if big else sorted({0, T - 1})
        xs.append(x[rows].float())
        idss.append(ids[rows].long())
        ws.append(w[rows].float())
    top_k = max(i.shape[1] for i in idss)
    x = torch.cat(xs)
    ids = torch.cat([torch.nn.functional.pad(i, (0, top_k - i.shape[1]), value=-1) for i in idss])
    w = torch.cat([torch.nn.functional.pad(v, (0, top_k - v.shape[1])) for v in ws])
    part = _slice_inter(ex)
    got = reference_moe(x, ids, w, part, limit=limit)
    assert got.dtype == torch.float32 and got.shape == x.shape
    err = rel_l2(got, _pairs_f64(part, x, ids, w, limit))
    assert err <= REF_TOL, f"{label}: reference vs spec pairs, rel L2 {err:.3g}"


def _case(gen, T, top_k, E=16, H=512, inter=256, rates=((3, 3, 3),), first=0, limit=None, dtype=torch.bfloat16,
          ids=None, codebook="mul1"):
    """A random layer and inputs, with the reference part run on them: a case for _run."""
    ex = ml.random_experts(E, H, inter, rates=[rates[e % len(rates)] for e in range(E)], codebook=codebook,
                           first_expert=first, generator=gen)
    x, ids, w = _inputs(gen, T, top_k, E, H, first, dtype, ids)
    _reference_part(ex, [(x, ids, w)], limit, f"T={T} top_k={top_k}")
    return ex, x, ids, w, limit


def _run(case, cuda):
    """The kernel part of a case: (kernel output, reference) on the CPU."""
    ex, x, ids, w, limit = case
    return _check_kernel(cuda, ex, ex.to(cuda), x, ids, w, limit)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8, 17, 64, 512])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_kernel_matches_reference(T, top_k, gen):
    case = _case(gen, T, top_k)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL, f"T={T} top_k={top_k}"


@pytest.mark.gpu
@pytest.mark.parametrize("splitk", [1, 3, 7, 40])
def test_kernel_forced_splits(splitk, gen, monkeypatch):
    """Decode with gate/up split over H at every kind of part size (40 k-blocks: one chunk of A, several, parts
    of one k-block), at the model's dimensions."""
    _plan(monkeypatch, f"exl3_moe.split_k={splitk}")
    cases = [(T, top_k, _case(gen, T, top_k, E=12, H=5120, inter=1152, rates=((2, 3, 4), (4, 2, 3))))
             for T, top_k in ((1, 6), (3, 4), (8, 8))]
    cuda = need_cuda()
    for T, top_k, case in cases:
        got, want = _run(case, cuda)
        assert rel_l2(got, want) <= TOL, f"T={T} top_k={top_k} splitk={splitk}"


@pytest.mark.gpu
@pytest.mark.parametrize("T, top_k, dup", [(1, 6, False), (1, 6, True), (1, 1, False), (1, 8, False)])
def test_kernel_mixed_split(T, top_k, dup, gen, monkeypatch):
    """The planned decode split at the model's dimensions, where (item, columns) groups differ in part count
    (T=1, top-6: 3 and 4 parts); with duplicate ids fewer items than the grid covers are real."""
    _plan(monkeypatch, "exl3_moe.split_k=auto")
    ids = None
    if dup:
        ids = torch.tensor([[2, 5, 2, 7, 5, 2]], dtype=torch.int32)
    case = _case(gen, T, top_k, E=12, H=5120, inter=1152, rates=((2, 3, 4), (4, 2, 3)), ids=ids)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL, f"T={T} top_k={top_k} dup={dup}"


@pytest.mark.gpu
@pytest.mark.parametrize(("rates", "codebook"), [(((2, 2, 2),), "mul1"), (((3, 3, 2),), "mcg"),
                                                 (((4, 4, 3),), "3inst"), (((2.5, 2.5, 4),), "mul1"),
                                                 (((4, 4, 3), (4, 4, 2)), "mul1")])  # half rates: mul1 only
def test_kernel_rate_kernels(rates, codebook, gen, monkeypatch):
    """Layers whose gate/up (down) matrices share one rate run the 16-row kernels compiled for that rate alone in
    decode (words13 / words2; the last case: gate/up only, down dispatches per expert); the same layer through the
    kernels that dispatch on every expert's rate (exl3_moe.rate_kernels=0), the rate kernels reading offsets instead
    of computing them (exl3_moe.packed=0) and mul1's gate/up at 3 blocks per SM instead of 4 (exl3_moe.gate_up4=0)
    must agree with the reference too. Model dimensions; decode (T=1, 4) and a
    routed call (T=17: the dispatching kernels either way)."""
    _plan(monkeypatch, "exl3_moe.split_k=auto")
    ex = ml.random_experts(12, 5120, 1152, rates=[rates[e % len(rates)] for e in range(12)], codebook=codebook,
                           generator=gen)
    assert ex.words13 == ref.words_per_tile(rates[0][0])
    assert ex.words2 == (ref.words_per_tile(rates[0][2]) if len(rates) == 1 else 0)
    inputs = [(T, _inputs(gen, T, top_k, 12, 5120)) for T, top_k in ((1, 6), (4, 6), (8, 6), (17, 6))]
    _reference_part(ex, [i for _, i in inputs], label=f"{rates} {codebook}")
    cuda = need_cuda()
    exd = ex.to(cuda)
    # rate kernels (with both rates uniform: matrices placed by packed_strides; mul1: gate/up at 4 blocks per SM),
    # the same with offsets read, at 3 gate/up blocks per SM, the dispatching kernels
    # (the first case, mul1 with one down rate, runs down at 4 per SM at T=4 and 8, at T=8 items of 5-8 rows in the
    # fp16 decode there; at 2-3 per SM with exl3_moe.down4=0; at 4 at one token too, forced; the other
    # cases keep 2-3 whatever the keys say)
    configs = {"rate": ("1", "1", "auto", "auto", "auto"), "rate, offsets read": ("1", "0", "auto", "auto", "auto"),
               "rate, gate/up 3 per SM": ("1", "1", "0", "auto", "auto"),
               "rate, down 2-3 per SM": ("1", "1", "auto", "0", "auto"),
               "rate, down 4 per SM everywhere": ("1", "1", "auto", "auto", "4"),
               "dispatch": ("0", "1", "auto", "auto", "auto")}
    for T, (x, ids, w) in inputs:
        outs = {}
        for name, (rate_kernels, packed, gate_up4, down4, down_blocks) in configs.items():
            _plan(monkeypatch, f"exl3_moe.rate_kernels={rate_kernels},exl3_moe.packed={packed},"
                               f"exl3_moe.gate_up4={gate_up4},exl3_moe.down4={down4},exl3_moe.down_blocks={down_blocks}")
            got, want = _check_kernel(cuda, ex, exd, x, ids, w)
            assert rel_l2(got, want) <= TOL, f"T={T} {name}"
            outs[name] = got
        for name in configs:  # the same math; fp32 atomics land in any order
            assert rel_l2(outs[name], outs["rate"]) <= 1e-3, f"T={T} {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("prep", ["0", "1"])
def test_kernel_prefill_prep(prep, gen, monkeypatch):
    """64-row items (prefill) with A made once per pair by prep_a_kernel (1) or built in every block (0): mixed rates,
    one rank's half of the experts (the prep launches skip the other half's pairs), items of 64 rows and a partial
    last one, bf16 and fp16, at hidden 1024 and the model's intermediate size."""
    _plan(monkeypatch, f"exl3_moe.prefill_prep={prep},exl3_moe.prefill_rows=4")
    ex = ml.random_experts(12, 1024, 1152, rates=[(2, 3, 4), (3, 3, 2), (4, 2, 3)], codebook="mul1", first_expert=12,
                           generator=gen)
    calls = [(T, top_k, _inputs(gen, T, top_k, 24, 1024, dtype=dtype))
             for T, top_k, dtype in ((100, 6, torch.bfloat16), (300, 8, torch.float16))]
    _reference_part(ex, [c[2] for c in calls])
    cuda = need_cuda()
    exd = ex.to(cuda)
    for T, top_k, (x, ids, w) in calls:
        cfg = launch_plan(x.to(cuda), ids.to(cuda), exd)
        assert cfg["mt"] == 4 and cfg["prep_a"] == (prep == "1"), cfg
        got, want = _check_kernel(cuda, ex, exd, x, ids, w)
        assert rel_l2(got, want) <= TOL, f"T={T} top_k={top_k} prep={prep}"


@pytest.mark.gpu
@pytest.mark.parametrize("early", ["0", "1"])
def test_kernel_early_down(early, gen, monkeypatch):
    """16-row items with the down blocks waiting for their own item's activations (early) or for the whole gate/up
    grid: decode (in-block routing) and the routing launch, three calls at each size; after every call the
    per-stream counters (shared by calls of every size, laid out by max_items) must be zero again."""
    _plan(monkeypatch, f"exl3_moe.early_down={early}")
    ex = ml.random_experts(16, 1024, 1152, rates=[(2, 3, 4), (3, 2, 2.5), (4, 4, 2)], codebook="mul1",
                           generator=gen)
    calls = [(T, top_k, call, _inputs(gen, T, top_k, 16, 1024))
             for T, top_k in ((1, 6), (4, 6), (3, 8), (17, 6), (1, 6)) for call in range(3)]
    _reference_part(ex, [c[3] for c in calls])
    cuda = need_cuda()
    exd = ex.to(cuda)
    for T, top_k, call, (x, ids, w) in calls:
        got, want = _check_kernel(cuda, ex, exd, x, ids, w)
        assert rel_l2(got, want) <= TOL, f"T={T} top_k={top_k} call {call}"
        counters = workspace(exd.trellis.device).zeroed("moe_act_counters", 1, torch.int32, 0)
        assert not counters.any(), f"T={T} call {call}: counters left {counters.nonzero().flatten().tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("bytesum", ["0", "1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_kernel_bytesum_rows(rows, bytesum, gen, monkeypatch):
    """mul1 items of 1-4 rows take the byte-sum mma (x' as int8 hi/lo per row and k-block), 5 rows the fp16 decode;
    both switch settings at the model's dimensions (x' chunks of 32 / 16 / 10 / 8 k-blocks in gate/up, whole
    rates and a half rate). Row 1 is all zeros (a zero scale), row 2 has one channel 1000x the rest."""
    _plan(monkeypatch, f"exl3_moe.bytesum={bytesum}")
    _plan(monkeypatch, "exl3_moe.split_k=auto")
    ex = ml.random_experts(4, 5120, 1152, rates=[(2, 3, 4), (2.5, 2, 3), (3, 3, 2), (4, 2, 2)], codebook="mul1",
                           generator=gen)
    x, _, w = _inputs(gen, rows, 1, 4, 5120)
    if rows > 1:
        x[1] = 0
    if rows > 2:
        x[2, 77] = 1000 * x[2].abs().max()
    per_expert = [torch.full((rows, 1), e, dtype=torch.int32) for e in range(4)]
    _reference_part(ex, [(x, ids, w) for ids in per_expert])
    zero = reference_moe(x.float(), per_expert[0], w, _slice_inter(ex))  # any slice of a zero token's output is zero
    assert rows < 2 or not zero[1].any(), "a zero token must give a zero reference output"
    cuda = need_cuda()
    for e, ids in enumerate(per_expert):  # every pair on expert e: one item of `rows` rows
        got, want = _check_kernel(cuda, ex, ex.to(cuda), x, ids, w)
        for r in range(rows):  # per token: the outlier row would hide the others' errors in one norm
            if r == 1:
                assert not got[r].any(), "a zero token must give a zero output"
            else:
                assert rel_l2(got[r], want[r]) <= TOL, f"expert {e} token {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [3, 4, 5, 7])
def test_kernel_other_top_k(top_k, gen):
    case = _case(gen, 5, top_k)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 512, 2048])
def test_kernel_all_tokens_on_one_expert(T, gen):
    """One expert gets every pair: many items of one expert (64-row items from T=512 on)."""
    case = _case(gen, T, 1, ids=torch.full((T, 1), 3, dtype=torch.int32))
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 8, 64, 512])
def test_kernel_duplicates_and_idle_experts(T, gen):
    """Ids repeat inside rows (both pairs count) and most experts get no token."""
    ids = torch.randint(0, 3, (T, 6), generator=gen, dtype=torch.int32)
    case = _case(gen, T, 6, ids=ids)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 512])
def test_kernel_mixed_rates_limit_fp16(T, gen):
    rates = ((2, 3, 4), (2.5, 3.5, 1.5), (4, 4, 2), (5, 6, 8), (1, 7, 3))
    case = _case(gen, T, 4, rates=rates, limit=0.8, dtype=torch.float16)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", ["3inst", "mcg"])
def test_kernel_other_codebooks(codebook, gen):
    case = _case(gen, 6, 3, E=8, H=256, inter=128, rates=((3, 4, 2),), codebook=codebook)
    got, want = _run(case, need_cuda())
    assert rel_l2(got, want) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_kernel_expert_range(T, gen):
    """This rank holds global experts 32..47 of 64; ids elsewhere (and -1) count nothing."""
    E, first = 16, 32
    ids = torch.randint(-1, 64, (T, 6), generator=gen, dtype=torch.int32)
    ids[0, 0] = first  # at least one local pair
    case = _case(gen, T, 6, E=E, first=first, ids=ids)
    foreign = _case(gen, T, 6, E=E, first=first, ids=torch.full((T, 6), 3, dtype=torch.int32))
    ex0, x0, ids0, w0, _ = foreign
    assert not reference_moe(x0.float(), ids0, w0, ex0).any(), "ids of another rank only: the reference must be zero"
    cuda = need_cuda()
    got, want = _run(case, cuda)
    assert rel_l2(got, want) <= TOL
    got0, _ = _run(foreign, cuda)
    assert torch.count_nonzero(got0) == 0


@pytest.mark.gpu
def test_kernel_trace_marks(gen):
    """A trace buffer (bench/profile_exl3.py --trace) leaves the result alone. A release build ignores it; a
    TWINSPARK_TRACE=1 build marks every block that ran, its marks in time order (start <= routed <= body done <=
    end), and exactly one gate/up block per (item, 128 columns of I) makes the activations."""
    import importlib

    from twinspark import _ext

    mod = importlib.import_module("twinspark.ops.exl3_moe")
    ex_cpu = ml.random_experts(12, 5120, 1152, rates=[(2, 3, 4)] * 12, generator=gen)
    inputs = _inputs(gen, 1, 6, 12, 5120)
    _reference_part(ex_cpu, [inputs])
    cuda = need_cuda()
    ex = ex_cpu.to(cuda)
    x, ids, w = (t.to(cuda) for t in inputs)
    buf = torch.zeros(_ext.module().trace_shape, dtype=torch.int64, device=cuda)
    args = (x, ids, w, ex.trellis, ex.offsets, ex.words, ex.suh13, ex.svh13, ex.suh2, ex.svh2, ex.first_expert,
            ex.max_words, ex.words13, ex.words2, ex.codebook, None)
    plain = mod._kernel(*args)
    traced = mod._kernel(*args, trace=buf)
    torch.cuda.synchronize()
    assert rel_l2(traced.cpu(), plain.cpu()) <= 1e-3  # not bit-exact: fp32 atomics land in any order
    rows = buf.cpu()
    if not _ext.module().trace_built:
        assert int(rows.abs().sum()) == 0, "a release build wrote trace marks"
        pytest.skip("the marks need a TWINSPARK_TRACE=1 build (the release build ignored the buffer: checked)")
    for k in range(2):
        ran = rows[k][rows[k][:, 0] > 0]
        work = ran[ran[:, 2] > 0]
        assert len(work) > 0
        assert bool((work[:, 1] <= work[:, 2]).all() and (work[:, 2] <= work[:, 3]).all()
                    and (work[:, 3] <= work[:, 4]).all())
    assert int((rows[0][:, 5] > 0).sum()) == 6 * (1152 // 128)


@pytest.mark.gpu
def test_kernel_two_streams_and_graph(gen):
    """Three streams at once give the results of one (two of them use per-stream arrival counters); the op
    captures into a CUDA graph and routes on replay."""
    E, H, inter = 16, 512, 256
    ex = ml.random_experts(E, H, inter, rates=(3, 2, 4), generator=gen)
    drawn = [_inputs(gen, T, 6, E, H) for T in (4, 40, 300)]  # decode, routing launch (16-row items), prefill (64)
    replays = [_inputs(gen, 4, 6, E, H) for _ in range(3)]  # fresh routing for each replay
    _reference_part(ex, drawn + replays)
    cuda = need_cuda()
    exd = ex.to(cuda)
    small, mid, large = ([t.to(cuda) for t in inputs] for inputs in drawn)
    firsts = [exl3_moe(*args, exd) for args in (small, mid, large)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(3)]
    outs = []
    for _ in range(20):
        row = []
        for s, args in zip(streams, (small, mid, large)):
            with torch.cuda.stream(s):
                row.append(exl3_moe(*args, exd))
        outs.append(row)
    torch.cuda.synchronize()
    for row in outs:  # fp32 atomics may sum in another order: equal up to an ulp of the output, not bitwise
        for got, first in zip(row, firsts):
            assert rel_l2(got, first) < 1e-3
    xs, ids_s, ws = (t.clone() for t in small)
    exl3_moe(xs, ids_s, ws, exd)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = exl3_moe(xs, ids_s, ws, exd)
    for x, ids, w in replays:  # fresh routing each replay: the graph must route on the device
        xs.copy_(x.to(cuda)), ids_s.copy_(ids.to(cuda)), ws.copy_(w.to(cuda))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(out.cpu(), reference_moe(x.float(), ids, w, ex).double()) <= TOL  # CPU reference here


@pytest.mark.gpu
def test_kernel_pdl_waits_for_the_kernel_before(gen, monkeypatch):
    """gate/up launched with programmatic dependent launch (by default under graph capture; forced here) may be
    scheduled while the kernel before it drains and must wait for it. Chains of calls that each take the previous
    call's output (no sync in between; the kernel before gate/up is the previous call's down, or a scale kernel) give
    what plain launches give: every call is checked against the reference on the input it was given. Inputs stay of
    order one (shrinking ones cost the fp16 intermediates their precision, cuda/exl3_moe/DESIGN.md "Numerics"; growing
    ones would overflow them): a calibration chain with a sync per call finds per-call routing weights that give each
    output RMS 1 (the layer is linear in them), and both timed chains use those."""
    E, H, inter = 16, 512, 256
    ex = ml.random_experts(E, H, inter, rates=(3, 2, 4), generator=gen)
    drawn = [(T, _inputs(gen, T, 6, E, H)) for T in (1, 40, 300)]  # decode, the routing launch, prefill items
    _reference_part(ex, [i for _, i in drawn])
    cuda = need_cuda()
    exd = ex.to(cuda)

    def scale(y, step):  # after odd calls the next call's kernel before is this scale kernel, else the last down
        return y * 0.5 if step % 2 else y

    for T, inputs in drawn:
        x, ids, w = (t.to(cuda) for t in inputs)
        y, ws = x, []
        for step in range(6):
            out = exl3_moe(y, ids, w, exd)
            rms = out.float().pow(2).mean().sqrt().clamp_min(1e-6)
            ws.append(w / rms)
            y = scale((out.float() / rms).to(x.dtype), step)
        for pdl in ("1", "0"):
            _plan(monkeypatch, f"exl3_moe.pdl={pdl}")
            y, calls = x, []
            for step in range(6):
                out = exl3_moe(y, ids, ws[step], exd)
                calls.append((y, out))
                y = scale(out, step)
            torch.cuda.synchronize()
            for step, (inp, out) in enumerate(calls):
                want = reference_moe(inp.float(), ids, ws[step], exd).double()
                rms = want.pow(2).mean().sqrt().item()
                assert 0.1 < rms < 10, f"T={T} step {step}: the chain's scale drifted (output RMS {rms:.3g})"
                assert rel_l2(out.cpu(), want.cpu()) <= TOL, f"T={T} pdl={pdl} step {step}"


@pytest.mark.gpu
def test_kernel_decode_residency(gen, monkeypatch):
    """The decode kernels get the residency they are sized for, before and after calls: gate/up 4 blocks per SM (mul1,
    one rate: 64 registers; 3, 80 registers, with exl3_moe.gate_up4=0), down at one token 2 (its shared
    memory padded so a third does not fit; cuda/exl3_moe/DESIGN.md "Launch plan": a first launch whose occupancy
    query ran before the shared-memory attribute was raised saw no block, left the padding out, and the remembered
    size kept the down kernel at 3 per SM, T=1 +10%). The model's dimensions, a few experts."""
    E = 8
    one, four_tokens = _inputs(gen, 1, 6, E, 5120), _inputs(gen, 4, 6, E, 5120)  # the second for sm_90 below
    # no reference here (nothing is compared with one): the CPU part is the plans the kernel part expects, for the
    # H200's 132 SMs (the kernel part asks the device's count)
    assert plan_launch(1, 6, E, 5120, 1152, 132)["down_min_blocks"] == 2
    assert plan_launch(4, 6, E, 5120, 1152, 132, down4=True)["down_min_blocks"] == 4
    cuda = need_cuda()
    ex = ml.empty([(3, 3, 3)] * E, 5120, 1152, device=cuda)
    ex.trellis.random_(-32768, 32768, generator=None)
    for t in (ex.suh13, ex.svh13, ex.suh2, ex.svh2):
        t.fill_(0.01)
    x, ids, w = (t.to(cuda) for t in one)
    assert plan_launch(1, 6, E, 5120, 1152, torch.cuda.get_device_properties(cuda).multi_processor_count)[
        "down_min_blocks"] == 2
    for gate_up4, sized in (("auto", 4), ("0", 3)):
        _plan(monkeypatch, f"exl3_moe.gate_up4={gate_up4}")
        seen = [kernel_residency(x, ids, w, ex)]
        got = exl3_moe(x, ids, w, ex)
        torch.cuda.synchronize()
        assert torch.isfinite(got.float()).all()
        seen.append(kernel_residency(x, ids, w, ex))
        plan = launch_plan(x, ids, ex)
        if torch.cuda.get_device_capability(cuda) == (9, 0):  # 228 KB of shared memory per SM
            assert seen == [(sized, 2), (sized, 2)], (gate_up4, seen)
            # the plan the op launches with: one wave of gate/up pieces at the residency it holds (T=1, 132 SMs:
            # 12 groups in 4 parts and 96 in 5 = 528 blocks at 4 per SM; 18 in 3 and 36 in 4 = 396 at 3)
            assert plan["gate_up_blocks"] == sized, plan
            sms = torch.cuda.get_device_properties(cuda).multi_processor_count
            pieces = 2 * (plan["max_items"] * 9 * plan["splitk"] - plan["short_groups"])  # gate and up
            assert plan["max_items"] == 6 and sized * sms - 2 * 9 < pieces <= sized * sms, (plan, pieces)
        else:  # GB10 (100 KB per SM): shared memory allows fewer; never more than the sizing
            assert all(1 <= g <= sized and 1 <= d <= 2 for g, d in seen), (gate_up4, seen)
    # the query behind the choice: a 4-per-SM kernel's residency and A region (k-blocks), nothing launched; (-1, -1)
    # where no such kernel exists. Sized as on GB10, K=2 fits 4 per SM only with 2-k-block regions: the plan keeps 3.
    four = _ext.module().exl3_moe_four_per_sm
    for down in (False, True):
        assert four(down, 0, 48, 0, True) == four(down, 48, 32, 0, True) == (-1, -1)
        assert four(down, 32, 32, GB10_SMEM, True) == (4, 2)
    if torch.cuda.get_device_capability(cuda) == (9, 0):
        assert four(False, 48, 48, 0, True) == (4, 8) and four(False, 64, 64, 0, True) == (4, 7)
        assert four(True, 32, 32, 0, True) == (4, 10) and four(True, 48, 48, 0, True) == (4, 8)
        assert four(True, 64, 64, 0, True) == (4, 7) and four(False, 80, 80, 0, True) == (4, 5)
        # past one token the down kernel runs at 4 per SM too (T=4: 24 items x 40 blocks)
        x4, ids4, w4 = (t.to(cuda) for t in four_tokens)
        _plan(monkeypatch, "exl3_moe.gate_up4=auto")
        assert kernel_residency(x4, ids4, w4, ex) == (4, 4)
        assert launch_plan(x4, ids4, ex)["down_min_blocks"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("fit", ["1", "0"])
def test_kernel_sized_as_on_gb10(fit, gen, monkeypatch):
    """Sized and held as on GB10 (100 KB of shared memory per SM): with the A region fitted, gate/up keeps 3 blocks
    per SM and the one-token down kernel 2 (K=3; 1 and 1 with the full region), and every path still matches the
    reference with the smaller region, where pieces build A in several chunks: one token, 4-row byte-sum items,
    items of 5-16 rows (fp16 decode), duplicate ids, mixed rates up to K=8, a 64-row prefill call, a one-rate K=2
    layer (mul1's 4-per-SM gate/up kernel fits only with a 2-k-block region there: the plan keeps 3)."""
    _plan(monkeypatch, f"exl3_moe.smem_per_sm={GB10_SMEM},exl3_moe.fit_smem={fit}")
    E = 8
    ex = ml.random_experts(E, 5120, 1152, rates=[(3, 3, 3)] * E, codebook="mul1", generator=gen)
    x1, ids1, w1 = _inputs(gen, 1, 6, E, 5120)
    x16, _, w16 = _inputs(gen, 16, 1, E, 5120)
    items = [(rows, torch.full((rows, 1), 2, dtype=torch.int32)) for rows in (4, 5, 16)]  # one item on expert 2
    ex_mixed = ml.random_experts(E, 5120, 1152, rates=[(2, 3, 8), (8, 3, 2), (3, 3, 3), (4, 5, 2)] * 2,
                                 codebook="mul1", generator=gen)
    mixed = []
    for T, top_k in ((1, 6), (4, 6), (8, 8), (64, 6)):
        x, ids, w = _inputs(gen, T, top_k, E, 5120)
        if T == 4:
            ids[0, :3] = ids[0, 3]  # duplicate ids in a row
        mixed.append((T, x, ids, w))
    ex_k2 = ml.random_experts(E, 5120, 1152, rates=[(2, 2, 2)] * E, codebook="mul1", generator=gen)
    k2 = [(T, forced, _inputs(gen, T, 6, E, 5120)) for T, forced in ((1, "auto"), (4, "auto"), (1, "any"))]
    _reference_part(ex, [(x1, ids1, w1)] + [(x16[:rows], ids, w16[:rows]) for rows, ids in items], label="K=3")
    _reference_part(ex_mixed, [(x, ids, w) for _, x, ids, w in mixed], label="mixed rates")
    _reference_part(ex_k2, [i for _, _, i in k2], label="K=2")
    cuda = need_cuda()
    exd = ex.to(cuda)
    assert kernel_residency(x1.to(cuda), ids1.to(cuda), w1.to(cuda), exd) == ((3, 2) if fit == "1" else (1, 1))
    got, want = _check_kernel(cuda, ex, exd, x1, ids1, w1)
    assert rel_l2(got, want) <= TOL, "T=1"
    for rows, ids in items:
        got, want = _check_kernel(cuda, ex, exd, x16[:rows], ids, w16[:rows])
        assert rel_l2(got, want) <= TOL, f"{rows} rows"
    ex = ex_mixed
    exd = ex.to(cuda)
    for T, x, ids, w in mixed:
        got, want = _check_kernel(cuda, ex, exd, x, ids, w)
        assert rel_l2(got, want) <= TOL, f"T={T} mixed rates"
    # K=2, one rate: mul1's 4-per-SM gate/up kernel fits only with a 2-k-block A region (x' in several chunks per
    # piece), so the plan keeps 3 (with the full region: 1 per SM either way); taken anyway
    # (exl3_moe.gate_up4=any), the small region must match the reference too
    ex = ex_k2
    exd = ex.to(cuda)
    for T, forced, (x, ids, w) in k2:
        _plan(monkeypatch, f"exl3_moe.gate_up4={forced}")
        seen = kernel_residency(x.to(cuda), ids.to(cuda), w.to(cuda), exd)
        if fit == "1":
            assert seen[0] == (4 if forced == "any" else 3) and 1 <= seen[1] <= 3, (forced, seen)
        got, want = _check_kernel(cuda, ex, exd, x, ids, w)
        assert rel_l2(got, want) <= TOL, f"K=2 T={T} residency {seen}"


@pytest.mark.gpu
def test_kernel_first_call_inside_capture(gen):
    """The per-stream arrival counters made inside a capture (no warm-up on that stream) hold garbage until
    something zeroes them: a graph that is never replayed must not poison the next eager call or graph."""
    E, H, inter = 16, 512, 256
    ex = ml.random_experts(E, H, inter, rates=(2, 3, 4), generator=gen)
    x, ids, w = _inputs(gen, 3, 6, E, H)
    want = reference_moe(x.float(), ids, w, ex).double()
    _reference_part(ex, [(x, ids, w)])
    cuda = need_cuda()
    exd = ex.to(cuda)
    xs, ids_s, ws = x.to(cuda), ids.to(cuda), w.to(cuda)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(ga, stream=s):
            exl3_moe(xs, ids_s, ws, exd)  # the stream's first call: its counters are made here
        with torch.cuda.graph(gb, stream=s):
            out_b = exl3_moe(xs, ids_s, ws, exd)
        out_b.fill_(float("nan"))
        gb.replay()
        s.synchronize()
        assert rel_l2(out_b.cpu(), want) <= TOL, "graph B after an unreplayed graph A"
        got = exl3_moe(xs, ids_s, ws, exd)  # eager: zeroes the counters once, then they stay zero
        s.synchronize()
        assert rel_l2(got.cpu(), want) <= TOL, "eager call after the captures"
        ga.replay()
        got2 = exl3_moe(xs, ids_s, ws, exd)
        s.synchronize()
        assert rel_l2(got2.cpu(), want) <= TOL, "eager call after replaying graph A"
    del ga, gb
