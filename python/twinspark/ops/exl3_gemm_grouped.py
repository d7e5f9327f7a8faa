"""twinspark.ops.exl3_gemm_grouped: G EXL3 matrices of one shape, rate and codebook applied group by group,
y[..., g, :] = x[..., g, :] @ W_g (+ bias_g), in one launch.

Made for DeepSeek V4.1's attention output projection ``wo_a``: one EXL3 matrix per output group
(``layers.L.attn.wo_a.slice.{g}``, 4096 -> 1024, K=5, mul1; the draft model's K=4), G = 8 at TP 1 and 4 per rank
at TP 2; x [T, G, 4096] comes from the inverse-RoPE step and y [T, G, 1024] feeds ``wo_b`` as [T, G * 1024].

How a call runs (the variant is exl3_gemm's table, ``plan``, asked about one matrix of G * n columns: a grouped
launch has G times one matrix's blocks, so it gets the split-k that one launch of that many blocks gets):
- ``small`` (decode, m <= 64 tokens; off sm_90 also up to 256 tokens on >= 16 M weights): the small-m kernel's
  grouped mode (cuda/exl3_gemm, Exl3GemmGroupedArgs): grid.z = G, every group in one launch (x and out read and
  written through their group strides, no copies), 64 tokens per launch (larger m: slices of 64 tokens). Its fp32
  split-k workspace and arrival counters are per (device, stream) ``twinspark.ops.workspace`` buffers of their
  own ([G, 64, n] and [G, n/128]), zero between calls (the kernel clears what it used): graph-safe, no memset.
- ``fused`` / ``large`` (prefill, m > 64): G calls of ``exl3_gemm``, one per group, each with its own plan (at
  that m one group fills the GPU, and the fused / whole-weight paths beat 64-token slices of the small kernel
  2-3x: cuda/exl3_gemm/DESIGN.md). Half rates (1.5, 2.5, 3.5) also go group by group (exl3_gemm's reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from twinspark import _ext
from twinspark.exl3.layer import Exl3Layer
from twinspark.exl3.reference import CODEBOOKS, WHOLE_RATES, rate_from_last_dim
from twinspark.ops.exl3_gemm import M_SLICE, _cached_plan, _sms, exl3_gemm, fused_available
from twinspark.ops.workspace import capture_id, workspace
from twinspark.reference.exl3_gemm_grouped import exl3_gemm_grouped as _reference

OP = "exl3_gemm_grouped"
_X_DTYPES = (torch.float16, torch.bfloat16)
MAX_GROUPS = 65535  # grid.z


@dataclass(frozen=True)
class Exl3GroupedLayer:
    """G EXL3 layers of one shape stacked: trellis int16 [G, k/16, n/16, 16*K], suh fp16 [G, k], svh fp16 [G, n],
    optional bias fp16 [G, n]; y[..., g, :] = x[..., g, :] @ W_g + bias_g. Make one with ``stack_layers``."""

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    K: float
    codebook: str
    bias: torch.Tensor | None = None
    name: str = ""

    @property
    def groups(self) -> int:
        return self.trellis.shape[0]

    @property
    def k(self) -> int:
        return self.trellis.shape[1] * 16

    @property
    def n(self) -> int:
        return self.trellis.shape[2] * 16

    def group(self, g: int) -> Exl3Layer:
        """Group g as an Exl3Layer (views, no copies)."""
        return Exl3Layer(self.trellis[g], self.suh[g], self.svh[g], self.K, self.codebook,
                         None if self.bias is None else self.bias[g], f"{self.name}[{g}]" if self.name else "")

    def to(self, device) -> Exl3GroupedLayer:
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, trellis=mv(self.trellis), suh=mv(self.suh), svh=mv(self.svh), bias=mv(self.bias))


def stack_layers(layers: Sequence[Exl3Layer], name: str = "") -> Exl3GroupedLayer:
    """Stack G Exl3Layers (e.g. wo_a.slice.0..G-1) into one Exl3GroupedLayer (copies, contiguous). They must share
    K, codebook, k and n, and have a bias either all or none; the error names the first layer that differs."""
    if not layers:
        raise ValueError(f"{OP}: stack_layers needs at least one layer, got none")
    first = layers[0]
    for i, L in enumerate(layers[1:], start=1):
        for what, a, b in (("K", L.K, first.K), ("codebook", L.codebook, first.codebook), ("k", L.k, first.k),
                           ("n", L.n, first.n), ("a bias", L.bias is not None, first.bias is not None)):
            if a != b:
                label = f"layer {i}" + (f" ({L.name})" if L.name else "")
                raise ValueError(f"{OP}: {label} has {what}={a} but layer 0 has {what}={b}; all groups must share K, "
                                 "codebook, k, n and whether they have a bias")
    stack = lambda ts: torch.stack(ts).contiguous()  # noqa: E731
    return Exl3GroupedLayer(stack([L.trellis for L in layers]), stack([L.suh for L in layers]),
                            stack([L.svh for L in layers]), float(first.K), first.codebook,
                            None if first.bias is None else stack([L.bias for L in layers]), name)


# -------------------------------------------------------------------------------------------------- checks
def _check(x, trellis, suh, svh, bias, K, codebook) -> None:
    # Contract: x fp16|bf16 [..., G, k] (last dim contiguous); trellis int16 [G, k/16, n/16, 16*K] (16*KA+8 for half
    # rates); suh fp16 [G, k]; svh fp16 [G, n]; bias fp16 [G, n] or None; k, n multiples of 128; one device.
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
        raise ValueError(f"{OP}: expected x to be a float16 or bfloat16 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(trellis, torch.Tensor) or trellis.dtype != torch.int16 or trellis.dim() != 4:
        raise ValueError(f"{OP}: expected trellis to be int16 [G, k/16, n/16, 16*K], got "
                         f"{getattr(trellis, 'dtype', None)} {tuple(getattr(trellis, 'shape', ()))}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"{OP}: expected codebook in {CODEBOOKS}, got {codebook!r}")
    try:
        rate = rate_from_last_dim(trellis.shape[-1])
    except ValueError:
        rate = None
    if rate != K:
        raise ValueError(f"{OP}: trellis last dimension {trellis.shape[-1]} does not match K={K} (expected 16*K, "
                         "or 16*KA+8 for a half rate)")
    G, k, n = trellis.shape[0], trellis.shape[1] * 16, trellis.shape[2] * 16
    if not 1 <= G <= MAX_GROUPS:
        raise ValueError(f"{OP}: expected 1 to {MAX_GROUPS} groups, got trellis of shape {tuple(trellis.shape)}")
    if k % 128 or n % 128:
        raise ValueError(f"{OP}: k and n must be multiples of 128 (the Hadamard block), got k={k}, n={n}; "
                         "EXL3 checkpoints pad both, re-export the layer padded")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (G, k):
        raise ValueError(f"{OP}: expected x of shape [..., {G}, {k}] (groups, k of the layer), got {tuple(x.shape)}")
    for name, t, size in (("suh", suh, k), ("svh", svh, n), ("bias", bias, n)):
        if t is None:
            continue
        if t.dtype != torch.float16 or tuple(t.shape) != (G, size):
            raise ValueError(f"{OP}: expected {name} to be float16 [{G}, {size}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("trellis", trellis), ("suh", suh), ("svh", svh), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but x is on {x.device}; move the layer to x's device")


# --------------------------------------------------------------------------------------------------- kernel
def _run(x, trellis, suh, svh, bias, K: float, codebook: str, out: torch.Tensor) -> None:
    """The kernel path: out [..., G, n] (contiguous) = per-group x @ W_g + bias_g."""
    G, k, n = trellis.shape[0], trellis.shape[1] * 16, trellis.shape[2] * 16
    x3 = x.reshape(-1, G, k)
    if x3.stride(-1) != 1 or x3.stride(0) % 4 or x3.stride(1) % 4 or x3.data_ptr() % 16:
        x3 = x3.contiguous()
        if x3.data_ptr() % 16:
            x3 = x3.clone()
    m = x3.shape[0]
    if m == 0:
        return
    out3 = out.view(-1, G, n)
    dev = x3.device
    p = _cached_plan(m, k, G * n, K, _sms(dev), fused_available(dev))
    if p.variant != "small" or K not in WHOLE_RATES:  # prefill (or a half rate): group by group
        for g in range(G):
            layer = Exl3Layer(trellis[g], suh[g], svh[g], K, codebook, None if bias is None else bias[g])
            exl3_gemm(x3[:, g], layer, out=out3[:, g])
        return
    trellis = trellis if trellis.is_contiguous() and trellis.data_ptr() % 16 == 0 else trellis.contiguous()
    suh, svh = suh.contiguous(), svh.contiguous()
    bias = bias.contiguous() if bias is not None else None
    ws = workspace(dev)
    cid = capture_id(dev)
    acc = ws.zeroed("gemm_grouped_acc", G * M_SLICE * n, torch.float32, cid)
    counters = ws.zeroed("gemm_grouped_counters", G * (n // 128), torch.int32, cid)
    xh = ws.buffer("gemm_grouped_xh", G * m * k).data_ptr() if p.prep else 0  # [G, slice, k] per launch
    es = x3.element_size()
    C = _ext.module()
    for m0 in range(0, m, p.m_slice):
        mm = min(p.m_slice, m - m0)
        C.exl3_gemm_grouped(
            x3.data_ptr() + m0 * x3.stride(0) * es, x3.stride(0), x3.stride(1), trellis.data_ptr(), suh.data_ptr(),
            svh.data_ptr(), bias.data_ptr() if bias is not None else 0, out3.data_ptr() + m0 * G * n * es, G * n, n,
            acc.data_ptr(), counters.data_ptr(), G, mm, k, n, int(K), CODEBOOKS.index(codebook), p.groups,
            p.chunks_per_split, p.splits, x3.dtype == torch.bfloat16, _ext.stream_ptr(dev),
            xh + m0 * G * k * 2 if xh else 0)


def _compute(x, trellis, suh, svh, bias, K, codebook, out) -> None:
    if _ext.use_kernel(x, trellis):
        _run(x, trellis, suh, svh, bias, K, codebook, out)
    else:
        out.copy_(_reference(x, trellis, suh, svh, bias, K, codebook))


@torch.library.custom_op("twinspark::exl3_gemm_grouped", mutates_args=())
def _exl3_gemm_grouped(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                       bias: torch.Tensor | None, K: float, codebook: str) -> torch.Tensor:
    if not _ext.use_kernel(x, trellis):
        return _reference(x, trellis, suh, svh, bias, K, codebook)
    out = torch.empty(*x.shape[:-1], trellis.shape[2] * 16, dtype=x.dtype, device=x.device)
    _run(x, trellis, suh, svh, bias, K, codebook, out)
    return out


@_exl3_gemm_grouped.register_fake
def _(x, trellis, suh, svh, bias, K, codebook):
    return x.new_empty(*x.shape[:-1], trellis.shape[2] * 16)


def exl3_gemm_grouped(x: torch.Tensor, layer: Exl3GroupedLayer) -> torch.Tensor:
    """y[..., g, :] = x[..., g, :] @ W_g + bias_g for the G groups of a stacked layer.

    Args:
        x: float16 or bfloat16 ``[..., G, k]`` (last dim contiguous; any token and group strides), CPU (reference)
            or CUDA.
        layer: ``stack_layers([...])`` of G layers of one shape (trellis int16 ``[G, k/16, n/16, 16*K]``, suh fp16
            ``[G, k]``, svh fp16 ``[G, n]``, optional bias fp16 ``[G, n]``, K 1..8 or 1.5/2.5/3.5, codebook
            3inst|mcg|mul1); k and n multiples of 128.
    Returns:
        ``[..., G, n]`` in x's dtype, contiguous (so ``.flatten(-2)`` is ``[..., G * n]`` without a copy).
    """
    K = float(layer.K)
    _check(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook)
    if not torch.compiler.is_compiling() and x.is_cuda:
        # Eager on a GPU: the implementation directly (the registered op's dispatcher round trip costs several µs).
        y = torch.empty(*x.shape[:-1], layer.n, dtype=x.dtype, device=x.device)
        _compute(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook, y)
        return y
    return _exl3_gemm_grouped(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook)
