"""Fuzz: the stacked MoE layout (twinspark.moe_layout: empty/plan, set_matrix, from_layers).

Rates, dimensions, codebooks and expert indices come from a checkpoint's shapes and config.json. Accepted input must
be valid by the format (exl3-format.md: K in 1..8 or 1.5/2.5/3.5, half rates only with mul1, dimensions positive
multiples of 128, finite scales) and give the layout it describes; anything else ends in MoeLayoutError."""

from __future__ import annotations

import torch
from fuzzkit import JSON, NUMBERS, fuzz, outcome, some_replaced
from hypothesis import given
from hypothesis import strategies as st
from twinspark import moe_layout as ml
from twinspark.exl3 import random_layer
from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import Exl3Layer

READER = "MoE layout"
RATES = ref.WHOLE_RATES + ref.HALF_RATES
K_VALUES = st.one_of(st.sampled_from(RATES), st.sampled_from([0, 9, 2.25, 0.5, float("nan"), float("inf"), "3", None,
                                                              True]), NUMBERS)
ROWS = st.one_of(st.lists(K_VALUES, min_size=3, max_size=3), st.lists(st.sampled_from(RATES), min_size=3, max_size=3),
                 st.lists(K_VALUES, max_size=4).map(tuple), JSON)
# a valid layout of two dimensions in the millions is allocated (zero-filled): junk dimensions stay small or
# beyond the limit
DIMS = st.one_of(st.sampled_from([128, 256]),
                 st.sampled_from([0, 64, 130, -128, 128.0, True, None, "128", 2**63, ml.MAX_DIM + 128]),
                 NUMBERS.filter(lambda d: not (type(d) is int and 4096 < d <= ml.MAX_DIM)))
CODEBOOKS = st.one_of(st.sampled_from(ref.CODEBOOKS), st.sampled_from(["MUL1", "", None, 1]), JSON)
FIRST = st.one_of(st.sampled_from([0, 3]), st.sampled_from([-1, 1.5, None, True, "0"]))


def _is_rate(K) -> bool:
    return type(K) in (int, float) and K in RATES


def _valid(rates, hidden, inter, codebook, first) -> bool:
    """The layout's contract, stated independently of the code."""
    dims = all(type(d) is int and 0 < d <= ml.MAX_DIM and d % 128 == 0 for d in (hidden, inter))
    rows = isinstance(rates, list) and rates and all(isinstance(r, (list, tuple)) and len(r) == 3 and all(
        _is_rate(K) for K in r) for r in rates)
    cb = isinstance(codebook, str) and codebook in ref.CODEBOOKS
    half = rows and any(float(K) in ref.HALF_RATES for r in rates for K in r)
    return bool(dims and rows and cb and type(first) is int and first >= 0 and (not half or codebook == "mul1"))


VALID_ARGS = st.fixed_dictionaries({
    "rates": st.lists(st.lists(st.sampled_from(RATES), min_size=3, max_size=3), min_size=1, max_size=3),
    "hidden": st.sampled_from([128, 256]), "inter": st.sampled_from([128, 256]),
    "codebook": st.sampled_from(["mul1", "mul1", "mcg", "3inst"]), "first": st.sampled_from([0, 3])})
JUNK_ARGS = {"rates": st.one_of(st.lists(ROWS, max_size=3), JSON), "hidden": DIMS, "inter": DIMS,
             "codebook": CODEBOOKS, "first": FIRST}


@fuzz(1000)
@given(args=some_replaced(VALID_ARGS, JUNK_ARGS, 2))
def test_empty_layout(args):
    rates, hidden, inter, codebook, first = (args[k] for k in ("rates", "hidden", "inter", "codebook", "first"))
    def expect(ex):
        if not _valid(rates, hidden, inter, codebook, first):
            return "an invalid layout was built"
        words = [[ref.words_per_tile(float(K)) for K in r] for r in rates]
        got = (ex.words.tolist(), tuple(ex.suh13.shape), tuple(ex.svh2.shape), ex.codebook, ex.first_expert)
        want = (words, (len(rates), 2, hidden), (len(rates), hidden), codebook, first)
        return None if got == want else f"{got} instead of {want}"

    outcome(READER, lambda: ml.empty(rates, hidden, inter, codebook, first), ml.MoeLayoutError, expect,
            valid=_valid(rates, hidden, inter, codebook, first))


EXPERTS = [(3, 3, 3), (2, 2, 2.5)]
HIDDEN, INTER = 128, 256
BAD_SCALE = st.sampled_from([None, None, None, float("nan"), float("inf"), float("-inf")])


@st.composite
def layers(draw):
    """A layer for one slot: shape, K, codebook, bias and scales drawn, sometimes valid; or not a layer at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    k, n = draw(st.sampled_from([(HIDDEN, INTER), (INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN, HIDDEN)]))
    K = draw(st.sampled_from([2, 2, 2.5, 3]))
    layer = random_layer(k, n, K, draw(st.sampled_from(["mul1", "mul1", "mcg"])), bias=draw(st.booleans()),
                         generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if draw(st.booleans()):
        layer = Exl3Layer(layer.trellis, layer.suh, layer.svh, layer.K, layer.codebook)  # no bias
    bad = draw(BAD_SCALE)
    if bad is not None:
        part = draw(st.sampled_from(["suh", "svh"]))
        getattr(layer, part)[draw(st.integers(0, k - 1)) % getattr(layer, part).numel()] = bad
    return layer


def _fits(e, proj, layer, K=None) -> bool:
    """Whether `layer` may fill slot (e, proj) of EXPERTS (K: the slot's rate; None: any, as from_layers plans it)."""
    if not (type(e) is int and 0 <= e < len(EXPERTS) and type(proj) is int and proj in (0, 1, 2)):
        return False
    if not isinstance(layer, Exl3Layer):
        return False
    k, n = ml.matrix_shape(proj, HIDDEN, INTER)
    return ((layer.k, layer.n) == (k, n) and layer.K == (EXPERTS[e][proj] if K is None else K)
            and layer.codebook == "mul1" and layer.bias is None
            and bool(torch.isfinite(layer.suh).all() and torch.isfinite(layer.svh).all()))


@fuzz(800)
@given(e=st.one_of(st.integers(0, 1), st.integers(-2, 3), NUMBERS), proj=st.one_of(st.integers(0, 2), NUMBERS),
       layer=layers(), how=st.sampled_from(["set_matrix", "from_layers"]))
def test_filling_experts(e, proj, layer, how):
    ex = ml.empty(EXPERTS, HIDDEN, INTER, "mul1")
    if how == "set_matrix":
        call = lambda: ml.set_matrix(ex, e, proj, layer) or ex  # noqa: E731
        fits = _fits(e, proj, layer)
        slot = (e, proj)
    else:  # one expert of rates (2, 2, 2.5): the drawn layer as its gate (e, proj unused)
        others = [random_layer(HIDDEN, INTER, 2), random_layer(INTER, HIDDEN, 2.5)]
        call = lambda: ml.from_layers([(layer, *others)])  # noqa: E731
        fits = _fits(0, 0, layer, K=getattr(layer, "K", None))
        slot = (0, 0)

    def expect(got):
        if not fits:
            return "a matrix that does not fit its slot was copied in"
        view = got.layer(*slot)
        same = all(torch.equal(getattr(view, p), getattr(layer, p)) for p in ("trellis", "suh", "svh"))
        return None if same else "the slot does not hold the layer"

    outcome(READER, call, ml.MoeLayoutError, expect, valid=fits)
