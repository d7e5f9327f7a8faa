"""Fuzz: EXL3 layers (twinspark.exl3.format.read_layer / validate_layer).

Accepted input must give the valid layer as far as the format can tell: same K and shapes, tensors holding exactly
what the safetensors library reads (a flipped bit inside trellis or scale data is a valid layer by design, NaN/inf
scales are not), the codebook and bias its tensor names say."""

from __future__ import annotations

import struct

import torch
from fuzzkit import SPECIALS, byte_mutations, fuzz, outcome
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save
from twinspark.exl3 import Exl3FormatError, random_layer, read_layer, validate_layer
from twinspark.exl3 import reference as ref
from twinspark.exl3.format import MARKERS, layer_tensors

READER = "EXL3 layer"
WORDS = {ref.words_per_tile(K) for K in ref.WHOLE_RATES + ref.HALF_RATES}
P = "model.layers.0.mlp.down_proj"
LAYER = random_layer(256, 128, 3, "mul1", bias=True, generator=torch.Generator().manual_seed(44))
TENSORS = layer_tensors(LAYER, P)
VALID = save(TENSORS)
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


def _as_the_library_reads(layer, path) -> str | None:
    """None when `layer` holds what the safetensors library reads from the file under the layer's names. A flipped
    bit may rename a tensor (names are free text): the bias then is absent, a renamed marker leaves a valid 3inst
    layer; the format cannot tell (the plugin checks the codebook against config.json)."""
    with safe_open(str(path), "pt") as f:
        lib = {s: f.get_tensor(f"{P}.{s}") for s in ("trellis", "suh", "svh", "bias", "mul1", "mcg")
               if f"{P}.{s}" in f.keys()}
    codebook = "mul1" if "mul1" in lib else "mcg" if "mcg" in lib else "3inst"
    want = (LAYER.K, codebook, LAYER.k, LAYER.n, "bias" not in lib)
    got = (layer.K, layer.codebook, layer.k, layer.n, layer.bias is None)
    if got != want:
        return f"K/codebook/k/n/no-bias {got} instead of {want}"
    for part in ("trellis", "suh", "svh", "bias"):
        if part in lib and not torch.equal(getattr(layer, part).view(torch.uint8), lib[part].view(torch.uint8)):
            return f"{part} is not what the file holds"
    return None


@fuzz(1000)
@given(mutation=byte_mutations(VALID, HEADER_END))
def test_mutated_valid_file(scratch, mutation):
    kind, pos, raw = mutation
    p = scratch.write("model.safetensors", raw)
    outcome(READER, lambda: read_layer(p, P), Exl3FormatError, lambda layer: _as_the_library_reads(layer, p))


def _nonfinite(t: torch.Tensor, at: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[at % t.numel()] = value
    return t


# (name, mutate(tensors, draw) -> tensors): every one makes a layer the format forbids
def _edits():
    bad = st.sampled_from([float("nan"), float("inf"), float("-inf")])
    dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.int32, torch.int64, torch.uint8,
                              torch.float16, torch.int8])
    part = st.sampled_from(["trellis", "suh", "svh", "bias", "mul1"])

    def nonfinite(t, d):
        name = d.draw(st.sampled_from(["suh", "svh", "bias"]))
        t[f"{P}.{name}"] = _nonfinite(t[f"{P}.{name}"], d.draw(st.integers(0, 1000)), d.draw(bad))

    def dtype(t, d):
        name, dt = d.draw(part), d.draw(dtypes)
        if t[f"{P}.{name}"].dtype == dt:
            dt = torch.float64
        t[f"{P}.{name}"] = t[f"{P}.{name}"].to(dt)

    def shape(t, d):
        name = d.draw(part)
        dims = d.draw(st.lists(st.integers(0, 20), min_size=0, max_size=4))
        if name == "trellis" and dims[:2] == [16, 8] and len(dims) == 3 and dims[2] in WORDS:
            dims[2] += 1  # [16, 8, 16*K] is a valid layer of another rate, not a malformed one
        old = t[f"{P}.{name}"]
        new = torch.zeros(dims, dtype=old.dtype)
        if tuple(new.shape) == tuple(old.shape):
            new = torch.zeros(*dims, 1, dtype=old.dtype)
        t[f"{P}.{name}"] = new

    def missing(t, d):
        del t[f"{P}.{d.draw(st.sampled_from(['trellis', 'suh', 'svh']))}"]

    def marker(t, d):
        value = d.draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != MARKERS["mul1"]))
        t[f"{P}.mul1"] = torch.tensor(value, dtype=torch.int32)

    def both_markers(t, d):
        t[f"{P}.mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)

    def half_rate_without_mul1(t, d):
        t[f"{P}.trellis"] = torch.zeros(16, 8, 40, dtype=torch.int16)  # K=2.5
        del t[f"{P}.mul1"]
        if d.draw(st.booleans()):
            t[f"{P}.mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)

    def rate(t, d):
        words = d.draw(st.integers(0, 200).filter(lambda w: w not in WORDS))
        t[f"{P}.trellis"] = torch.zeros(16, 8, words, dtype=torch.int16)

    def legacy_signs(t, d):  # su in place of suh, of the wrong length or dtype (k = 256: 16 int16 words)
        del t[f"{P}.suh"]
        dtype = d.draw(st.sampled_from([torch.int16, torch.int32]))
        n = d.draw(st.integers(0, 40).filter(lambda n: (n, dtype) != (16, torch.int16)))
        t[f"{P}.su"] = torch.zeros(n, dtype=dtype)

    return [nonfinite, dtype, shape, missing, marker, both_markers, half_rate_without_mul1, rate, legacy_signs]


EDITS = _edits()


@fuzz(800)
@given(data=st.data(), edit=st.sampled_from(EDITS), through=st.sampled_from(["file", "tensors"]))
def test_layers_the_format_forbids(scratch, data, edit, through):
    t = dict(TENSORS)
    edit(t, data)
    if through == "file":
        p = scratch.write("model.safetensors", save(t))
        call = lambda: read_layer(p, P)  # noqa: E731
    else:
        call = lambda: validate_layer(t, P)  # noqa: E731
    outcome(READER, call, Exl3FormatError, lambda layer: f"a layer with edit {edit.__name__} was accepted")


@fuzz(20)
@given(kind=SPECIALS)
def test_not_a_regular_file(scratch, kind):
    p = scratch.special("model.safetensors", kind)
    outcome(READER, lambda: read_layer(p, P), Exl3FormatError, lambda layer: "a layer from no file")
