"""twinspark.ops.exl3_gemm: one EXL3 linear layer, y = x @ W + bias with W = diag(suh)·Hk·W_hat·Hn·diag(svh).

Kernel variants (the one table is `plan`, its thresholds and forcing keys the data in ``twinspark.ops.plans``
(``Exl3Gemm``); cuda/exl3_gemm/DESIGN.md says why each exists; measurements cited as "NOTES.md vN" are in git:
`git show 1fc0a13:cuda/exl3_gemm/NOTES.md`):
- ``small`` (m <= large_m): decode the trellis in registers straight into mma.sync fragments, split k across
  blocks, reduce in an fp32 per-stream workspace; suh, both Hadamard transforms, svh and bias fused. Tokens go
  in slices of 64 per launch.
- ``fused`` (large_m < m <= fused_max_m on sm_90): x' = H(x ⊙ suh) in fp16 (the swizzled layout wgmma reads),
  then one kernel decodes the trellis straight into wgmma register operands and multiplies by x' (W_hat never
  touches memory), then Hn, svh and bias in one kernel. Block shape and split-k from the same table (fused_shape).
- ``fused_mma`` (without wgmma, e.g. GB10, large_m < m <= no_wgmma_mma_max_m; any arch when forced): x' in fp16 (row-major), then one kernel
  decodes the trellis into mma.sync A fragments once per 128-token tile and multiplies by x' (W_hat never touches
  memory), then the same epilogue as ``fused``. Tokens per block (128 or 256) and split-k: fused_mma_shape.
- ``large`` (larger m: above fused_max_m on sm_90, and on a 48-SM plan there; without wgmma, e.g. GB10, above
  no_wgmma_mma_max_m): the whole weight W = diag(suh)·Hk·W_hat·
  Hn·diag(svh) made once per call in x's dtype (dequant_w: decode, both Hadamards through the tensor cores, both
  scales), then one dense matmul, torch.mm / torch.addmm with the bias (cuBLAS): no x' pass, no epilogue pass.

Graph safety: no host sync, no tuning (the table is static), and the only state is the per (device, stream)
workspace of ``twinspark.ops.workspace`` (read its docstring: make the first call outside graph capture), which
the small kernel leaves zeroed after every call (its last block per strip clears what it read).
Half rates (1.5, 2.5, 3.5) run through the PyTorch reference (a warning says so once).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from twinspark import _ext
from twinspark.exl3.layer import Exl3Layer
from twinspark.exl3.reference import CODEBOOKS, WHOLE_RATES, rate_from_last_dim
from twinspark.ops import plans
from twinspark.ops.sms import sm_count
from twinspark.ops.workspace import capture_id, workspace
from twinspark.reference.exl3_gemm import exl3_gemm as _reference

OP = "exl3_gemm"
_X_DTYPES = (torch.float16, torch.bfloat16)
M_SLICE = 64  # tokens per launch of the small-m kernel (8 groups of 8: 32 fp32 accumulators per lane)
# The variant table's thresholds (large_m, fused_max_m, no_wgmma_small_*), the small kernel's split-k target
# (blocks_per_sm) and x' prep kernel (prep_groups, prep_work), the fused kernel's shape costs and stream-K limits
# (fused_efficiency, sk_*), each with why: twinspark.ops.plans.Exl3Gemm. Experiments override them and force a
# variant, prep, block shape or stream-K block count through $TWINSPARK_PLAN / plans.override("exl3_gemm.<key>=...").


@dataclass(frozen=True)
class Plan:
    """How one call runs: ``variant`` small|large; for small: token ``groups`` of 8 per launch, k split in
    ``splits`` blocks of ``chunks_per_split`` 128-row chunks, ``m_slice`` tokens per launch, ``prep``: x' made
    once by the prep kernel."""

    variant: str
    groups: int = 0
    splits: int = 0
    chunks_per_split: int = 0
    m_slice: int = 0
    prep: bool = False
    block: int = 0  # fused: block shape id (FUSED_BLOCKS); fused_mma: tokens per block (128 or 256)
    stream_k: bool = False  # fused block 0: stream-K over ``splits`` blocks


VARIANTS = ("small", "fused", "fused_mma", "large")


# Fused kernel block shapes: id -> (columns, tokens, blocks per SM); cuda/exl3_gemm/fused_sm90.cuh. (A 256 x 128
# shape lost to both at every anchor shape and was removed, NOTES.md v5 and v10.) Their relative costs and when block
# 0 runs stream-K (every SM gets the same share of the launch's tile x 64-row-chunk iterations; else k is split and
# the epilogue sums fp32 partials): plans.Exl3Gemm fused_efficiency and sk_*.
FUSED_BLOCKS = {0: (128, 256, 1), 2: (128, 128, 2)}

def fused_shape(m: int, k: int, n: int, sms: int) -> tuple[int, int, int, bool]:
    """(block, splits, chunks_per_split, stream_k) of the fused kernel; with stream_k, splits = its block count
    (one per SM, each >= sk_min_chunks chunks). Else k is split when the blocks would leave SMs idle, into at most
    as many parts as keep one round of blocks, each >= 4 chunks. The shape whose busiest SM gets the least work
    wins. The plan's exl3_gemm.block=0|2 forces a shape, exl3_gemm.sk_blocks a stream-K block count (sweeps)."""
    t = plans.current().exl3_gemm
    sk_blocks = t.sk_blocks  # forced stream-K block count (None: the table's choice); 0 = stream-K off
    chunks = k // 64
    best = None
    for block in ((t.block,) if t.block is not None else (0, 2)):
        cols, tokens, per_sm = FUSED_BLOCKS[block]
        blocks = math.ceil(n / cols) * math.ceil(m / tokens)
        iterations = blocks * chunks
        fill = blocks / (math.ceil(blocks / sms) * sms)
        pays = blocks >= t.sk_min_tiles * sms and fill < t.sk_max_fill and chunks >= t.sk_min_tile_chunks
        if block == 0 and (sk_blocks if sk_blocks is not None else pays):
            splits = min(iterations, sk_blocks) if sk_blocks else max(1, min(sms, iterations // t.sk_min_chunks))
            cps, stream_k = chunks, True
            cost = math.ceil(iterations / splits) * math.ceil(splits / sms) * cols * tokens
        else:
            splits = max(1, min(chunks // 4, sms * per_sm // blocks))
            cps, stream_k = math.ceil(chunks / splits), False
            splits = math.ceil(chunks / cps)
            cost = math.ceil(blocks * splits / sms) * cols * tokens * cps
        cost *= t.fused_efficiency[block]
        if best is None or cost < best[0]:
            best = (cost, block, splits, cps, stream_k)
    return best[1:]


# fused_mma tokens per block -> blocks per SM its launch bounds size registers for (on GB10's 100 KB of shared memory
# per SM: 2, 1, 1).
MMA_TOKENS = {64: 3, 128: 2, 256: 1}


def fused_mma_shape(m: int, k: int, n: int, sms: int) -> tuple[int, int, int]:
    """(tokens, splits, chunks_per_split) of the fused_mma kernel: 128 columns x tokens per block; k is split (fp32
    partials summed by the epilogue) when the blocks would leave SMs idle, into parts of >= 4 64-row chunks. The
    block whose busiest SM gets the least work wins (``exl3_gemm.mma_tokens`` forces one)."""
    t = plans.current().exl3_gemm
    chunks = k // 64
    best = None
    for tokens in ((t.mma_tokens,) if t.mma_tokens is not None else tuple(MMA_TOKENS)):
        per_sm = MMA_TOKENS[tokens]
        blocks = n // 128 * math.ceil(m / tokens)
        splits = max(1, min(chunks // 4, sms * per_sm // blocks))
        cps = math.ceil(chunks / splits)
        splits = math.ceil(chunks / cps)
        cost = math.ceil(blocks * splits / (sms * per_sm)) * tokens * cps * t.mma_efficiency[tokens]
        if best is None or cost < best[0]:
            best = (cost, tokens, splits, cps)
    return best[1:]


def plan(m: int, k: int, n: int, K: float, sms: int, variant: str | None = None, fused: bool = False) -> Plan:
    """THE variant table: by m (decode vs prefill), device (``fused``: an sm_90 GPU with the sm_90a build) and
    shape (split-k so one launch fills the GPU; the fused kernel's block shape). Its numbers, and a variant forced
    for experiments (``variant`` here wins over it): ``plans.current().exl3_gemm``."""
    t = plans.current().exl3_gemm
    variant = variant or t.variant
    if not variant:
        if m <= t.large_m:
            variant = "small"
        elif fused:
            variant = "fused" if m <= t.fused_max_m and sms >= t.fused_min_sms else "large"
        elif m <= t.no_wgmma_mma_max_m:
            variant = "fused_mma"
        elif m <= t.no_wgmma_small_max_m and k * n >= t.no_wgmma_small_min_weights:
            variant = "small"
        else:
            variant = "large"
    if variant not in VARIANTS:
        raise ValueError(f"{OP}: unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
    if variant == "fused" and not fused:
        raise ValueError(f"{OP}: the fused variant needs an sm_90 GPU (wgmma) and a build with sm_90a; "
                         "use 'small' or 'large'")
    if variant == "fused":
        block, splits, cps, stream_k = fused_shape(m, k, n, sms)
        return Plan("fused", splits=splits, chunks_per_split=cps, block=block, stream_k=stream_k)
    if variant == "fused_mma":
        tokens, splits, cps = fused_mma_shape(m, k, n, sms)
        return Plan("fused_mma", splits=splits, chunks_per_split=cps, block=tokens)
    if variant == "large":
        return Plan("large")
    m_slice = min(m, M_SLICE)
    groups = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(m_slice / 8)))))
    strips, chunks = n // 128, k // 128
    splits = max(1, min(chunks, math.ceil(t.blocks_per_sm[groups] * sms / strips)))
    cps = math.ceil(chunks / splits)
    prep = t.prep if t.prep is not None else groups >= t.prep_groups and strips * k >= t.prep_work
    return Plan("small", groups, math.ceil(chunks / cps), cps, m_slice, prep)


_PLANS: dict[tuple, Plan] = {}
_PLANS_OF: list = [None]  # the exl3_gemm table _PLANS was made with (a plans.override gets a cache of its own)


def _cached_plan(m, k, n, K, sms, fused) -> Plan:
    t = plans.current().exl3_gemm
    if t is not _PLANS_OF[0]:
        _PLANS.clear()
        _PLANS_OF[0] = t
    key = (m, k, n, K, sms, fused)
    p = _PLANS.get(key)
    if p is None:
        p = _PLANS[key] = plan(m, k, n, K, sms, None, fused)
    return p


# ------------------------------------------------------------------------------------------------ device facts
_FUSED: dict[int, bool] = {}


def _sms(device: torch.device) -> int:
    """The SM count the plan is made for (twinspark.ops.sms: the device's, or a green context's limit)."""
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def fused_available(device: torch.device) -> bool:
    """The fused kernel runs on ``device``: an sm_90 GPU (wgmma) and a build that holds sm_90a code."""
    if device.index not in _FUSED:
        _FUSED[device.index] = (torch.cuda.get_device_capability(device) == (9, 0)
                                and "90a" in _ext.built_archs())
    return _FUSED[device.index]


# -------------------------------------------------------------------------------------------------- checks
def _check(x, trellis, suh, svh, bias, K, codebook, out=None) -> None:
    # Contract: x fp16|bf16 [..., k] (last dim contiguous); trellis int16 [k/16, n/16, 16*K] (16*KA+8 for half
    # rates); suh fp16 [k]; svh fp16 [n]; bias fp16 [n] or None; k, n multiples of 128; all on one device;
    # out (optional) x.dtype [..., n].
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
        raise TypeError(f"{OP}: expected x to be a float16 or bfloat16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"{OP}: expected trellis to be int16 [k/16, n/16, 16*K], got {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"{OP}: expected codebook in {CODEBOOKS}, got {codebook!r}")
    if rate_from_last_dim(trellis.shape[-1]) != K:
        raise ValueError(f"{OP}: trellis last dimension {trellis.shape[-1]} does not match K={K}")
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % 128 or n % 128:
        raise ValueError(f"{OP}: k and n must be multiples of 128 (the Hadamard block), got k={k}, n={n}; "
                         "EXL3 checkpoints pad both, re-export the layer padded")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{OP}: expected x of shape [..., {k}] (k of the layer), got {tuple(x.shape)}")
    for name, t, size in (("suh", suh, k), ("svh", svh, n), ("bias", bias, n)):
        if t is None:
            continue
        if t.dtype != torch.float16 or t.shape != (size,):
            raise ValueError(f"{OP}: expected {name} to be float16 [{size}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("trellis", trellis), ("suh", suh), ("svh", svh), ("bias", bias), ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but x is on {x.device}; move the layer to x's device")
    if out is not None and (out.dtype != x.dtype or out.shape != (*x.shape[:-1], n)):
        raise ValueError(f"{OP}: expected out to be {x.dtype} {(*x.shape[:-1], n)}, got {out.dtype} "
                         f"{tuple(out.shape)}")


# --------------------------------------------------------------------------------------------------- kernel
_WARNED_HALF: set[float] = set()


def _aligned_2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    t2 = t.reshape(-1, cols)
    if t2.stride(-1) != 1 or t2.stride(0) % 4 or t2.data_ptr() % 16:
        t2 = t2.contiguous()
        if t2.data_ptr() % 16:
            t2 = t2.clone()
    return t2


def _run(x, trellis, suh, svh, bias, K: float, codebook: str, out: torch.Tensor) -> None:
    """The kernel path: writes x @ W + bias into out (x.dtype [..., n])."""
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    x2 = _aligned_2d(x, k)
    m = x2.shape[0]
    if m == 0:
        return
    out2 = out.view(-1, n) if out.is_contiguous() else torch.empty(m, n, dtype=out.dtype, device=out.device)
    trellis = trellis if trellis.is_contiguous() and trellis.data_ptr() % 16 == 0 else trellis.contiguous()
    suh, svh = suh.contiguous(), svh.contiguous()
    bias = bias.contiguous() if bias is not None else None
    dev = x2.device
    C = _ext.module()
    stream = _ext.stream_ptr(dev)
    bf16 = x2.dtype == torch.bfloat16
    cb = CODEBOOKS.index(codebook)
    p = _cached_plan(m, k, n, K, _sms(dev), fused_available(dev))
    ws = workspace(dev)
    if p.variant == "small":
        # Zero between calls (the small kernel clears what it used): split-k sums and strip arrival counters.
        cid = capture_id(dev)
        acc = ws.zeroed("gemm_acc", M_SLICE * n, torch.float32, cid)
        counters = ws.zeroed("gemm_counters", n // 128, torch.int32, cid)
        es = x2.element_size()
        xh = ws.buffer("gemm_xh", m * k).data_ptr() if p.prep else 0  # the launcher writes x' there first
        for m0 in range(0, m, p.m_slice):
            mm = min(p.m_slice, m - m0)
            C.exl3_gemm_small(
                x2.data_ptr() + m0 * x2.stride(0) * es, x2.stride(0), trellis.data_ptr(), suh.data_ptr(),
                svh.data_ptr(), bias.data_ptr() if bias is not None else 0, out2.data_ptr() + m0 * n * es, n,
                acc.data_ptr(), counters.data_ptr(), mm, k, n, int(K), cb, p.groups, p.chunks_per_split, p.splits,
                bf16, stream, xh + m0 * k * 2 if xh else 0)
    elif p.variant == "fused":
        xb = ws.buffer("gemm_xb", (m + 7) // 8 * 8 * k)
        partials = not p.stream_k and p.splits > 1  # else y' is fp16
        y = ws.buffer("gemm_y", m * n * (2 * p.splits if partials else 1))
        part = flags = 0
        if p.stream_k:  # a 256 x 128 fp32 hand-over slot and a flag per block
            part = ws.buffer("gemm_sk_part", p.splits * 256 * 128, torch.float32).data_ptr()
            flags = ws.zeroed("gemm_sk_flags", p.splits, torch.int32, capture_id(dev)).data_ptr()
        C.exl3_gemm_prep_x_blocked(x2.data_ptr(), x2.stride(0), bf16, suh.data_ptr(), m, k, xb.data_ptr(), stream)
        C.exl3_gemm_fused(xb.data_ptr(), trellis.data_ptr(), y.data_ptr(), part, flags, m, k, n, int(K), cb,
                          p.block, p.chunks_per_split, p.splits, stream)
        C.exl3_gemm_epilogue(y.data_ptr(), p.splits if partials else 0, svh.data_ptr(),
                             bias.data_ptr() if bias is not None else 0, m, n, out2.data_ptr(), n, bf16, stream)
    elif p.variant == "fused_mma":
        xh = ws.buffer("gemm_xh", m * k)
        y = ws.buffer("gemm_y", m * n * (2 * p.splits if p.splits > 1 else 1))  # fp32 partials, or y' in fp16
        C.exl3_gemm_prep_x(x2.data_ptr(), x2.stride(0), bf16, suh.data_ptr(), m, k, xh.data_ptr(), stream)
        C.exl3_gemm_fused_mma(xh.data_ptr(), trellis.data_ptr(), y.data_ptr(), m, k, n, int(K), cb, p.block,
                              p.chunks_per_split, p.splits, stream)
        C.exl3_gemm_epilogue(y.data_ptr(), p.splits if p.splits > 1 else 0, svh.data_ptr(),
                             bias.data_ptr() if bias is not None else 0, m, n, out2.data_ptr(), n, bf16, stream)
    else:
        # W with suh, both Hadamards and svh folded in, in x's dtype: the GEMM is one dense matmul (bias fused)
        w = ws.buffer("gemm_w_bf16" if bf16 else "gemm_w_fp16", k * n, x2.dtype).view(k, n)
        C.exl3_gemm_dequant_w(trellis.data_ptr(), suh.data_ptr(), svh.data_ptr(), k, n, int(K), cb, bf16,
                              w.data_ptr(), stream)
        if bias is None:
            torch.mm(x2, w, out=out2)
        else:
            b = ws.buffer("gemm_bias_bf16", n, x2.dtype).copy_(bias) if bf16 else bias  # bias is fp16
            torch.addmm(b, x2, w, out=out2)
    if out2.data_ptr() != out.data_ptr():
        out.copy_(out2.view(out.shape))


def _compute(x, trellis, suh, svh, bias, K, codebook, out) -> None:
    if K not in WHOLE_RATES:
        if K not in _WARNED_HALF:
            _WARNED_HALF.add(K)
            warnings.warn(f"{OP}: half rate K={K} has no CUDA kernel yet; running the PyTorch reference "
                          "(correct, much slower)", stacklevel=3)
        out.copy_(_reference(x, trellis, suh, svh, bias, K, codebook))
    elif _ext.use_kernel(x, trellis):
        _run(x, trellis, suh, svh, bias, K, codebook, out)
    else:
        out.copy_(_reference(x, trellis, suh, svh, bias, K, codebook))


@torch.library.custom_op("twinspark::exl3_gemm", mutates_args=())
def _exl3_gemm(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
               bias: torch.Tensor | None, K: float, codebook: str) -> torch.Tensor:
    if not _ext.use_kernel(x, trellis):
        return _reference(x, trellis, suh, svh, bias, K, codebook)
    out = torch.empty(*x.shape[:-1], trellis.shape[1] * 16, dtype=x.dtype, device=x.device)
    _compute(x, trellis, suh, svh, bias, K, codebook, out)
    return out


@_exl3_gemm.register_fake
def _(x, trellis, suh, svh, bias, K, codebook):
    return x.new_empty(*x.shape[:-1], trellis.shape[1] * 16)


@torch.library.custom_op("twinspark::exl3_gemm_out", mutates_args=("out",))
def _exl3_gemm_out(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                   bias: torch.Tensor | None, K: float, codebook: str, out: torch.Tensor) -> None:
    _compute(x, trellis, suh, svh, bias, K, codebook, out)


@_exl3_gemm_out.register_fake
def _(x, trellis, suh, svh, bias, K, codebook, out):
    return None


def exl3_gemm(x: torch.Tensor, layer: Exl3Layer, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W + bias for one EXL3 layer.

    Args:
        x: float16 or bfloat16 ``[..., k]`` (last dim contiguous), CPU (reference) or CUDA.
        layer: the layer (trellis int16 ``[k/16, n/16, 16*K]``, suh fp16 ``[k]``, svh fp16 ``[n]``, optional
            bias fp16 ``[n]``, K 1..8 or 1.5/2.5/3.5, codebook 3inst|mcg|mul1); k and n multiples of 128.
        out: optional ``[..., n]`` tensor of x's dtype to write into.
    Returns:
        ``[..., n]`` in x's dtype (``out`` when given).
    """
    K = float(layer.K)
    _check(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook, out)
    if not torch.compiler.is_compiling() and x.is_cuda:
        # Eager on a GPU: call the implementation directly. The registered ops (what torch.compile and vLLM's
        # graphs see) cost a dispatcher round trip of several µs, comparable to the kernel at m=1.
        y = out if out is not None else torch.empty(*x.shape[:-1], layer.n, dtype=x.dtype, device=x.device)
        _compute(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook, y)
        return y
    if out is None:
        return _exl3_gemm(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook)
    _exl3_gemm_out(x, layer.trellis, layer.suh, layer.svh, layer.bias, K, layer.codebook, out)
    return out
