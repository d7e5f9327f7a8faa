"""Reading, validating and writing EXL3 layers: round trips, and one clear sentence per malformed input."""

from __future__ import annotations

import pytest
import torch
from twinspark.exl3 import Exl3FormatError, random_layer, read_layer, validate_layer, write_layers
from twinspark.exl3.format import MARKERS, layer_tensors

P = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(("K", "codebook", "bias"), [(2, "mul1", False), (4, "mcg", True), (8, "3inst", False),
                                                     (2.5, "mul1", True), (1, "mul1", False)])
def test_round_trip(tmp_path, gen, K, codebook, bias):
    layer = random_layer(256, 128, K, codebook, bias=bias, generator=gen)
    path = write_layers(tmp_path / "m.safetensors", {P: layer})
    back = read_layer(path, P)
    assert (back.K, back.codebook, back.k, back.n) == (K, codebook, 256, 128)
    assert torch.equal(back.trellis, layer.trellis) and torch.equal(back.suh, layer.suh)
    assert torch.equal(back.svh, layer.svh)
    assert (back.bias is None) == (not bias)
    assert not list(tmp_path.glob("*.tmp")), "no temporary file may be left behind"


def test_read_from_directory_across_shards(tmp_path, gen):
    a = random_layer(128, 128, 3, generator=gen)
    b = random_layer(128, 256, 5, generator=gen)
    write_layers(tmp_path / "model-00001-of-00002.safetensors", {"x.a": a})
    write_layers(tmp_path / "model-00002-of-00002.safetensors", {"x.b": b})
    assert read_layer(tmp_path, "x.b").K == 5 and read_layer(tmp_path, "x.a").n == 128


def test_legacy_sign_scales(gen):
    layer = random_layer(128, 128, 2, generator=gen)
    t = layer_tensors(layer, P)
    del t[f"{P}.suh"], t[f"{P}.svh"]
    su_bits = torch.randint(0, 2, (128,), generator=gen)
    sv_bits = torch.randint(0, 2, (128,), generator=gen)
    pack16 = lambda bits: ((bits.reshape(-1, 16) << torch.arange(16)).sum(1)).to(torch.int32).to(torch.int16)  # noqa: E731
    t[f"{P}.su"] = pack16(su_bits.to(torch.int64))
    t[f"{P}.sv"] = pack16(sv_bits.to(torch.int64))
    got = validate_layer(t, P)
    assert torch.equal(got.suh, (1 - 2 * su_bits).half()) and torch.equal(got.svh, (1 - 2 * sv_bits).half())


def _tensors(gen, **kw):
    return layer_tensors(random_layer(128, 256, kw.pop("K", 3), kw.pop("codebook", "mul1"), bias=True,
                                      generator=gen), P)


def test_wrong_marker_value(gen):
    t = _tensors(gen)
    t[f"{P}.mul1"] = torch.tensor(12345, dtype=torch.int32)
    with pytest.raises(Exl3FormatError, match=rf"tensor {P}\.mul1 holds 0x00003039, not the mul1 marker 0x83dcd12d"):
        validate_layer(t, P)


def test_both_markers(gen):
    t = _tensors(gen)
    t[f"{P}.mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)
    with pytest.raises(Exl3FormatError, match=rf"layer {P} has both"):
        validate_layer(t, P)


@pytest.mark.parametrize(("missing", "message"), [("trellis", r"\.trellis is missing"),
                                                  ("suh", r"\.suh \(or legacy .*\.su\) is missing"),
                                                  ("svh", r"\.svh \(or legacy .*\.sv\) is missing")])
def test_missing_tensor(gen, missing, message):
    t = _tensors(gen)
    del t[f"{P}.{missing}"]
    with pytest.raises(Exl3FormatError, match=message):
        validate_layer(t, P)


@pytest.mark.parametrize(("name", "bad", "message"), [
    ("suh", torch.ones(64, dtype=torch.float16), r"\.suh has shape \[64\], expected \[128\]"),
    ("svh", torch.ones(128, dtype=torch.float16), r"\.svh has shape \[128\], expected \[256\]"),
    ("bias", torch.ones(255, dtype=torch.float16), r"\.bias has shape \[255\], expected \[256\]"),
    ("trellis", torch.zeros(8, 16, 20, dtype=torch.int16), r"\.trellis: trellis last dimension 20 matches no"),
    ("trellis", torch.zeros(8, 16, dtype=torch.int16), r"\.trellis must be 3-D"),
])
def test_shape_mismatch(gen, name, bad, message):
    t = _tensors(gen)
    t[f"{P}.{name}"] = bad
    with pytest.raises(Exl3FormatError, match=message):
        validate_layer(t, P)


@pytest.mark.parametrize(("name", "dtype"), [("trellis", torch.int32), ("suh", torch.float32),
                                             ("svh", torch.bfloat16), ("bias", torch.float32),
                                             ("mul1", torch.int64)])
def test_wrong_dtype(gen, name, dtype):
    t = _tensors(gen)
    t[f"{P}.{name}"] = t[f"{P}.{name}"].to(dtype)
    with pytest.raises(Exl3FormatError, match=rf"tensor {P}\.{name} must be"):
        validate_layer(t, P)


def test_half_rate_needs_mul1(gen):
    t = _tensors(gen, K=2.5)
    del t[f"{P}.mul1"]
    t[f"{P}.mcg"] = torch.tensor(MARKERS["mcg"], dtype=torch.int32)
    with pytest.raises(Exl3FormatError, match="half rate K=2.5, which exists only with the mul1 codebook"):
        validate_layer(t, P)


def test_truncated_file(tmp_path, gen):
    path = write_layers(tmp_path / "m.safetensors", {P: random_layer(256, 256, 4, generator=gen)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(Exl3FormatError, match=r"is truncated .*re-download the shard"):
        read_layer(path, P)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\x10\x00")
    with pytest.raises(Exl3FormatError, match="not a safetensors file"):
        read_layer(path, P)


def test_unknown_layer_name(tmp_path, gen):
    path = write_layers(tmp_path / "m.safetensors", {P: random_layer(128, 128, 2, generator=gen)})
    with pytest.raises(Exl3FormatError, match="no tensors named model.nope.*check the layer name"):
        read_layer(path, "model.nope")
