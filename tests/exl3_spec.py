"""The EXL3 spec decoder of the tests, written from the format's text (docs/exl3-format.md, shared spec) without
twinspark.exl3.reference's code: the independent side of every reference check.

Two implementations, checked against each other bit for bit (tests/test_exl3_reference.py):
  - scalar: Python integers and ``struct`` half floats, one state and one tile at a time (slow, obviously the text);
  - array: numpy over whole trellises, every position's state read from a 64-bit window of two ring words (not the
    reference's bit unpacking), codebook values from a table the scalar decoder makes.
``weight`` and ``linear`` give the spec's W and y in float64 (no rounding but the codebook's fp16 values).
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import torch

CODEBOOKS = ("3inst", "mcg", "mul1")
WHOLE_RATES = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)  # mul1 only (spec section 1)


# ------------------------------------------------------------------------------------------------- scalar
def f16(bits: int) -> float:
    """The float16 with these 16 bits, as a Python float."""
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def round_f16(x: float) -> float:
    """IEEE round to nearest even to float16."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


def decode_state(s: int, codebook: str) -> float:
    """Spec section 3: one 16-bit state -> its codebook value (a float16 value, as a Python float)."""
    if codebook == "mul1":
        x = (s * 0x83DCD12D) & 0xFFFFFFFF
        b = sum((x >> sh) & 0xFF for sh in (0, 8, 16, 24))
        return round_f16(f16(0x6400 + b) * f16(0x1EEE) + f16(0xC931))
    if codebook not in ("mcg", "3inst"):
        raise ValueError(f"no codebook {codebook!r} in the spec")
    x = (s * 0xCBAC1FED) if codebook == "mcg" else (s * 89226354 + 64248484)
    x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
    return round_f16(f16(x & 0xFFFF) + f16(x >> 16))


def end_bit(t: int, K: float) -> int:
    """Spec section 2, step 2: S(t), the ring bit where position t's state ends."""
    ka = int(math.floor(K))
    return (t + 1) * ka if K == ka else (t + 1) * ka + (t + 1) // 2


def position_rc(t: int) -> tuple[int, int]:
    """Spec section 2, step 4: position t -> (row along k, column along n) inside its 16x16 tile."""
    lane, j = t >> 3, t & 7
    return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1), (lane >> 2) + 8 * ((j >> 2) & 1)


def tile(words16: list[int], K: float, codebook: str) -> list[list[float]]:
    """One tile's 16x16 values from its int16 words, bit by bit as the spec reads them."""
    w = [(words16[2 * i] & 0xFFFF) | ((words16[2 * i + 1] & 0xFFFF) << 16) for i in range(len(words16) // 2)]
    ring = 32 * len(w)
    out = [[0.0] * 16 for _ in range(16)]
    for t in range(256):
        end = end_bit(t, K)
        state = 0
        for b in range(end - 16, end):
            bb = b % ring
            state = (state << 1) | ((w[bb >> 5] >> (31 - (bb & 31))) & 1)
        r, c = position_rc(t)
        out[r][c] = decode_state(state, codebook)
    return out


# -------------------------------------------------------------------------------------------------- array
def words_per_tile(K: float) -> int:
    if K in WHOLE_RATES:
        return 16 * int(K)
    if K in HALF_RATES:
        return 16 * int(math.floor(K)) + 8
    raise ValueError(f"K={K} is no EXL3 rate")


@functools.cache
def codebook_bits(codebook: str) -> np.ndarray:
    """uint16 [65536]: the float16 bit pattern of every state's value, from the scalar decoder."""
    return np.array([struct.unpack("<H", struct.pack("<e", decode_state(s, codebook)))[0] for s in range(65536)],
                    dtype=np.uint16)


@functools.cache
def _layout(K: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per position t: the ring word holding its state's first bit, that bit's offset in the word, its (r, c)."""
    ring = 256 * K  # bits (an integer for every rate)
    start = np.array([(end_bit(t, K) - 16) % int(ring) for t in range(256)], dtype=np.int64)
    rc = np.array([position_rc(t) for t in range(256)], dtype=np.int64)
    return start >> 5, start & 31, rc[:, 0], rc[:, 1]


def states(trellis, K: float) -> np.ndarray:
    """int16 [..., W] (tensor or array) -> int64 [..., 256]: each position's 16-bit state, read as bits
    [64 - off - 16, 64 - off) of the big-endian pair (ring word i, ring word i+1 mod words)."""
    t = np.asarray(trellis.numpy() if isinstance(trellis, torch.Tensor) else trellis)
    if t.dtype != np.int16 or t.shape[-1] != words_per_tile(K):
        raise ValueError(f"spec: expected int16 [..., {words_per_tile(K)}] for K={K}, got {t.dtype} {t.shape}")
    u = t.astype(np.uint64) & 0xFFFF
    w = u[..., 0::2] | (u[..., 1::2] << np.uint64(16))  # little-endian uint32 words
    word, off, _, _ = _layout(K)
    nxt = (word + 1) % w.shape[-1]
    pair = (np.take(w, word, axis=-1) << np.uint64(32)) | np.take(w, nxt, axis=-1)
    return ((pair >> (np.uint64(48) - off.astype(np.uint64))) & np.uint64(0xFFFF)).astype(np.int64)


def inner_weight(trellis, K: float, codebook: str) -> torch.Tensor:
    """W_hat, float16 [k, n], from a trellis int16 [k/16, n/16, W]."""
    s = states(trellis, K)
    tk, tn = s.shape[0], s.shape[1]
    _, _, r, c = _layout(K)
    tiles = np.empty((tk, tn, 16, 16), dtype=np.uint16)
    tiles[:, :, r, c] = codebook_bits(codebook)[s]
    bits = tiles.transpose(0, 2, 1, 3).reshape(tk * 16, tn * 16)
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.float16)


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    """float16 values -> bfloat16, rounded to nearest even on the float32 bit pattern (finite values)."""
    b = w.float().numpy().view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)
    return torch.from_numpy(r.view(np.int16).copy()).view(torch.bfloat16)


def inner_weight_as(trellis, K: float, codebook: str, dtype: torch.dtype) -> torch.Tensor:
    """W_hat in float16, or rounded once to bfloat16."""
    w = inner_weight(trellis, K, codebook)
    return w if dtype == torch.float16 else to_bf16(w)


@functools.cache
def hadamard() -> np.ndarray:
    """H128 / sqrt(128) in float64: (-1)^popcount(i & j), natural order."""
    i = np.arange(128)
    pop = np.vectorize(lambda v: bin(int(v)).count("1"))(i[:, None] & i[None, :])
    return np.where(pop % 2, -1.0, 1.0) / math.sqrt(128)


def _blocks(a: np.ndarray, axis: int) -> np.ndarray:
    """Block-diagonal H (128 x 128 blocks) applied along `axis` of a 2-D array (H is symmetric)."""
    h = hadamard()
    if axis == 0:
        return (h @ a.reshape(-1, 128, a.shape[1])).reshape(a.shape)
    return (a.reshape(a.shape[0], -1, 128) @ h).reshape(a.shape)


def weight(trellis, suh, svh, K: float, codebook: str) -> np.ndarray:
    """Spec section 4: W = diag(suh) Hk W_hat Hn diag(svh), float64 [k, n]."""
    w = inner_weight(trellis, K, codebook).double().numpy()
    w = _blocks(_blocks(w, 0), 1)
    return suh.double().numpy()[:, None] * w * svh.double().numpy()[None, :]


def linear(x, trellis, suh, svh, K: float, codebook: str, bias=None) -> torch.Tensor:
    """y = x @ W + bias in float64 [..., n] (x of any float dtype, taken exactly)."""
    y = x.double().numpy() @ weight(trellis, suh, svh, K, codebook)
    if bias is not None:
        y = y + bias.double().numpy()
    return torch.from_numpy(y)
