"""Pure-PyTorch EXL3 reference, bit-exact with docs/exl3-format.md (shared spec). Runs on the CPU and the GPU.

Terms: ``k`` = in_features, ``n`` = out_features, ``K`` = bits per weight of one tensor (1..8, or the half
rates 1.5, 2.5, 3.5). A trellis is int16 ``[k/16, n/16, 16*K]`` (half rates ``16*KA + 8``); each 16x16 tile is
a ring of ``256*K`` bits holding 256 overlapping 16-bit states, one per weight.

Public functions (other repositories call exactly these):
    decode(states, codebook) -> float16
    unpack(trellis, K) -> int64 [..., 256]            (states in trellis order)
    pack(symbols, K) -> int16 [..., 16*K]             (inverse direction, for making test tensors)
    inner_weight(trellis, K, codebook) -> float16 [k, n]     (W_hat)
    weight(trellis, suh, svh, K, codebook) -> float32 [k, n]
    linear(x, trellis, suh, svh, K, codebook, bias=None) -> float32 [..., n]
"""

from __future__ import annotations

import math

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")
WHOLE_RATES = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)

_MASK32 = 0xFFFFFFFF
_MUL1_MULT = 0x83DCD12D
_MCG_MULT = 0xCBAC1FED
_3INST_MULT = 89226354
_3INST_ADD = 64248484


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int tensor of 16-bit patterns -> float16 with those bits."""
    b = bits & 0xFFFF
    b = torch.where(b >= 0x8000, b - 0x10000, b)  # two's complement view for int16
    return b.to(torch.int16).view(torch.float16)


def decode(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Map 16-bit trellis states to float16 weights with one of the three codebooks (spec section 3).

    states: any integer tensor (values 0..65535). Returns float16 of the same shape."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"decode: unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    if states.dtype.is_floating_point or states.dtype == torch.bool:
        raise TypeError(f"decode: states must be an integer tensor, got {states.dtype}")
    s = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        x = (s * _MUL1_MULT) & _MASK32
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = _fp16_from_bits(0x6400 + byte_sum).to(torch.float32)  # = 1024 + byte_sum, exact
        scale = _fp16_from_bits(torch.tensor(0x1EEE)).to(torch.float32)
        offset = _fp16_from_bits(torch.tensor(0xC931)).to(torch.float32)
        # h*scale and the sum are exact in fp32 (<= 22 significant bits): one rounding, like one fp16 FMA.
        return (h * scale + offset).to(torch.float16)
    if codebook == "mcg":
        x = (s * _MCG_MULT) & _MASK32
    else:
        x = (s * _3INST_MULT + _3INST_ADD) & _MASK32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _fp16_from_bits(x & 0xFFFF).to(torch.float32)
    hi = _fp16_from_bits(x >> 16).to(torch.float32)
    return (lo + hi).to(torch.float16)  # the sum of two fp16 values is exact in fp32: one rounding


def codebook_table(codebook: str) -> torch.Tensor:
    """All 65,536 states decoded, in state order (float16)."""
    return decode(torch.arange(65536, dtype=torch.int64), codebook)


def split_rate(K: float) -> tuple[int, bool]:
    """K -> (whole bits KA, is_half_rate); raises for rates that do not exist."""
    if K in WHOLE_RATES:
        return int(K), False
    if K in HALF_RATES:
        return int(math.floor(K)), True
    raise ValueError(f"K={K} is not an EXL3 rate; expected one of 1..8 or 1.5, 2.5, 3.5")


def words_per_tile(K: float) -> int:
    """int16 values per 16x16 tile: 16*K, or 16*KA + 8 for half rates."""
    ka, half = split_rate(K)
    return 16 * ka + (8 if half else 0)


def rate_from_last_dim(last_dim: int) -> float:
    """Inverse of words_per_tile; raises when no rate has that many words."""
    if last_dim % 16 == 0 and last_dim // 16 in WHOLE_RATES:
        return float(last_dim // 16)
    if last_dim % 16 == 8 and (last_dim // 16) + 0.5 in HALF_RATES:
        return (last_dim // 16) + 0.5
    raise ValueError(
        f"trellis last dimension {last_dim} matches no EXL3 rate (16*K for K in 1..8, or 16*KA+8 for 1.5/2.5/3.5)"
    )


def _end_bits(K: float) -> torch.Tensor:
    """S(t) for t = 0..255: the ring bit where position t's state ends."""
    ka, half = split_rate(K)
    t1 = torch.arange(1, 257, dtype=torch.int64)
    return t1 * ka + (t1 // 2 if half else 0)


def _ring_bits(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., W] -> uint8 bits [..., 16*W] in stream order (MSB first inside each little-endian u32)."""
    v = trellis.to(torch.int64) & 0xFFFF
    words = v[..., 0::2] | (v[..., 1::2] << 16)  # [..., W/2] u32
    shifts = torch.arange(31, -1, -1, dtype=torch.int64, device=trellis.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [..., W/2, 32]
    return bits.reshape(*trellis.shape[:-1], trellis.shape[-1] * 16).to(torch.uint8)


def unpack(trellis: torch.Tensor, K: float) -> torch.Tensor:
    """Trellis int16 [..., W] -> the 256 states of each tile, int64 [..., 256], in trellis position order."""
    if trellis.dtype != torch.int16:
        raise TypeError(f"unpack: trellis must be int16, got {trellis.dtype}")
    w = words_per_tile(K)
    if trellis.shape[-1] != w:
        raise ValueError(f"unpack: trellis last dimension must be {w} for K={K}, got {trellis.shape[-1]}")
    ring = 16 * w
    bits = _ring_bits(trellis).to(torch.int64)
    starts = _end_bits(K).to(trellis.device) - 16  # [256]
    idx = (starts.unsqueeze(1) + torch.arange(16, device=trellis.device)) % ring  # [256, 16]
    gathered = bits[..., idx.reshape(-1)].reshape(*trellis.shape[:-1], 256, 16)
    weights = 1 << torch.arange(15, -1, -1, dtype=torch.int64, device=trellis.device)
    return (gathered * weights).sum(-1)


def pack(symbols: torch.Tensor, K: float) -> torch.Tensor:
    """Symbols [..., 256] (position t carries K bits, KA+1 at odd t for half rates) -> trellis int16 [..., W].

    Position t's bits go, MSB first, into ring bits [S(t-1), S(t)) (S(-1) = 0). Any bit pattern is a valid
    trellis, so packing random symbols makes valid test tensors for every K."""
    ka, half = split_rate(K)
    w = words_per_tile(K)
    ends = _end_bits(K)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1]])
    nbits = ends - starts  # K, or KA / KA+1 alternating
    s = symbols.to(torch.int64)
    if (s < 0).any() or (s >= (1 << nbits.to(s.device))).any():
        raise ValueError(f"pack: a symbol does not fit its position's bit count for K={K}")
    maxb = int(nbits.max())
    # bit i (MSB first) of position t's symbol, for i < nbits[t]
    shifts = (nbits.unsqueeze(1) - 1 - torch.arange(maxb)).to(s.device)  # [256, maxb]
    valid = shifts >= 0
    sym_bits = (s.unsqueeze(-1) >> shifts.clamp(min=0)) & 1  # [..., 256, maxb]
    pos = (starts.unsqueeze(1) + torch.arange(maxb)).to(s.device)  # ring position of each bit
    flat_bits = sym_bits[..., valid]  # [..., ring]
    flat_pos = pos[valid]
    ring = torch.zeros(*s.shape[:-1], 16 * w, dtype=torch.int64, device=s.device)
    ring[..., flat_pos] = flat_bits
    ring = ring.reshape(*s.shape[:-1], w // 2, 32)
    weights = 1 << torch.arange(31, -1, -1, dtype=torch.int64, device=s.device)
    words = (ring * weights).sum(-1)  # u32 words
    lo, hi = words & 0xFFFF, (words >> 16) & 0xFFFF
    halves = torch.stack([lo, hi], dim=-1).reshape(*s.shape[:-1], w)
    return torch.where(halves >= 0x8000, halves - 0x10000, halves).to(torch.int16)


def tile_positions() -> torch.Tensor:
    """For t = 0..255, the flat index r*16 + c of position t inside its 16x16 tile (mma B-fragment order)."""
    t = torch.arange(256)
    lane, j = t >> 3, t & 7
    r = 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1)
    c = (lane >> 2) + 8 * ((j >> 2) & 1)
    return r * 16 + c


def inner_weight(trellis: torch.Tensor, K: float, codebook: str) -> torch.Tensor:
    """W_hat, float16 [k, n], from a trellis int16 [k/16, n/16, W]."""
    if trellis.dim() != 3:
        raise ValueError(f"inner_weight: trellis must be 3-D [k/16, n/16, W], got {trellis.dim()} dims")
    tk, tn, _ = trellis.shape
    vals = decode(unpack(trellis, K), codebook)  # [tk, tn, 256] in position order
    tiles = torch.empty_like(vals)
    tiles[..., tile_positions().to(vals.device)] = vals
    return tiles.reshape(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


def hadamard_128(device=None, dtype=torch.float32) -> torch.Tensor:
    """H128 / sqrt(128): natural-order Sylvester Hadamard, H[i, j] = (-1)^popcount(i & j), orthonormal."""
    i = torch.arange(128)
    x = i.unsqueeze(1) & i.unsqueeze(0)
    parity = torch.zeros_like(x)
    for b in range(7):
        parity ^= (x >> b) & 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(128)).to(device=device, dtype=dtype)


def _block_hadamard_rows(a: torch.Tensor) -> torch.Tensor:
    """H_blockdiag @ a along dim 0 (rows in blocks of 128)."""
    r, c = a.shape
    h = hadamard_128(a.device, a.dtype)
    return torch.einsum("ij,bjc->bic", h, a.reshape(r // 128, 128, c)).reshape(r, c)


def _block_hadamard_cols(a: torch.Tensor) -> torch.Tensor:
    """a @ H_blockdiag along the last dim (columns in blocks of 128)."""
    shape = a.shape
    h = hadamard_128(a.device, a.dtype)
    return (a.reshape(*shape[:-1], shape[-1] // 128, 128) @ h).reshape(shape)


def weight(trellis, suh, svh, K: float, codebook: str) -> torch.Tensor:
    """W = diag(suh) · Hk · W_hat · Hn · diag(svh), float32 [k, n]."""
    w_hat = inner_weight(trellis, K, codebook).to(torch.float32)
    k, n = w_hat.shape
    if k % 128 or n % 128:
        raise ValueError(f"weight: k and n must be multiples of 128 for the Hadamard blocks, got {k}x{n}")
    w = _block_hadamard_cols(_block_hadamard_rows(w_hat))
    return suh.to(torch.float32).unsqueeze(1) * w * svh.to(torch.float32).unsqueeze(0)


def linear(x, trellis, suh, svh, K: float, codebook: str, bias=None) -> torch.Tensor:
    """y = ((((x ⊙ suh) · Hk) · W_hat) · Hn) ⊙ svh + bias, in float32, x of shape [..., k] -> [..., n]."""
    w_hat = inner_weight(trellis, K, codebook).to(torch.float32)
    k, n = w_hat.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the layer expects k={k}")
    lead = x.shape[:-1]
    a = x.reshape(-1, k).to(torch.float32) * suh.to(torch.float32)
    a = _block_hadamard_cols(a)
    y = _block_hadamard_cols(a @ w_hat) * svh.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*lead, n)
