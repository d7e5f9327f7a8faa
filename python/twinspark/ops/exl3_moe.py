"""twinspark.ops.exl3_moe: one routed-expert MoE layer over EXL3 experts (gate/up, SiLU * up, down, weighted sum).

Design and measured limits: cuda/exl3_moe/DESIGN.md. The measurements the comments below cite ("NOTES.md vN",
``*_h200.log``) are in git: ``git show 1fc0a13:cuda/exl3_moe/NOTES.md``, ``git show 1fc0a13:bench/results/<log>``.

The experts are in the stacked layout of ``twinspark.moe_layout`` (read its docstring). The torch op
``twinspark::exl3_moe`` takes plain tensors and has a fake implementation, so vLLM can trace a MoE method's
``apply()`` through it; nothing on the traced path reads device data or branches on it.

On a CUDA device the kernels in cuda/exl3_moe/ run: routing on the GPU (no host sync, graph capturable), then
gate/up as a grouped EXL3 GEMM over (expert, rows) items and down with the weighted sum. Elsewhere (and with
TWINSPARK_FORCE_REFERENCE=1) the reference in ``twinspark.reference.exl3_moe`` runs. Per-call scratch comes from
the caching allocator; the only state kept between calls is a small counter buffer per (device, stream) that the
kernels leave zero (``twinspark.ops.workspace``: make the first call outside graph capture).

The launch switches (forced split-k, down sizing, early down, PDL, byte-sum, one-rate kernels, packed offsets, the
4-per-SM kernels, the A region's fit and the shared memory sized for) are data: ``twinspark.ops.plans.Exl3Moe``, read
through ``plans.current()`` (experiments: $TWINSPARK_PLAN or ``plans.override("exl3_moe.<key>=...")``).
"""

from __future__ import annotations

import functools

import torch

from twinspark import _ext
from twinspark.exl3.reference import CODEBOOKS, HALF_RATES, WHOLE_RATES, words_per_tile
from twinspark.moe_layout import Exl3MoeExperts, packed_strides
from twinspark.ops import plans
from twinspark.ops.sms import sm_count
from twinspark.ops.workspace import capture_id, workspace
from twinspark.reference import exl3_moe as _reference

_X_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = _reference.ACTIVATIONS
MAX_EXPERTS = 4000  # the routing kernel counts in shared memory
RATE_WORDS = tuple(sorted(words_per_tile(K) for K in WHOLE_RATES + HALF_RATES))  # the decode kernels per rate
DECODE_MAX_PAIRS = 64  # T * top_k up to this: decode (2 launches: in-block routing, split-k, fused convert)
MAX_ITEMS = 65535  # the kernels' grid y / z extent (exl3_moe.h)
GATE_UP_BLOCKS_PER_SM = 3  # the 16-row gate/up kernel's residency (80 registers x 256 threads; moe_gemm.cuh MINB)
GATE_UP4_BLOCKS_PER_SM = 4  # mul1's one-rate gate/up kernels sized for 4 (64 registers), where the device holds 4
# ... with an A region of at least plans.Exl3Moe gate_up4_min_a_kb / down4_min_a_kb k-blocks (_config)


def _check(x, topk_ids, topk_weights, experts: Exl3MoeExperts, activation: str, limit) -> None:
    # Contract: x bf16|fp16 [T, H] (H = experts.hidden); topk_ids int32|int64 [T, top_k] (global expert ids);
    # topk_weights float32|bf16|fp16 [T, top_k]; all on experts' device; 1 <= top_k <= 64; activation "silu";
    # limit None or > 0; at most MAX_EXPERTS experts on this rank. T may be 0.
    op = "exl3_moe"
    if not isinstance(experts, Exl3MoeExperts):
        raise TypeError(f"{op}: expected experts to be a twinspark.moe_layout.Exl3MoeExperts, got {type(experts)}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{op}: expected x to be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"{op}: expected x to be 2-D [T, {experts.hidden}], got shape {list(x.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: expected topk_ids to be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or not 1 <= topk_ids.shape[1] <= 64:
        raise ValueError(f"{op}: expected topk_ids to be [T={x.shape[0]}, top_k] with 1 <= top_k <= 64, got shape "
                         f"{list(topk_ids.shape)}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"{op}: expected topk_weights to be a float tensor, got {topk_weights.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: expected topk_weights to have topk_ids' shape {list(topk_ids.shape)}, got "
                         f"{list(topk_weights.shape)}")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != experts.device:
            raise ValueError(f"{op}: expected {name} on the experts' device {experts.device}, got {t.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: expected activation in {ACTIVATIONS}, got {activation!r}")
    if limit is not None and not limit > 0:
        raise ValueError(f"{op}: expected limit to be None or > 0, got {limit}")
    E, hid, inter = experts.num_experts, experts.hidden, experts.inter
    tables = (("trellis", experts.trellis, torch.int16, None), ("offsets", experts.offsets, torch.int64, (E, 3)),
              ("words", experts.words, torch.int32, (E, 3)), ("suh13", experts.suh13, torch.float16, (E, 2, hid)),
              ("svh13", experts.svh13, torch.float16, (E, 2, inter)), ("suh2", experts.suh2, torch.float16, (E, inter)),
              ("svh2", experts.svh2, torch.float16, (E, hid)))
    for name, t, dtype, shape in tables:
        if t.dtype != dtype or (shape is not None and tuple(t.shape) != shape) or not t.is_contiguous():
            raise ValueError(f"{op}: expected experts.{name} to be contiguous {dtype} of shape {shape or '[total]'}, "
                             f"got {t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}; "
                             f"build experts with twinspark.moe_layout")
        if t.device != experts.device:
            raise ValueError(f"{op}: expected experts.{name} on {experts.device}, got {t.device}")
    if not 16 <= experts.max_words <= 128:
        raise ValueError(f"{op}: experts.max_words is {experts.max_words}, expected the largest words-per-tile "
                         f"entry (16..128); build experts with twinspark.moe_layout")
    for name in ("words13", "words2"):
        w = getattr(experts, name)
        if w and (w > experts.max_words or w not in RATE_WORDS):
            raise ValueError(f"{op}: experts.{name} is {w}, expected 0 or one rate's words per tile ({RATE_WORDS}) "
                             f"<= max_words {experts.max_words}; build experts with twinspark.moe_layout")
    if experts.num_experts > MAX_EXPERTS:
        raise ValueError(f"{op}: at most {MAX_EXPERTS} experts per rank, got {experts.num_experts}; shard the experts "
                         f"over more ranks (expert parallelism)")
    if experts.codebook not in CODEBOOKS:
        raise ValueError(f"{op}: expected experts.codebook in {CODEBOOKS}, got {experts.codebook!r}")


@functools.cache
def _four_per_sm(index: int, down: bool, words: int, max_words: int, smem_per_sm: int, fit_smem: bool,
                 min_a_kb: int) -> bool:
    """Whether mul1's one-rate decode kernel (gate/up, or down) of `words` words per tile, sized for 4 blocks per SM
    (64 registers), gets 4 on device `index` with an A region of min_a_kb k-blocks at least, its shared memory sized as
    a launch of a layer with max_words sizes it (the trellis ring). Asked of the extension (exl3_moe_four_per_sm),
    nothing launched; once per configuration, off the hot path. smem_per_sm (the plan's exl3_moe.smem_per_sm) sizes
    it as on a device with that much shared memory per SM (GB10: 102400)."""
    with torch.cuda.device(index):  # the query reads the current device
        held, a_kb = _ext.module().exl3_moe_four_per_sm(down, words, max_words, smem_per_sm, fit_smem)
    return held >= 4 and a_kb >= min_a_kb


def plan_launch(T: int, top_k: int, num_experts: int, hidden: int, inter: int, sms: int,
                gate_up_blocks: int = GATE_UP_BLOCKS_PER_SM, down4: bool = False) -> dict:
    """Kernel configuration from shapes only (never from device data): rows per item (16 * mt), gate/up split-k,
    the bound on items the grids cover, whether the down kernel converts the output itself, and the blocks per SM
    the 16-row down kernel is sized for. gate_up_blocks: the decode gate/up kernel's blocks per SM (3, or 4 for
    mul1's one-rate kernels where the device holds 4: _config); down4: mul1's one-rate down kernel sized for 4 per SM
    is there (_config). The switches forced for experiments come from ``plans.current().exl3_moe``."""
    t = plans.current().exl3_moe
    if gate_up_blocks not in (GATE_UP_BLOCKS_PER_SM, GATE_UP4_BLOCKS_PER_SM):
        raise ValueError(f"plan_launch: gate_up_blocks is {gate_up_blocks}, expected {GATE_UP_BLOCKS_PER_SM} or "
                         f"{GATE_UP4_BLOCKS_PER_SM} (the gate/up kernels' sizings)")
    pairs = T * top_k
    decode = pairs <= DECODE_MAX_PAIRS
    # 64-row items once experts average more than plans' prefill_rows (16) rows (prefill); 16-row items otherwise and
    # always in decode
    mt = 1 if decode or pairs <= t.prefill_rows * num_experts else 4
    rows = 16 * mt
    max_items = max(1, min(pairs, pairs // rows + min(num_experts, pairs)))
    kblocks = hidden // 128
    # Decode: gate/up split over k into 3 parts while its blocks fit ~2 per SM, else 2 (each part writes its own
    # partial sums, which the down kernel adds). H200, 2026-12-02, build with the cheaper tile copies
    # (bench/results/exl3_moe_v21_split_h200.log, same build, forced 3 / 2 parts): 2 parts 1.2-2.5% faster at T=3-6 for
    # K=2/3/4 (T=4 K=3: 119.3 vs 121.0 us); K=3 sweep: T=2 3 parts (67.8 vs 69.3 at 2), T=1 the mixed 3/4 split below.
    # (Before that build 3 parts held to ~4 blocks per SM: T=4 tied, exl3_moe_v18_plan_sweep_h200.log.)
    # With 4 gate/up blocks per SM and the unsplit grid at most one per SM (T=1): 4 parts (then 4 and 5, below).
    blocks = max(1, min(pairs, num_experts)) * 2 * (inter // 128)
    base = gate_up_blocks if blocks <= sms else 3 if blocks <= 2 * sms else 2
    splitk = min(kblocks, base) if decode else 1
    # Benchmark sweeps (bench_exl3_moe.py --sweep): the plan's exl3_moe.split_k=N forces N uniform parts, "Nm" N parts
    # with the mixed split below on top (plans checks the value).
    forced = t.split_k or ""
    mixed = forced.endswith("m")
    forced = forced.removesuffix("m")
    if decode and forced:
        splitk = max(1, min(kblocks, int(forced)))
    splitk = _whole_parts(kblocks, splitk)
    # Decode: where the split leaves gate/up block slots empty (gate_up_blocks per SM), as many (item,
    # 128 columns) groups as fill them take one part more; the kernel starts the larger pieces first, one per SM
    # (T=1 at 5120/1152 on 132 SMs: 18 groups in 3 parts and 36 in 4 = 396 blocks; at most 34 k-blocks per SM
    # instead of 42). H200, same-run A/B (exl3_moe_v16_mixed_split_ab_h200.log): T=1 -6.1 / -4.4..5.2 / -3.1% at
    # K=2/3/4. A forced split stays uniform. At 4 per SM (mul1 one-rate kernels): 12 groups in 4 parts, 96 in 5 =
    # 528 blocks, at most 34 k-blocks per SM with pieces of 8-10.
    # (Sized for 4 blocks per SM on the fp16 decode, v10: K=4 T=1 +10%; on the byte-sum one-rate kernels, v21:
    # faster everywhere in decode, exl3_moe_v26_gate_up4_h200.log.)
    short_groups = 0
    groups = max_items * (inter // 128)
    room = gate_up_blocks * sms - 2 * groups * splitk
    if decode and (mixed or not forced) and room >= 2 and _whole_parts(kblocks, splitk + 1) == splitk + 1:
        long_groups = min(groups, room // 2)
        splitk, short_groups = splitk + 1, groups - long_groups
    # The 16-row down kernel: 3 blocks per SM (80 registers) once its grid is more than 4 per SM, else 2 (104).
    # H200, with early_down (exl3_moe_v18_plan_sweep_h200.log, K=2/3/4): T=2 (480 blocks) 2 per SM 65.6-66.0 / 76.0 /
    # 69.0 us against 66.6-66.9 / 77.4 / 71.0 at 3; T=4 (960) 3 per SM 114.3 / 134.2 / 120.7 against 118.2 / 137.2 /
    # 124.0 at 2, and 3 at T=8 and T=32 too. T=1 (240 blocks) stays at 2 (3: +5-10%, exl3_moe_v13_down3_h200.log).
    # mul1's one-rate down kernel at 4 per SM (64 registers) wherever 2 per SM is more than one wave (_config).
    down_grid = max_items * (hidden // 128)
    down_min_blocks = 4 if down4 and decode and down_grid > 2 * sms else 3 if down_grid > 4 * sms else 2
    if t.down_blocks is not None:  # benchmark sweeps: exl3_moe.down_blocks=2|3|4 (4: mul1, one rate)
        down_min_blocks = t.down_blocks
    # mul1 items of <= 4 rows: the byte-sum mma (the tensor cores add each weight's product bytes; moe_gemm.cuh).
    # exl3_moe.bytesum=0 keeps the fp16 decode (same-build A/B in bench_exl3_moe.py).
    bytesum = t.bytesum
    # 16-row items: each down block waits for its own item's activations, not for the whole gate/up grid, where the
    # gate/up grid takes more than one wave (items finish in order: T=2 -5%, T=4 -2%, T=8 -1.5%, NOTES.md v13 item 1).
    # In one wave (decode with the mixed split above: T=1) every item finishes at about the same time, and down
    # blocks that start early only share SMs with the last gate/up blocks: waiting for the grid is faster there
    # (H200, same build, NOTES.md v16 item 9: T=1 34.6 / 38.2 / 35.8 us against 36.1 / 39.5 / 37.3 at K=2/3/4).
    # exl3_moe.early_down=1 / 0 forces either.
    one_wave = decode and short_groups > 0
    early_down = mt == 1 and (t.early_down if t.early_down is not None else not one_wave)
    # 16-row kernels: where the full A region would cost blocks per SM (GB10: 100 KB of shared memory per SM), a
    # smaller one (moe_gemm.cuh fit_a_bytes). exl3_moe.smem_per_sm=<bytes> sizes and holds the kernels as on a device
    # with that much (GB10: 102400) on this one; exl3_moe.fit_smem=0 keeps the full region (A/B).
    # 64-row items: x' and the activations made once per pair by launches of their own and copied by the GEMM
    # blocks (issue 43: every block built them, 18 gate/up and H/128 down blocks per item: cuda/exl3_moe/DESIGN.md).
    prep_a = mt == 4 and t.prefill_prep
    return dict(mt=mt, prep_a=prep_a, splitk=splitk, short_groups=short_groups, max_items=max_items, fuse_convert=decode,
                small_route=decode, down_min_blocks=down_min_blocks,
                gate_up_blocks=gate_up_blocks if decode else GATE_UP_BLOCKS_PER_SM, bytesum=bytesum,
                early_down=early_down,
                smem_per_sm=t.smem_per_sm, fit_smem=t.fit_smem)


def gate_up_pdl(capturing: bool) -> bool:
    """Whether a call launches its first GEMM (gate/up) with programmatic dependent launch: the GPU may schedule its
    blocks while the kernel before it on the stream drains, and they wait for it (griddepcontrol.wait) before touching
    memory. H200 (cuda/exl3_moe/NOTES.md v17, launches queued ahead of the GPU): T=1 -4.0 / -4.2 / -4.5% at K=2/3/4,
    T=2 -2.5%, T=4 -1.5%. But such a call took 23-66 µs more host time in four comparisons (104-191 µs per call
    either way), and an eager decode call is host-bound (3-5x its GPU time): by default only calls captured into a
    CUDA graph (vLLM's decode; the host pays once, at capture) use it. The plan's exl3_moe.pdl=1 / 0 forces either."""
    forced = plans.current().exl3_moe.pdl
    return capturing if forced is None else forced


def _whole_parts(kblocks: int, parts: int) -> int:
    """The part count the kernel's ceil-sized parts really make of kblocks (none empty: every part writes its
    partial sums)."""
    return -(-kblocks // -(-kblocks // parts))


def _four_wanted(value: str, index: int, down: bool, words: int, sized: tuple, min_a_kb: int) -> bool:
    """Whether the plan takes mul1's one-rate kernel of `words` (0: none) at 4 blocks per SM: where the device holds
    4 with at least min_a_kb k-blocks of A region (_four_per_sm; `sized`: its max_words, smem_per_sm, fit_smem).
    value (the plan's exl3_moe.gate_up4 / down4): "auto" that, "0" never, "any" wherever 4 fit, whatever the region."""
    return bool(words) and value != "0" and _four_per_sm(index, down, words, *sized, 0 if value == "any" else min_a_kb)


def _config(T: int, top_k: int, E: int, hidden: int, inter: int, index: int, max_words: int, words13: int,
            words2: int, codebook: str) -> tuple[dict, int, int]:
    """plan_launch's configuration for a call on device `index`, with the one-rate kernels' words13 / words2 as the
    launch passes them (0 where the kernels that dispatch on every expert's rate run)."""
    t = plans.current().exl3_moe
    decode = T * top_k <= DECODE_MAX_PAIRS
    # Uniform rates, decode (<= DECODE_MAX_PAIRS pairs): the 16-row kernels compiled for that rate alone. H200, same
    # build (cuda/exl3_moe/NOTES.md v15): T=1 -2.3 / -1.7 / -4.5% at K=2/3/4, T=4 -2.9 / 0 / -2.6%; past decode K=3
    # lost (T=32 +2.2%, T=512 +3.0%), so routed calls keep the kernels that dispatch on every expert's rate. Re-measured
    # after the cheaper tile copies (v16 item 5): T=1 +0.6 / -2.5 / -1.9%, T=2 -1.2 / -2.4 / -2.3%, T=4-8 within 1.2%.
    # exl3_moe.rate_kernels=0: those everywhere (same-build A/B in bench_exl3_moe.py).
    if not decode or not t.rate_kernels:
        words13 = words2 = 0
    # mul1, one rate: the decode kernels sized for 4 blocks per SM where the device holds 4 with enough A region.
    # Gate/up, H200 against 3 per SM (bench/results/exl3_moe_v26_gate_up4_h200.log, exl3_moe_v27_down4_k56_h200.log):
    # T=1 -0.8 / -1.4 / -1.6% at K=2/3/4 (K=4: a 7-k-block region), T=2 -2.3 / -5.5 / -5.0%, T=4 -2.1 / -4.0 / -4.2%, T=8
    # -1.8 / -2.8 / -2.4%; K=5 (5 k-blocks) T=2 -3.4%, T=1 and 4 tied; K=6 (4 k-blocks) T=2 -1.5% but T=4 +1%; sized as
    # on GB10, K=2 gets 4 only with 2 k-blocks: T=1 +2.4% (exl3_moe_v27_gate_up4_gb10_t2_split_h200.log).
    # Down, past one wave at 2 per SM (T >= 2), against 2 or 3 (exl3_moe_v27_down4_k56_h200.log, K=2 / 3; K=4:
    # exl3_moe_v27_final_h200.log): T=2 +0.5 / -4.5 / -6.2%, T=4 -1.9 / -2.7 / -3.9%, T=8 -1.0 / -2.4 / -3.9% (regions of
    # 10 / 8 / 7 k-blocks).
    # exl3_moe.gate_up4=0 / exl3_moe.down4=0 keep 3 / 2-3; =any takes 4 wherever 4 fit, whatever the region
    # (experiments, tests); the regions needed otherwise: exl3_moe.gate_up4_min_a_kb / down4_min_a_kb.
    gate_up4 = down4 = False
    if codebook == "mul1" and (words13 or words2):
        sized = (max_words, t.smem_per_sm, t.fit_smem)
        gate_up4 = _four_wanted(t.gate_up4, index, False, words13, sized, t.gate_up4_min_a_kb)
        down4 = _four_wanted(t.down4, index, True, words2, sized, t.down4_min_a_kb)
    gate_up_blocks = GATE_UP4_BLOCKS_PER_SM if gate_up4 else GATE_UP_BLOCKS_PER_SM
    return plan_launch(T, top_k, E, hidden, inter, sm_count(index), gate_up_blocks, down4), words13, words2


def _kernel(x, ids, weights, trellis, offsets, words, suh13, svh13, suh2, svh2, first_expert, max_words,
            words13, words2, codebook, limit, trace=None, residency=None):
    """The launch. trace: None, or a zeroed int64 tensor of shape _ext.module().trace_shape on x's device that the
    kernels fill with per-block timeline marks (common/trace.cuh; bench/profile_exl3.py --trace reads it).
    residency: None, or a CPU int32 tensor of 2: launch nothing, store the blocks per SM the gate/up and the down
    kernel would get (kernel_residency)."""
    T, hidden = x.shape
    top_k = ids.shape[1]
    E, inter = svh13.shape[0], svh13.shape[-1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    dev = x.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cfg, words13, words2 = _config(T, top_k, E, hidden, inter, index, max_words, words13, words2, codebook)
    # Both rates uniform: the layout is plan's packed one (Exl3MoeExperts checks), so those kernels compute where a
    # matrix starts instead of loading offsets[e] between routing and the first weight fetch (a cold round trip per
    # block). exl3_moe.packed=0 loads it anyway (same-build A/B).
    e_stride, m_stride = (packed_strides(words13, words2, hidden, svh13.shape[-1])
                          if plans.current().exl3_moe.packed else (0, 0))
    capturing = capture_id(dev)
    pdl = gate_up_pdl(capturing != 0)
    if cfg["max_items"] > MAX_ITEMS:
        raise ValueError(f"exl3_moe: {T} tokens x top-{top_k} may make {cfg['max_items']} expert items, more than the "
                         f"kernel grid's {MAX_ITEMS}; pass fewer tokens per call")
    C = _ext.module()
    n_int, n_f32 = C.exl3_moe_workspace(T, top_k, hidden, inter, cfg["max_items"], cfg["splitk"], cfg["mt"])
    ws_int = torch.empty(n_int, dtype=torch.int32, device=dev)
    ws_f32 = torch.empty(n_f32, dtype=torch.float32, device=dev)
    # 16-row items: arrival counters that the kernels leave zero (per stream, made once; see ops.workspace)
    act_counters = (workspace(dev).zeroed("moe_act_counters", cfg["max_items"] * (inter // 128 + 1), torch.int32,
                                          capturing).data_ptr() if cfg["mt"] == 1 else 0)
    xc = x.contiguous()  # the launch reads these: keep them alive until it is queued
    ids32 = ids.to(torch.int32).contiguous()
    w32 = weights.to(torch.float32).contiguous()
    with torch.cuda.device(index):  # launch on x's device even when another one is current
        C.exl3_moe(
            xc.data_ptr(), ids32.data_ptr(), w32.data_ptr(), trellis.data_ptr(), offsets.data_ptr(),
            words.data_ptr(), suh13.data_ptr(), svh13.data_ptr(), suh2.data_ptr(), svh2.data_ptr(),
            ws_int.data_ptr(), ws_f32.data_ptr(), act_counters, out.data_ptr(),
            T, top_k, E, hidden, inter, first_expert, max_words, words13, words2, CODEBOOKS.index(codebook),
            -1.0 if limit is None else float(limit), x.dtype == torch.bfloat16,
            cfg["mt"], cfg["splitk"], cfg["short_groups"], cfg["max_items"], cfg["down_min_blocks"], cfg["fuse_convert"],
            cfg["small_route"], cfg["bytesum"], cfg["early_down"], pdl, _ext.stream_ptr(dev),
            0 if trace is None else trace.data_ptr(), 0 if residency is None else residency.data_ptr(),
            cfg["smem_per_sm"], cfg["fit_smem"], e_stride, m_stride, cfg["gate_up_blocks"], cfg["prep_a"],
        )
    return out


def kernel_residency(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     experts: Exl3MoeExperts) -> tuple[int, int]:
    """Blocks per SM the gate/up and the down kernel of ``exl3_moe(x, topk_ids, topk_weights, experts)`` would get
    on x's CUDA device, their shared memory sized as a launch sizes it; nothing runs (tests, kernel developers)."""
    _check(x, topk_ids, topk_weights, experts, "silu", None)
    if not _ext.use_kernel(x):
        raise ValueError("kernel_residency: the kernels do not run for these inputs (x on the CPU, or "
                         "TWINSPARK_FORCE_REFERENCE set); pass CUDA tensors")
    out = torch.zeros(2, dtype=torch.int32)
    _kernel(x, topk_ids, topk_weights, experts.trellis, experts.offsets, experts.words, experts.suh13,
            experts.svh13, experts.suh2, experts.svh2, int(experts.first_expert), int(experts.max_words),
            int(experts.words13), int(experts.words2), experts.codebook, None, residency=out)
    return int(out[0]), int(out[1])


def launch_plan(x: torch.Tensor, topk_ids: torch.Tensor, experts: Exl3MoeExperts) -> dict:
    """The configuration ``exl3_moe(x, topk_ids, ..., experts)`` launches with on x's CUDA device (plan_launch's
    dict, the gate/up blocks per SM included); nothing runs (benchmarks, kernel developers)."""
    if x.device.type != "cuda":
        raise ValueError(f"launch_plan: x is on {x.device}; the plan is made for a CUDA device, pass CUDA tensors")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _config(x.shape[0], topk_ids.shape[1], experts.svh13.shape[0], x.shape[1], experts.svh13.shape[-1], index,
                   int(experts.max_words), int(experts.words13), int(experts.words2), experts.codebook)[0]


@torch.library.custom_op("twinspark::exl3_moe", mutates_args=())
def _exl3_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, trellis: torch.Tensor,
              offsets: torch.Tensor, words: torch.Tensor, suh13: torch.Tensor, svh13: torch.Tensor,
              suh2: torch.Tensor, svh2: torch.Tensor, first_expert: int, max_words: int, words13: int, words2: int,
              codebook: str, activation: str, limit: float | None) -> torch.Tensor:
    # words13 / words2: Exl3MoeExperts' (0, or the rate every gate/up / down matrix has: the kernels then decode
    # that rate only, so a wrong value drops the other matrices; with both set they also take the offsets to be
    # plan's packed layout. Exl3MoeExperts checks both when built).
    if _ext.use_kernel(x):
        return _kernel(x, topk_ids, topk_weights, trellis, offsets, words, suh13, svh13, suh2, svh2, first_expert,
                       max_words, words13, words2, codebook, limit)
    experts = Exl3MoeExperts(trellis, offsets, words, suh13, svh13, suh2, svh2, hidden=suh13.shape[-1],
                             inter=svh13.shape[-1], codebook=codebook, first_expert=first_expert,
                             max_words=max_words)
    return _reference.exl3_moe(x, topk_ids, topk_weights, experts, activation, limit)


@_exl3_moe.register_fake
def _(x, topk_ids, topk_weights, trellis, offsets, words, suh13, svh13, suh2, svh2, first_expert, max_words,
      words13, words2, codebook, activation, limit):
    return torch.empty_like(x)


def exl3_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3MoeExperts,
             activation: str = "silu", limit: float | None = None) -> torch.Tensor:
    """One routed-expert MoE layer: ``sum_j w[t, j] * down(SiLU(gate(x[t])) * up(x[t]))`` over this rank's experts.

    Args:
        x: bf16 or fp16 ``[T, hidden]`` (T may be 0).
        topk_ids: int32/int64 ``[T, top_k]``, global expert ids (1 <= top_k <= 64). Ids outside
            ``[experts.first_expert, experts.first_expert + experts.num_experts)`` (other ranks' experts, -1)
            contribute nothing; a token may list one expert twice (both pairs count).
        topk_weights: float ``[T, top_k]`` (float32 preferred; others are converted).
        experts: ``twinspark.moe_layout.Exl3MoeExperts`` (per-expert EXL3 gate/up/down; K may differ).
        activation: ``"silu"`` (SiLU(gate) * up).
        limit: optional clamp: gate <= limit, -limit <= up <= limit before the activation.
    Returns:
        ``[T, hidden]`` in x's dtype. Under tensor parallelism (intermediate split) this is the rank's partial
        sum: the caller all-reduces.
    """
    _check(x, topk_ids, topk_weights, experts, activation, limit)
    return _exl3_moe(x, topk_ids, topk_weights, experts.trellis, experts.offsets, experts.words, experts.suh13,
                     experts.svh13, experts.suh2, experts.svh2, int(experts.first_expert), int(experts.max_words),
                     int(experts.words13), int(experts.words2), experts.codebook, activation,
                     None if limit is None else float(limit))


__all__ = ["exl3_moe", "plan_launch"]
