"""The stacked layout of one routed-expert MoE layer in EXL3 (what a vLLM MoE method creates, what
``twinspark.ops.exl3_moe`` reads).

Each expert ``e`` has three EXL3 linears (exl3-format.md): gate ``[hidden -> inter]``, up ``[hidden -> inter]``
(together "w13") and down ``[inter -> hidden]`` ("w2"). Each of the 3*E matrices has its own K (rates may differ
between experts and between gate/up/down of one expert) and its own suh/svh; the codebook is one per layer.

Tensors of an :class:`Exl3MoeExperts` (E = experts on this rank, H = hidden, I = intermediate on this rank):

==========  ======  =================  ===================================================================
name        dtype   shape              meaning
==========  ======  =================  ===================================================================
trellis     int16   [total]            every matrix's trellis ``[k/16, n/16, W]`` row-major, back to back;
                                       each starts at a multiple of 64 values (128 bytes)
offsets     int64   [E, 3]             start of (gate, up, down) of expert e in ``trellis`` (int16 units)
words       int32   [E, 3]             int16 values per 16x16 tile: 16*K (16*KA+8 for K = KA+0.5); this
                                       encodes K (``reference.rate_from_last_dim``)
suh13       fp16    [E, 2, H]          input scales of gate ([:, 0]) and up ([:, 1])
svh13       fp16    [E, 2, I]          output scales of gate and up
suh2        fp16    [E, I]             input scales of down
svh2        fp16    [E, H]             output scales of down
==========  ======  =================  ===================================================================

Host-side fields (plain Python, so nothing on the op's path reads the device): ``hidden``, ``inter``,
``codebook``, ``first_expert`` (global id of local expert 0: expert-parallel sharding; routed ids outside
``[first_expert, first_expert + E)``, and negative ids, contribute nothing), ``max_words`` (largest
``words`` entry, sizes the kernels' shared memory) and ``words13`` / ``words2``: the one ``words`` value of every
gate and up matrix / of every down matrix, or 0 where rates differ. ``empty`` (and so ``from_layers``) sets them
from the plan; a nonzero value lets the decode kernels be the ones compiled for that rate alone (a fraction of
the code and of the registers; cuda/exl3_moe/DESIGN.md "The 16-row decode body"). Construction checks them against
``words`` (one read of it) and, where both are set, ``offsets`` against the packed layout of ``plan`` (``packed_strides``: those kernels
compute a matrix's place instead of loading it).

Limits: H and I multiples of 128 (the Hadamard blocks; checkpoints pad to 128), no bias on experts.

Tensor parallelism splits the intermediate dimension (``shard_intermediate``): gate/up keep all k rows and take
the column tiles ``[r*I/world, (r+1)*I/world)`` with that slice of svh; down takes the same row tiles with that
slice of suh and keeps all columns. The per-rank I must be a multiple of 128 so Hadamard blocks stay whole; the
per-rank down outputs are partial sums that the caller all-reduces (vLLM's MoE layer does).

Building: ``from_layers([(gate, up, down), ...])`` from Exl3Layer triples; or, for a loader that sees one tensor
at a time, ``empty(rates, hidden, inter, codebook)`` then ``set_expert`` / ``set_matrix`` per expert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from twinspark.checks import is_int, is_number
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import Exl3Layer

GATE, UP, DOWN = 0, 1, 2
PROJ_NAMES = ("gate", "up", "down")
ALIGN = 64  # int16 values: every matrix starts on a 128-byte boundary (cp.async 16 B chunks, whole cache lines)


class MoeLayoutError(ValueError):
    """Expert tensors that do not fit the stacked layout: the message names the expert and what to do."""


def matrix_shape(proj: int, hidden: int, inter: int) -> tuple[int, int]:
    """(k, n) of gate/up/down."""
    return (hidden, inter) if proj in (GATE, UP) else (inter, hidden)


@dataclass(frozen=True)
class Exl3MoeExperts:
    trellis: torch.Tensor
    offsets: torch.Tensor
    words: torch.Tensor
    suh13: torch.Tensor
    svh13: torch.Tensor
    suh2: torch.Tensor
    svh2: torch.Tensor
    hidden: int
    inter: int
    codebook: str
    first_expert: int = 0
    max_words: int = 0
    words13: int = 0
    words2: int = 0

    def __post_init__(self):
        for name, value, cols in (("words13", self.words13, slice(0, 2)), ("words2", self.words2, slice(2, 3))):
            if value and not bool((self.words[:, cols] == value).all()):
                raise MoeLayoutError(f"moe layout: {name}={value} but not every {PROJ_NAMES[cols.start]}"
                                     f"{'/up' if name == 'words13' else ''} matrix has {value} words per tile; "
                                     f"pass 0 (rates differ) or build the experts with moe_layout.empty / from_layers")
        e_stride, m_stride = packed_strides(self.words13, self.words2, self.hidden, self.inter)
        if e_stride:
            e = torch.arange(self.offsets.shape[0], dtype=torch.int64, device=self.offsets.device)[:, None]
            packed = e * e_stride + torch.arange(3, dtype=torch.int64, device=self.offsets.device) * m_stride
            if not torch.equal(self.offsets, packed):
                raise MoeLayoutError("moe layout: words13 and words2 are set but the offsets are not the packed layout "
                                     "moe_layout.plan makes for one rate (the decode kernels would compute them); "
                                     "pass words13=words2=0 or build the experts with moe_layout.empty / from_layers")

    @property
    def num_experts(self) -> int:
        return self.offsets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.trellis.device

    def to(self, device) -> Exl3MoeExperts:
        mv = lambda t: t.to(device)  # noqa: E731
        return replace(self, trellis=mv(self.trellis), offsets=mv(self.offsets), words=mv(self.words),
                       suh13=mv(self.suh13), svh13=mv(self.svh13), suh2=mv(self.suh2), svh2=mv(self.svh2))

    def with_first_expert(self, first_expert: int) -> Exl3MoeExperts:
        return replace(self, first_expert=int(first_expert))

    def rates(self) -> list[list[float]]:
        """K of (gate, up, down) per expert (reads `words`: a device sync when on the GPU)."""
        return [[ref.rate_from_last_dim(int(w)) for w in row] for row in self.words.cpu().tolist()]

    def layer(self, e: int, proj: int) -> Exl3Layer:
        """Expert e's gate/up/down as an Exl3Layer of views into the stacked tensors."""
        _check_index(e, proj, self.num_experts)
        return layer_from_tensors(self.trellis, self.offsets, self.words, self.suh13, self.svh13, self.suh2,
                                  self.svh2, e, proj, self.hidden, self.inter, self.codebook)

    def matrix_bytes(self, e: int, proj: int, words: int | None = None) -> int:
        """Trellis bytes of one matrix (what a kernel must read for it)."""
        k, n = matrix_shape(proj, self.hidden, self.inter)
        w = int(self.words[e, proj]) if words is None else words
        return (k // 16) * (n // 16) * w * 2


def layer_from_tensors(trellis, offsets, words, suh13, svh13, suh2, svh2, e: int, proj: int, hidden: int,
                       inter: int, codebook: str, off: int | None = None, w: int | None = None) -> Exl3Layer:
    """One matrix as an Exl3Layer of views (plain-tensor form, used by the op's reference path)."""
    k, n = matrix_shape(proj, hidden, inter)
    off = int(offsets[e, proj]) if off is None else off
    w = int(words[e, proj]) if w is None else w
    t = trellis[off: off + (k // 16) * (n // 16) * w].view(k // 16, n // 16, w)
    if proj == DOWN:
        suh, svh = suh2[e], svh2[e]
    else:
        suh, svh = suh13[e, proj], svh13[e, proj]
    return Exl3Layer(t, suh, svh, ref.rate_from_last_dim(w), codebook, None, name=f"expert {e} {PROJ_NAMES[proj]}")


def plan(rates: Sequence[Sequence[float]], hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(offsets int64 [E, 3], words int32 [E, 3], total int16 values) for per-expert rates [[Kg, Ku, Kd], ...].

    A loader that knows every expert's K (from the checkpoint's shapes) allocates ``trellis`` with ``total``
    values up front and copies each matrix in later (``set_matrix``)."""
    _check_dims(hidden, inter)
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Iterable):
        raise MoeLayoutError(f"moe layout: rates must be one (gate, up, down) triple per expert, got {rates!r:.60}")
    offsets, words, pos = [], [], 0
    for e, row in enumerate(rates):
        if isinstance(row, (str, bytes)) or not isinstance(row, Iterable) or len(row := tuple(row)) != 3:
            raise MoeLayoutError(f"moe layout: expert {e} needs 3 rates (gate, up, down), got {row!r:.60}")
        o_row, w_row = [], []
        for proj, K in enumerate(row):
            try:
                if not is_number(K):
                    raise ValueError(f"K={K!r:.40} is not a finite number")
                w = ref.words_per_tile(float(K))
            except ValueError as exc:
                raise MoeLayoutError(f"moe layout: expert {e} {PROJ_NAMES[proj]}: {exc}") from None
            k, n = matrix_shape(proj, hidden, inter)
            o_row.append(pos)
            w_row.append(w)
            pos += -(-(k // 16) * (n // 16) * w // ALIGN) * ALIGN
        offsets.append(o_row)
        words.append(w_row)
    return (torch.tensor(offsets, dtype=torch.int64).reshape(-1, 3),
            torch.tensor(words, dtype=torch.int32).reshape(-1, 3), pos)


def packed_strides(words13: int, words2: int, hidden: int, inter: int) -> tuple[int, int]:
    """(e_stride, m_stride) with offsets[e, proj] == e * e_stride + proj * m_stride in the layout ``plan`` makes
    when every gate/up matrix has words13 and every down matrix words2 words per tile; (0, 0) unless both are set.
    Exl3MoeExperts checks its offsets against them; the decode kernels then compute a matrix's place."""
    if not (words13 and words2):
        return 0, 0
    tiles = (hidden // 16) * (inter // 16)
    s13, s2 = (-(-tiles * w // ALIGN) * ALIGN for w in (words13, words2))
    return 2 * s13 + s2, s13


MAX_DIM = 1 << 20  # far above any model's hidden or intermediate size; keeps every index in 64-bit range


def _check_dims(hidden: int, inter: int) -> None:
    if not all(is_int(d) and 0 < d <= MAX_DIM and d % 128 == 0 for d in (hidden, inter)):
        raise MoeLayoutError(f"moe layout: hidden ({hidden!r:.40}) and intermediate ({inter!r:.40}) must be positive "
                             f"multiples of 128 (Hadamard blocks) up to {MAX_DIM}; pad the checkpoint or use a "
                             "tensor-parallel degree that keeps 128-column blocks whole")


def _check_index(e: int, proj: int, num_experts: int) -> None:
    if not (is_int(e) and 0 <= e < num_experts):
        raise MoeLayoutError(f"moe layout: expert index {e!r:.40} is outside this layer's {num_experts} experts "
                             "(0..E-1 on this rank); check the expert ids against config.json and first_expert")
    if not (is_int(proj) and proj in (GATE, UP, DOWN)):
        raise MoeLayoutError(f"moe layout: projection {proj!r:.40} is not 0 (gate), 1 (up) or 2 (down)")


def empty(rates: Sequence[Sequence[float]], hidden: int, inter: int, codebook: str = "mul1",
          first_expert: int = 0, device=None) -> Exl3MoeExperts:
    """Zero-filled experts with the given per-expert rates [[Kg, Ku, Kd], ...]; fill with ``set_expert``."""
    if not isinstance(codebook, str) or codebook not in ref.CODEBOOKS:
        raise MoeLayoutError(f"moe layout: codebook must be one of {ref.CODEBOOKS}, got {codebook!r:.40}")
    if not is_int(first_expert) or first_expert < 0:
        raise MoeLayoutError(f"moe layout: first_expert must be an integer >= 0 (the global id of local expert 0), "
                             f"got {first_expert!r:.40}")
    offsets, words, total = plan(rates, hidden, inter)
    half = words[words % 16 == 8]  # 16*KA + 8 words per tile: a half rate
    if codebook != "mul1" and half.numel():
        raise MoeLayoutError(f"moe layout: half rate K={ref.rate_from_last_dim(int(half[0]))} exists only with the "
                             f"mul1 codebook (this layer is {codebook}); re-quantize or fix the rates")
    e = offsets.shape[0]
    if e == 0:
        raise MoeLayoutError("moe layout: a MoE layer needs at least one expert")
    f16 = dict(dtype=torch.float16, device=device)
    uniform = lambda w: int(w[0]) if bool((w == w[0]).all()) else 0  # noqa: E731
    return Exl3MoeExperts(
        trellis=torch.zeros(total, dtype=torch.int16, device=device), offsets=offsets.to(device),
        words=words.to(device), suh13=torch.zeros(e, 2, hidden, **f16), svh13=torch.zeros(e, 2, inter, **f16),
        suh2=torch.zeros(e, inter, **f16), svh2=torch.zeros(e, hidden, **f16), hidden=hidden, inter=inter,
        codebook=codebook, first_expert=int(first_expert), max_words=int(words.max()),
        words13=uniform(words[:, :2].reshape(-1)), words2=uniform(words[:, 2]))


def set_matrix(experts: Exl3MoeExperts, e: int, proj: int, layer: Exl3Layer) -> None:
    """Copy one Exl3Layer (expert e's gate, up or down) into its place; checks shape, K and codebook."""
    _check_index(e, proj, experts.num_experts)
    where = f"expert {e} {PROJ_NAMES[proj]}"
    if not isinstance(layer, Exl3Layer):
        raise MoeLayoutError(f"moe layout: {where} must be an Exl3Layer, got {type(layer).__name__}")
    k, n = matrix_shape(proj, experts.hidden, experts.inter)
    if layer.k != k or layer.n != n:
        raise MoeLayoutError(f"moe layout: {where} ({layer.name or 'layer'}) is {layer.k}x{layer.n}, the layout "
                             f"expects {k}x{n} (k x n); check hidden/intermediate and the tensor-parallel split")
    w = int(experts.words[e, proj])
    if layer.trellis.shape[-1] != w:
        raise MoeLayoutError(f"moe layout: {where} has K={layer.K}, the layout was planned with "
                             f"K={ref.rate_from_last_dim(w)}; plan with the checkpoint's rates")
    if layer.codebook != experts.codebook:
        raise MoeLayoutError(f"moe layout: {where} uses codebook {layer.codebook}, the layer uses "
                             f"{experts.codebook}; all experts of one layer must share a codebook")
    if layer.bias is not None:
        raise MoeLayoutError(f"moe layout: {where} has a bias; routed experts with bias are not supported")
    for part in ("suh", "svh"):
        if not bool(torch.isfinite(getattr(layer, part)).all()):
            raise MoeLayoutError(f"moe layout: {where} has NaN or infinite values in its {part}; re-download the "
                                 "shard or re-quantize the expert")
    view = experts.layer(e, proj)
    view.trellis.copy_(layer.trellis)
    view.suh.copy_(layer.suh)
    view.svh.copy_(layer.svh)


def set_expert(experts: Exl3MoeExperts, e: int, gate: Exl3Layer, up: Exl3Layer, down: Exl3Layer) -> None:
    for proj, layer in enumerate((gate, up, down)):
        set_matrix(experts, e, proj, layer)


def from_layers(layers: Sequence[tuple[Exl3Layer, Exl3Layer, Exl3Layer]], first_expert: int = 0,
                device=None) -> Exl3MoeExperts:
    """Stack (gate, up, down) Exl3Layer triples of one rank into the layout (dims and codebook from the first)."""
    if not layers:
        raise MoeLayoutError("moe layout: from_layers needs at least one expert")
    for e, triple in enumerate(layers):
        if not (isinstance(triple, Sequence) and len(triple) == 3 and all(isinstance(m, Exl3Layer) for m in triple)):
            raise MoeLayoutError(f"moe layout: expert {e} must be a (gate, up, down) triple of Exl3Layer")
    gate0 = layers[0][0]
    hidden, inter = gate0.k, gate0.n
    experts = empty([[m.K for m in triple] for triple in layers], hidden, inter, gate0.codebook, first_expert,
                    device=device)
    for e, (g, u, d) in enumerate(layers):
        set_expert(experts, e, g.to(experts.device), u.to(experts.device), d.to(experts.device))
    return experts


def shard_intermediate(layer: Exl3Layer, proj: int, rank: int, world: int) -> Exl3Layer:
    """Rank `rank`'s part of one expert matrix when tensor parallelism splits the intermediate dimension.

    gate/up (k = hidden, n = inter): column tiles and svh of this rank's slice. down (k = inter, n = hidden): row
    tiles and suh of the slice. The slice must be a multiple of 128 (whole Hadamard blocks)."""
    inter = layer.n if proj in (GATE, UP) else layer.k
    if world < 1 or not 0 <= rank < world:
        raise MoeLayoutError(f"moe layout: rank {rank} is not in a tensor-parallel group of {world}")
    if inter % world or (inter // world) % 128:
        raise MoeLayoutError(f"moe layout: {layer.name or PROJ_NAMES[proj]}: intermediate size {inter} does not split "
                             f"into {world} slices of a multiple of 128; use a tensor-parallel degree that does")
    part = inter // world
    lo, hi = rank * part, (rank + 1) * part
    if proj in (GATE, UP):
        return replace(layer, trellis=layer.trellis[:, lo // 16: hi // 16].contiguous(),
                       svh=layer.svh[lo:hi].contiguous())
    return replace(layer, trellis=layer.trellis[lo // 16: hi // 16].contiguous(), suh=layer.suh[lo:hi].contiguous())


def random_experts(num_experts: int, hidden: int, inter: int, rates=(3.0, 3.0, 3.0), codebook: str = "mul1",
                   first_expert: int = 0, generator: torch.Generator | None = None, device=None) -> Exl3MoeExperts:
    """Random valid experts for tests and benchmarks. `rates` is one (Kg, Ku, Kd) for all or a list per expert.

    Trellis words are random (every bit pattern is valid); suh ~ 1/sqrt(k) with random signs, svh ~ 1 (as
    ``random_layer``) so activations stay O(1)."""
    if rates and not isinstance(rates[0], (list, tuple)):
        rates = [tuple(rates)] * num_experts
    experts = empty(rates, hidden, inter, codebook, first_expert)
    g = generator
    experts.trellis.copy_(torch.randint(-32768, 32768, experts.trellis.shape, dtype=torch.int16, generator=g))

    def scales(shape, k):
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        return (sign * (0.75 + 0.5 * torch.rand(shape, generator=g)) / (k ** 0.5 if k else 1)).half()

    experts.suh13.copy_(scales(experts.suh13.shape, hidden))
    experts.svh13.copy_(scales(experts.svh13.shape, 0))
    experts.suh2.copy_(scales(experts.suh2.shape, inter))
    experts.svh2.copy_(scales(experts.svh2.shape, 0))
    return experts.to(device) if device is not None else experts
