"""twinspark.ops.exl3_gemm_grouped against the spec decoder (twinspark.exl3.reference) group by group: the reference
path on the CPU everywhere (small shapes), the CUDA kernel on a GPU (marker gpu; the kernel part skips with a
reason) at wo_a's shapes (G = 4 and 8 groups of 4096 -> 1024, K = 4 and 5, mul1) and on small shapes for the other
codebooks and rates."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_exl3_gemm import TOL, _check_reference, _dense, _plan  # the single-matrix op's tolerance, checks
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import random_layer
from twinspark.ops import exl3_gemm, exl3_gemm_grouped, plans
from twinspark.ops.exl3_gemm_grouped import Exl3GroupedLayer, stack_layers
from twinspark.ops.workspace import workspace
from twinspark.testing import need_cuda, poison_allocator, rel_l2

MS = (1, 2, 3, 4, 8, 16, 64, 65, 130)


def _grouped(G: int, k: int, n: int, K: float, codebook: str, gen, bias: bool = False) -> Exl3GroupedLayer:
    return stack_layers([random_layer(k, n, K, codebook, bias=bias, generator=gen) for _ in range(G)], name="wo_a")


# ------------------------------------------------------------------------------------------- CPU (reference)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
@pytest.mark.parametrize("K", [2, 5])
def test_cpu_path_matches_dense_weight_per_group(K, codebook, dtype, gen):
    layer = _grouped(3, 128, 256, K, codebook, gen, bias=True)
    x = torch.randn(2, 3, 3, 128, generator=gen).to(dtype)  # [..., G, k] with two leading dims
    y = exl3_gemm_grouped(x, layer)
    assert y.dtype == dtype and y.shape == (2, 3, 3, 256) and y.is_contiguous()
    for g in range(3):
        assert rel_l2(y[..., g, :], _dense(x[..., g, :], layer.group(g))) <= TOL[dtype], f"group {g}"


def test_cpu_strided_x_and_half_rate(gen):
    layer = _grouped(2, 128, 128, 2.5, "mul1", gen)
    x = torch.randn(2, 5, 128, generator=gen).half().transpose(0, 1)  # [T=5, G=2, k]: token stride k
    y = exl3_gemm_grouped(x, layer)
    for g in range(2):
        assert rel_l2(y[:, g], _dense(x[:, g], layer.group(g))) <= TOL[torch.float16]


def test_stack_layers_says_which_differs(gen):
    base = [random_layer(128, 128, 5, "mul1", generator=gen) for _ in range(3)]
    layer = stack_layers(base)
    assert (layer.groups, layer.k, layer.n, layer.K, layer.codebook) == (3, 128, 128, 5.0, "mul1")
    assert torch.equal(layer.trellis[1], base[1].trellis) and torch.equal(layer.svh[2], base[2].svh)
    other = {
        "K": random_layer(128, 128, 4, "mul1", generator=gen),
        "codebook": random_layer(128, 128, 5, "mcg", generator=gen),
        "k": random_layer(256, 128, 5, "mul1", generator=gen),
        "n": random_layer(128, 256, 5, "mul1", generator=gen),
        "a bias": random_layer(128, 128, 5, "mul1", bias=True, generator=gen),
    }
    for what, odd in other.items():
        with pytest.raises(ValueError, match=f"layer 2 has {what}="):
            stack_layers([base[0], base[1], odd])
    with pytest.raises(ValueError, match="at least one layer"):
        stack_layers([])


@pytest.mark.parametrize(("make", "message"), [
    (lambda x, L: (x.float(), L), "expected x to be a float16 or bfloat16"),
    (lambda x, L: (x[..., :1, :], L), r"expected x of shape \[\.\.\., 2, 128\]"),
    (lambda x, L: (x.reshape(-1), L), r"expected x of shape"),
    (lambda x, L: (x, replace(L, suh=L.suh.float())), r"expected suh to be float16 \[2, 128\]"),
    (lambda x, L: (x, replace(L, svh=L.svh[:1])), r"expected svh to be float16 \[2, 128\]"),
    (lambda x, L: (x, replace(L, bias=torch.zeros(128, dtype=torch.float16))), r"expected bias to be float16"),
    (lambda x, L: (x, replace(L, codebook="foo")), "expected codebook"),
    (lambda x, L: (x, replace(L, K=3.0)), "does not match K=3"),
    (lambda x, L: (x, replace(L, trellis=L.trellis[0])), r"expected trellis to be int16 \[G, k/16, n/16, 16\*K\]"),
    (lambda x, L: (x, replace(L, trellis=L.trellis[..., :3])), "does not match K=2"),
])
def test_bad_inputs(make, message, gen):
    layer = _grouped(2, 128, 128, 2, "mul1", gen)
    x = torch.randn(3, 2, 128, generator=gen).half()
    with pytest.raises(ValueError, match=message):
        exl3_gemm_grouped(*make(x, layer))


def test_k_n_not_multiple_of_128(gen):
    layer = stack_layers([random_layer(144, 128, 2, "mul1", generator=gen)])
    with pytest.raises(ValueError, match="must be multiples of 128"):
        exl3_gemm_grouped(torch.randn(1, 1, 144).half(), layer)


def test_opcheck_and_fake_shapes(gen):
    layer = _grouped(3, 128, 256, 3, "mcg", gen, bias=True)
    x = torch.randn(4, 3, 128, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.twinspark.exl3_gemm_grouped.default,
                          (x, layer.trellis, layer.suh, layer.svh, layer.bias, 3.0, "mcg"))
    # vLLM traces the layer's forward: the wrapper must trace with fake tensors, the fake impl gives [..., G, n].
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(torch.empty(7, 3, 128, dtype=torch.float16))
        y = exl3_gemm_grouped(fx, layer)
        assert y.shape == (7, 3, 256) and y.dtype == torch.float16
        gm = make_fx(lambda a: exl3_gemm_grouped(a, layer))(x)
    assert any("twinspark.exl3_gemm_grouped" in str(n.target) for n in gm.graph.nodes)


# ------------------------------------------------------------------------------------------------ GPU kernel
# As in test_exl3_gemm.py: a GPU test draws its inputs first and runs its reference part everywhere (every group's
# reference on a few rows against the spec's float64 y: test_exl3_gemm._check_reference), then need_cuda() and the
# kernel part.
def _draw_case(layer: Exl3GroupedLayer, dtype, ms, gen, label=""):
    """Fresh x [rows, G, k] for every m, drawn at once: a case for _reference_part and _check_case."""
    return layer, dtype, ms, torch.randn(sum(ms), layer.groups, layer.k, generator=gen).to(dtype), label


def _reference_part(cases) -> None:
    """Per layer and group, one reference check on the first row of each m of every case drawn for the layer."""
    rows: dict[int, tuple] = {}
    for layer, _, ms, x_all, label in cases:
        starts = [sum(ms[:i]) for i in range(len(ms))]
        rows.setdefault(id(layer), (layer, label, []))[2].append(x_all[starts].float())
    for layer, label, xs in rows.values():
        x = torch.cat(xs)
        for g in range(layer.groups):
            _check_reference(layer.group(g), x[:, g], f"{label} group {g}")


def _check_case(case, cuda):
    """The kernel part: x per m (all m in one reference call per group), poisoned outputs, rel L2 per group vs
    reference.linear in fp32."""
    layer, dtype, ms, x_all, label = case
    G = layer.groups
    x_all = x_all.to(cuda)
    lg = layer.to(cuda)
    want_all = torch.stack([ref.linear(x_all[:, g], lg.trellis[g], lg.suh[g], lg.svh[g], layer.K, layer.codebook,
                                       None if lg.bias is None else lg.bias[g]) for g in range(G)], dim=1)
    r0 = 0
    for m in ms:
        x, want = x_all[r0:r0 + m], want_all[r0:r0 + m]
        r0 += m
        poison_allocator(cuda, m * G * layer.n * 2)
        got = exl3_gemm_grouped(x, lg)
        assert got.shape == (m, G, layer.n)
        for g in range(G):
            err = rel_l2(got[:, g].float(), want[:, g])
            assert err <= TOL[dtype], f"{label} m={m} group {g} {dtype}: rel L2 {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("K", [4, 5])
@pytest.mark.parametrize("G", [4, 8])
def test_kernel_parity_wo_a(G, K, gen):
    """wo_a at TP 2 (4 groups) and TP 1 (8): 4096 -> 1024, mul1; K=5 (V4.1), K=4 (the draft model)."""
    layer = _grouped(G, 4096, 1024, K, "mul1", gen)
    cases = [_draw_case(layer, dtype, MS, gen, f"wo_a G={G} K={K}") for dtype in (torch.float16, torch.bfloat16)]
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
@pytest.mark.parametrize("K", [1, 2, 3, 6, 8])
def test_kernel_parity_codebooks_and_rates(K, codebook, gen):
    layer = _grouped(3, 1024, 384, K, codebook, gen, bias=(K % 2 == 0))
    cases = [_draw_case(layer, dtype, (1, 3, 9, 33, 64, 100), gen, f"{codebook} K={K}")
             for dtype in (torch.float16, torch.bfloat16)]
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("prep", ["0", "1"])
def test_small_kernel_slices_with_and_without_prepared_x(prep, gen, monkeypatch):
    """The grouped small kernel at every token-group count and in 64-token slices (m > 64 forced to 'small'), its
    x' made per strip or by the grouped prep kernel ([G, m, k] in one launch)."""
    _plan(monkeypatch, f"exl3_gemm.variant=small,exl3_gemm.prep={prep}")
    cases = [_draw_case(_grouped(4, 1280, 512, K, codebook, gen, bias=True), torch.bfloat16,
                        (1, 9, 17, 33, 64, 65, 130), gen, f"prep={prep} {codebook} K={K}")
             for K, codebook in ((5, "mul1"), (3, "3inst"), (4, "mcg"))]
    _reference_part(cases)
    cuda = need_cuda()
    for case in cases:
        _check_case(case, cuda)


@pytest.mark.gpu
def test_strided_x_and_one_group(gen):
    """x as a [T, G, k] view of a [G, T, k + 128] buffer (token stride k + 128, group stride T (k + 128)); G = 1."""
    layer = _grouped(4, 1024, 512, 5, "mul1", gen)
    wide32 = torch.randn(4, 6, 1024 + 128, generator=gen)
    for g in range(4):
        _check_reference(layer.group(g), wide32[g, :, :1024].to(torch.bfloat16), f"group {g}")
    cuda = need_cuda()
    layer = layer.to(cuda)
    wide = wide32.to(cuda, torch.bfloat16)
    x = wide[..., :1024].transpose(0, 1)
    y = exl3_gemm_grouped(x, layer)
    for g in range(4):
        want = ref.linear(x[:, g], layer.trellis[g], layer.suh[g], layer.svh[g], 5, "mul1")
        assert rel_l2(y[:, g].float(), want) <= TOL[torch.bfloat16]
    one = stack_layers([layer.group(2)])
    y1 = exl3_gemm_grouped(x[:, 2:3], one)
    assert rel_l2(y1[:, 0].float(), y[:, 2].float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_matches_exl3_gemm_group_by_group(m, gen):
    """Same kernel, one launch vs G launches: only the fp32 split-k atomic order differs (bf16 roundings)."""
    layer = _grouped(8, 4096, 1024, 5, "mul1", gen)
    x32 = torch.randn(m, 8, 4096, generator=gen)
    for g in range(8):
        _check_reference(layer.group(g), x32[[0, m - 1], g].to(torch.bfloat16), f"group {g}")
    cuda = need_cuda()
    layer = layer.to(cuda)
    x = x32.to(cuda, torch.bfloat16)
    y = exl3_gemm_grouped(x, layer)
    for g in range(8):
        assert rel_l2(y[:, g].float(), exl3_gemm(x[:, g], layer.group(g)).float()) <= 1e-3


def _workspace_is_zero(device, stream) -> bool:
    with torch.cuda.stream(stream):
        zs = workspace(device)._zeroed  # the stream's workspace (keyed by device index and stream)
    return all(torch.count_nonzero(zs[name].t) == 0 for name in ("gemm_grouped_acc", "gemm_grouped_counters"))


@pytest.mark.gpu
@pytest.mark.parametrize("G,m", [(4, 1), (8, 4), (8, 64)])
def test_cuda_graph_capture_and_replay(G, m, gen):
    """Capture once, replay twice with fresh x and a NaN-poisoned output; the workspace is zero after each."""
    layer = _grouped(G, 4096, 1024, 5, "mul1", gen)
    xs32 = [torch.randn(m, G, 4096, generator=gen) for _ in range(3)]  # the capture's x, then one per replay
    rows = torch.cat([x[:1] for x in xs32]).to(torch.bfloat16)
    for g in range(G):
        _check_reference(layer.group(g), rows[:, g], f"group {g}")
    cuda = need_cuda()
    layer = layer.to(cuda)
    x = xs32[0].to(cuda, torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        exl3_gemm_grouped(x, layer)  # warm-up on the capture stream: its workspace exists before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = exl3_gemm_grouped(x, layer)
    for x32 in xs32[1:]:
        x.copy_(x32.to(cuda, torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _workspace_is_zero(x.device, stream)
        for g in range(G):
            want = ref.linear(x[:, g], layer.trellis[g], layer.suh[g], layer.svh[g], 5, "mul1")
            assert rel_l2(y[:, g].float(), want) <= TOL[torch.bfloat16], f"group {g}"
    # an eager call after the graph (same stream) still sees a clean workspace, and leaves it clean
    with torch.cuda.stream(stream):
        y0 = exl3_gemm_grouped(x, layer)[:, 0]
    torch.cuda.synchronize()
    want = ref.linear(x[:, 0], layer.trellis[0], layer.suh[0], layer.svh[0], 5, "mul1")
    assert rel_l2(y0.float(), want) <= TOL[torch.bfloat16]
    assert _workspace_is_zero(x.device, stream)


if plans.current().exl3_gemm != plans.DEFAULT.exl3_gemm:
    pytestmark = pytest.mark.skip(reason=f"$TWINSPARK_PLAN changes exl3_gemm's table ({plans.changes()})")
