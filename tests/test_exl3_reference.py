"""The EXL3 reference against the spec (exl3-format.md): codebook tables by SHA-256, the spec decoder of
tests/exl3_spec.py (written straight from the spec text; its scalar and array forms checked against each other and
against the spec's table hashes), pack/unpack round trips for every rate, weight vs linear."""

from __future__ import annotations

import hashlib

import exl3_spec as spec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from twinspark.exl3 import reference as ref

SPEC_TABLES = {
    "3inst": ("ad88de2dcff5bb05fff2faec37cceceb43aa1c2e8203f9d81a6fbd6dd3393eea", 1.243711, (0.76806640625, -0.91943359375)),
    "mcg": ("95383563929baa9d1ae5de0be22490284382673620bdd85929feea7bdbef04a9", 1.244112, (1.84375, 0.134521484375)),
    "mul1": ("bc48d02cb1c14939dc47b90f870dd689d63e3b1ab69a157e65538db68677a6c8", 1.000312, (-3.453125, 0.64111328125)),
}
ALL_RATES = list(ref.WHOLE_RATES) + list(ref.HALF_RATES)


@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
def test_codebook_table_matches_spec(codebook):
    sha, rms, first = SPEC_TABLES[codebook]
    table = ref.codebook_table(codebook)
    raw = table.view(torch.int16).numpy().astype("<i2").tobytes()
    assert hashlib.sha256(raw).hexdigest() == sha
    assert table.float().pow(2).mean().sqrt().item() == pytest.approx(rms, abs=1e-6)
    assert tuple(table[:2].tolist()) == first


# half rates exist only with mul1 (spec section 1)
VALID_PAIRS = [(cb, K) for cb in ref.CODEBOOKS for K in ALL_RATES if cb == "mul1" or K in ref.WHOLE_RATES]


@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
def test_spec_table_matches_spec_hashes(codebook):
    """The spec decoder's own table (scalar decode of every state) has the hash the spec publishes."""
    sha, _, first = SPEC_TABLES[codebook]
    bits = spec.codebook_bits(codebook)
    assert hashlib.sha256(bits.astype("<u2").tobytes()).hexdigest() == sha
    assert tuple(bits[:2].view(np.float16).tolist()) == first


@pytest.mark.parametrize(("codebook", "K"), VALID_PAIRS)
def test_inner_weight_matches_scalar_spec(codebook, K, gen):
    w = ref.words_per_tile(K)
    trellis = torch.randint(-32768, 32768, (2, 2, w), dtype=torch.int16, generator=gen)
    got = ref.inner_weight(trellis, K, codebook)
    array = spec.inner_weight(trellis, K, codebook)
    for tk in range(2):
        for tn in range(2):
            want = torch.tensor(spec.tile(trellis[tk, tn].tolist(), K, codebook), dtype=torch.float16)
            rows, cols = slice(16 * tk, 16 * tk + 16), slice(16 * tn, 16 * tn + 16)
            assert torch.equal(got[rows, cols].view(torch.int16), want.view(torch.int16)), f"tile ({tk}, {tn}) differs"
            assert torch.equal(array[rows, cols].view(torch.int16), want.view(torch.int16)), \
                f"tile ({tk}, {tn}): the array spec decoder differs from the scalar one"


def test_spec_bf16_rounding_is_nearest_even():
    """The spec side's bf16 rounding (tests/exl3_spec.py to_bf16) against float64 halfway cases and every fp16 value."""
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-10], dtype=torch.float16)
    assert spec.to_bf16(halfway).tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]  # ties to even; above a tie: up
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = every[torch.isfinite(every)]
    assert torch.equal(spec.to_bf16(every).view(torch.int16), every.to(torch.bfloat16).view(torch.int16))


def _bits_per_position(K: float) -> torch.Tensor:
    ka, half = ref.split_rate(K)
    return torch.tensor([ka + (1 if half and t % 2 else 0) for t in range(256)])


@settings(max_examples=40, deadline=None)
@given(K=st.sampled_from(ALL_RATES), seed=st.integers(0, 2**31 - 1), tiles=st.integers(1, 3))
def test_symbols_trellis_states_round_trip(K, seed, tiles):
    g = torch.Generator().manual_seed(seed)
    nb = _bits_per_position(K)
    symbols = torch.randint(0, 1 << 16, (tiles, 256), generator=g) % (1 << nb)
    trellis = ref.pack(symbols, K)
    assert trellis.dtype == torch.int16 and trellis.shape[-1] == ref.words_per_tile(K)
    states = ref.unpack(trellis, K)
    # the low bits of each state are that position's symbol, the rest the previous states' (ring: t=0 wraps)
    assert torch.equal(states & ((1 << nb) - 1), symbols)
    prev = torch.roll(states, 1, dims=-1)
    assert torch.equal(((prev << nb) | symbols) & 0xFFFF, states)
    # and the trellis -> symbols direction is the inverse
    assert torch.equal(ref.pack(states & ((1 << nb) - 1), K), trellis)


def test_rate_from_last_dim():
    for K in ALL_RATES:
        assert ref.rate_from_last_dim(ref.words_per_tile(K)) == K
    with pytest.raises(ValueError, match="matches no EXL3 rate"):
        ref.rate_from_last_dim(20)


def test_hadamard_orthonormal_symmetric():
    h = ref.hadamard_128(dtype=torch.float64)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("codebook", ref.CODEBOOKS)
def test_weight_and_linear_agree(codebook, gen):
    from twinspark.exl3 import random_layer

    layer = random_layer(256, 384, 3, codebook, bias=True, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    y_lin = ref.linear(x, layer.trellis, layer.suh, layer.svh, 3, codebook, layer.bias)
    y_w = x @ ref.weight(layer.trellis, layer.suh, layer.svh, 3, codebook) + layer.bias.float()
    assert y_lin.dtype == torch.float32 and y_lin.shape == (5, 384)
    # two fp32 association orders of the same sums: far below 1e-5 relative
    assert (y_lin - y_w).norm() / y_w.norm() < 1e-5
