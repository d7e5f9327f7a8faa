"""Fuzz: the plugin's EXL3 parts (twinspark.vllm_plugin.parts.Exl3Parts: one checkpoint linear arriving tensor by
tensor, cut to this rank's tensor-parallel slice).

Accepted input must give this rank's slice of the layer the checkpoint reader (exl3.format.validate_layer) reads
from the same tensors; a malformed tensor (dtype, shape, NaN/inf scale, marker), a cut off the 128-wide Hadamard
blocks or outside the layer, and a codebook other than config.json's end in Exl3FormatError."""

from __future__ import annotations

import torch
from fuzzkit import fuzz, outcome
from hypothesis import given
from hypothesis import strategies as st
from twinspark.exl3 import Exl3FormatError, random_layer, validate_layer
from twinspark.exl3.format import MARKERS, layer_tensors
from twinspark.vllm_plugin.parts import Cut, Exl3Parts

READER = "plugin EXL3 parts"
NAME = "model.layers.0.mlp.gate_proj"
K, N = 256, 256
TENSORS = {name.rsplit(".", 1)[1]: t for name, t in layer_tensors(
    random_layer(K, N, 3, "mul1", generator=torch.Generator().manual_seed(44)), NAME).items()}
GOOD_CUTS = [None, Cut(0, 128), Cut(128, 128), Cut(0, 256)]
BAD_CUTS = [Cut(64, 128), Cut(128, 256), Cut(0, 64), Cut(256, 128), Cut(0, 384)]
CUTS = st.sampled_from(GOOD_CUTS + BAD_CUTS)


def _nonfinite(t, d):
    name = d.draw(st.sampled_from([n for n in ("suh", "svh") if n in t] or ["svh"]))
    x = t.get(name, torch.ones(N)).to(torch.float16).flatten().clone()
    if x.numel():
        x[d.draw(st.integers(0, 255)) % x.numel()] = d.draw(st.sampled_from([float("nan"), float("inf"),
                                                                              float("-inf")]))
    t[name] = x


def _dtype(t, d):
    name = d.draw(st.sampled_from(sorted(t)))
    right = {"trellis": torch.int16, "su": torch.int16, "mul1": torch.int32, "mcg": torch.int32}.get(name, torch.float16)
    dt = d.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.int32, torch.int64, torch.uint8]))
    t[name] = t[name].to(dt if dt != right else torch.float64)


def _shape(t, d):
    name = d.draw(st.sampled_from([n for n in ("trellis", "suh", "svh") if n in t]))
    dims = d.draw(st.lists(st.integers(0, 20), max_size=3))
    new = torch.zeros(dims, dtype=t[name].dtype)
    t[name] = new if new.shape != t[name].shape else torch.zeros(*dims, 2, dtype=t[name].dtype)


def _marker(t, d):
    t["mul1"] = torch.tensor(d.draw(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != MARKERS["mul1"])),
                             dtype=torch.int32)


def _drop(t, d):
    del t[d.draw(st.sampled_from([n for n in ("trellis", "suh", "svh") if n in t]))]


def _both_markers(t, d):
    t["mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)


def _unknown_suffix(t, d):
    t[d.draw(st.sampled_from(["weight", "scales", "trellis2", "bias", ""]))] = torch.zeros(4)


def _half_rate_mcg(t, d):
    t["trellis"] = torch.zeros(16, 16, 40, dtype=torch.int16)  # K=2.5
    t.pop("mul1", None)
    t["mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)


MUTATIONS = [_nonfinite, _dtype, _shape, _marker, _drop, _both_markers, _unknown_suffix, _half_rate_mcg]


def _legacy_signs(t, d):
    """A valid variant: suh as packed int16 signs (su), as older checkpoints store it."""
    del t["suh"]
    t["su"] = torch.randint(-32768, 32768, (K // 16,), dtype=torch.int16,
                            generator=torch.Generator().manual_seed(d.draw(st.integers(0, 99))))


def _expected(tensors: dict, cut_k: Cut | None, cut_n: Cut | None):
    layer = validate_layer({f"{NAME}.{s}": t for s, t in tensors.items()}, NAME)
    k0, k1 = (0, K) if cut_k is None else (cut_k.start, cut_k.start + cut_k.size)
    n0, n1 = (0, N) if cut_n is None else (cut_n.start, cut_n.start + cut_n.size)
    return layer.trellis[k0 // 16:k1 // 16, n0 // 16:n1 // 16], layer.suh[k0:k1], layer.svh[n0:n1]


def _load(t: dict, order, cut_k, cut_n, codebook):
    parts = Exl3Parts(NAME, cut_k, cut_n, codebook)
    for suffix in order:
        parts.add(suffix, t[suffix])
    return parts.finish()


@fuzz(400)
@given(data=st.data(), cut_k=st.sampled_from(GOOD_CUTS), cut_n=st.sampled_from(GOOD_CUTS),
       codebook=st.sampled_from([None, "mul1"]), legacy=st.booleans())
def test_valid_parts(data, cut_k, cut_n, codebook, legacy):
    """Any arrival order, legacy sign scales, any cut on the Hadamard blocks: this rank's slice."""
    t = dict(TENSORS)
    if legacy:
        _legacy_signs(t, data)
    order = data.draw(st.permutations(sorted(t)), label="order")

    def expect(layer):
        want = _expected(t, cut_k, cut_n)
        same = all(torch.equal(g, w) for g, w in zip((layer.trellis, layer.suh, layer.svh), want))
        return None if same and (layer.K, layer.codebook) == (3.0, "mul1") else "not this rank's slice of the layer"

    outcome(READER, lambda: _load(t, order, cut_k, cut_n, codebook), Exl3FormatError, expect, valid=True)


@fuzz(800)
@given(data=st.data(), cut_k=CUTS, cut_n=CUTS, codebook=st.sampled_from([None, "mul1", "mcg", "3inst"]),
       mutations=st.lists(st.sampled_from(MUTATIONS), max_size=2), legacy=st.booleans())
def test_malformed_parts(data, cut_k, cut_n, codebook, mutations, legacy):
    """At least one defect: a malformed tensor, a cut off the blocks or outside the layer, another codebook."""
    if not mutations and cut_k not in BAD_CUTS and cut_n not in BAD_CUTS and codebook in (None, "mul1"):
        mutations = [data.draw(st.sampled_from(MUTATIONS), label="defect")]
    t = dict(TENSORS)
    if legacy:
        _legacy_signs(t, data)
    for m in mutations:
        m(t, data)
    order = data.draw(st.permutations(sorted(t)), label="order")
    outcome(READER, lambda: _load(t, order, cut_k, cut_n, codebook), Exl3FormatError,
            lambda layer: f"accepted with defects {[m.__name__ for m in mutations]}, cuts {cut_k} {cut_n}, "
                          f"codebook {codebook}")
