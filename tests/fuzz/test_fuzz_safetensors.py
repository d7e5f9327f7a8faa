"""Fuzz: safetensors headers (twinspark.safetensors_io.read_header / index_tensors).

Accepted input must describe the file as the safetensors library reads it (same names, dtypes, shapes), and a
mutated copy of a valid file may differ from it only where the format cannot tell: bytes inside tensor data,
metadata text, tensor names."""

from __future__ import annotations

import json
import struct

import torch
from fuzzkit import JSON, SPECIALS, byte_mutations, equal_or, fuzz, outcome
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save
from twinspark.safetensors_io import DTYPE_BYTES, SafetensorsError, index_tensors, read_header

READER = "safetensors header"
TENSORS = {"model.a.weight": torch.arange(24, dtype=torch.float16).reshape(4, 6),
           "model.b.bias": torch.arange(5, dtype=torch.int32), "model.c.scale": torch.ones(3, 2, dtype=torch.bfloat16),
           "model.d.marker": torch.tensor(7, dtype=torch.int64), "model.e.empty": torch.zeros(0, 4, dtype=torch.uint8)}


def _raw(header, data: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _library_view(path) -> dict | str:
    """name -> (dtype, shape) as the safetensors library reads the file, or why it refuses it."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any refusal by the library is the answer here
        return f"the safetensors library refuses it ({exc})"


def _agrees_with_library(result, path) -> str | None:
    lib = _library_view(path)
    if isinstance(lib, str):
        return lib
    return equal_or({k: (t.dtype, t.shape) for k, t in result.items()}, lib, "name -> (dtype, shape)")


def _signature(result) -> list:
    """What the bytes of a file pin down: a tensor of no elements has no bytes, so its dimensions are free."""
    return sorted((t.dtype, t.shape if t.nbytes else "no elements", t.start, t.end) for t in result.values())


VALID = save(TENSORS, metadata={"format": "pt"})
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


@fuzz(1000)
@given(mutation=byte_mutations(VALID, HEADER_END))
def test_mutated_valid_file(scratch, mutation):
    kind, pos, raw = mutation
    p = scratch.write("m.safetensors", raw)
    want = _signature(read_header(scratch.write("valid.safetensors", VALID)))

    def expect(result):
        return equal_or(_signature(result), want, "dtypes/shapes/offsets") or _agrees_with_library(result, p)

    outcome(READER, lambda: read_header(p), SafetensorsError, expect, names=str(p))


ENTRY = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BYTES)), st.sampled_from(["F99", "f16", "", "C64"]), JSON),
    "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), st.lists(st.floats(0, 4), max_size=2), JSON),
    "data_offsets": st.one_of(st.lists(st.integers(-8, 160), min_size=2, max_size=2), JSON),
})
HEADERS = st.one_of(JSON, st.dictionaries(st.text(max_size=6), st.one_of(ENTRY, JSON), max_size=4),
                    st.dictionaries(st.text(max_size=6), ENTRY, min_size=1, max_size=4))


@st.composite
def consistent_header(draw):
    """A valid header: known dtypes, shapes of integers >= 0, ranges back to back, and the data they cover."""
    names = draw(st.lists(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"), min_size=0,
                          max_size=4, unique=True))
    header, at = {}, 0
    for n in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        header[n] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2))
    return header, at


@fuzz(1000)
@given(case=st.one_of(st.tuples(HEADERS, st.integers(0, 200)).map(lambda hd: (hd[0], hd[1], False)),
                      consistent_header().map(lambda ha: (ha[0], ha[1], True))))
def test_random_json_headers(scratch, case):
    header, data_len, valid = case
    p = scratch.write("h.safetensors", _raw(header, bytes(data_len)))

    def expect(result):
        if valid:
            base = 8 + len(json.dumps(header).encode())
            want = {k: (v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
                    for k, v in header.items() if k != "__metadata__"}
            got = {k: (t.dtype, t.shape, t.start, t.end) for k, t in result.items()}
            return equal_or(got, want, "the tensors") or _agrees_with_library(result, p)
        return _agrees_with_library(result, p)

    if valid:  # a valid header must be read as it is, never refused
        assert _library_view(p) == {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()
                                    if k != "__metadata__"}
    outcome(READER, lambda: read_header(p), SafetensorsError, expect, names=str(p), valid=valid)


HOSTILE = st.one_of(
    st.binary(max_size=120),
    st.sampled_from([b"[" * 50_000, b"{\"a\":" * 20_000, b"\xff\xfe{}", b"NaN", b"{\"a\": NaN}", b"null", b"[]",
                     b"{\"a\": {\"dtype\": \"F16\", \"shape\": [1e400], \"data_offsets\": [0, 2]}}",
                     b"{\"a\": {\"dtype\": \"F16\", \"shape\": [" + b"9" * 4000 + b"], \"data_offsets\": [0, 2]}}",
                     b"{\"a\": {\"dtype\": \"F16\", \"shape\": [true], \"data_offsets\": [0, 2]}}",
                     b"{\"__metadata__\": {\"k\": 1}}", b"{\"__metadata__\": []}"]),
)


@fuzz(400)
@given(head=HOSTILE, length=st.one_of(st.none(), st.integers(0, 2**64 - 1)), data_len=st.integers(0, 16))
def test_hostile_header_bytes(scratch, head, length, data_len):
    raw = _raw(head, bytes(data_len))
    if length is not None:  # a length field that lies
        raw = struct.pack("<Q", length) + raw[8:]
    p = scratch.write("x.safetensors", raw)
    outcome(READER, lambda: read_header(p), SafetensorsError, lambda r: _agrees_with_library(r, p), names=str(p))


@fuzz(25)
@given(kind=SPECIALS, through=st.sampled_from(["file", "folder"]))
def test_not_a_regular_file(scratch, kind, through):
    p = scratch.special("model-00001-of-00001.safetensors", kind)
    call = (lambda: read_header(p)) if through == "file" else (lambda: index_tensors(scratch.root))
    outcome(READER, call, SafetensorsError, lambda r: equal_or(r, {}, "an empty folder's tensors"))
