"""Fuzz: Engram pack files (read_pack_header, EngramStore.from_pack), the row store's options (EngramStore) and
the layout/index files (EngramLayout.from_config, locate with model.safetensors.index.json).

Accepted input must read as the valid one: a pack's header, and rows equal to the file's bytes (a flipped bit in
row data or in the header's zero padding is a valid pack by design); a config's head sizes as written; the layer's
tensors where the shards hold them. A pack header rewritten with a valid checksum may describe another layer or
range: with ``expect=`` it must be refused; without, the reader checks what a file alone can tell (size, and the
layer and the rank's first/last row its name gives) and a header that passes is a valid pack for another request,
counted apart ("accepted-other")."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from fuzzkit import JSON, NUMBERS, OTHER_VALID, SPECIALS, byte_mutations, equal_or, fuzz, outcome
from hypothesis import given
from hypothesis import strategies as st
from twinspark.engram import (
    EngramError,
    EngramLayout,
    EngramStore,
    PackHeader,
    RowRange,
    locate,
    pack,
    pack_name,
    read_pack_header,
    write_synthetic_checkpoint,
)
from twinspark.engram.pack import HEADER_BYTES
from twinspark.engram.source import INDEX_NAME, RECORD_BYTES

HEADS = {1: [5, 7, 11, 13], 14: [2, 3, 5]}
IDS = torch.tensor([-1, 0, 11, 12, 13, 20, 35, 36, 10**9])  # layer 1, rank 1 of 2: rows 12..35


@pytest.fixture(scope="module")
def engram(tmp_path_factory):
    root = tmp_path_factory.mktemp("engram_fuzz")
    layout = write_synthetic_checkpoint(root / "ckpt", HEADS, seed=44)
    for rank in (0, 1):
        pack(root / "ckpt", root / "pack", layout, rank, 2)
    path = root / "pack" / pack_name(1, 1, 2)
    return root, path.read_bytes(), read_pack_header(path)


def _rows(raw: bytes, h: PackHeader, ids: torch.Tensor) -> np.ndarray:
    """What a lookup of `ids` must return from a pack file's bytes: row r at 4096 + (r - first) * 264, zero rows
    outside the header's range."""
    data = np.frombuffer(raw[HEADER_BYTES:], np.uint8).reshape(-1, RECORD_BYTES)
    out = np.zeros((len(ids), RECORD_BYTES), np.uint8)
    for i, r in enumerate(ids.tolist()):
        if h.first_row <= r <= h.last_row:
            out[i] = data[r - h.first_row]
    return out


def _serves(store: EngramStore, raw: bytes, h: PackHeader) -> str | None:
    w, s = store.lookup(IDS)
    got = np.concatenate([w.view(torch.uint8).numpy(), s.numpy()], axis=1)
    return None if np.array_equal(got, _rows(raw, h, IDS)) else "the rows served are not the file's rows"


# ---------------------------------------------------------------------------------------------- pack files
PACK = "Engram pack file"


@fuzz(600)
@given(data=st.data(), with_expect=st.booleans())
def test_mutated_pack_file(engram, scratch, data, with_expect):
    root, valid, header = engram
    kind, pos, raw = data.draw(byte_mutations(valid, 96), label="mutation")
    p = scratch.write(pack_name(1, 1, 2), raw)

    def read():
        store = EngramStore.from_pack(p, header if with_expect else None, threads=1)
        return store, store.header

    def expect(result):
        store, h = result
        return equal_or(h, header, "the header") or _serves(store, raw, h)

    outcome(PACK, read, EngramError, expect, names=str(p))


FIELDS = ("layer", "first_row", "last_row", "table_rows", "version", "row_bytes")
NAMES = {pack_name(*lrw): lrw for lrw in ((1, 1, 2), (1, 0, 2), (14, 1, 2))}


@fuzz(600)
@given(data=st.data(), with_expect=st.booleans(),
       name=st.sampled_from([*NAMES, "rows.tspack"]))
def test_rewritten_header_with_a_valid_checksum(engram, scratch, data, with_expect, name):
    """Another layer, a shifted or resized range, another version or row size: what a stale or misplaced pack
    looks like."""
    root, valid, header = engram
    values = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1),
                       st.sampled_from([header.first_row - 1, header.last_row + 1, header.table_rows - 1, 14]))
    changes = data.draw(st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=3), label="changes")
    h = PackHeader(**{f: changes.get(f, getattr(header, f)) for f in FIELDS})
    p = scratch.write(name, h.encode() + valid[HEADER_BYTES:])

    def expect(result):
        if with_expect:
            return equal_or(result, header, "the header")
        if result == header:
            return None
        layer, rank, world = NAMES.get(name, (None, None, None))
        if layer is not None and (result.layer != layer or (rank == 0) != (result.first_row == 0) or (
                rank == world - 1) != (result.last_row == result.table_rows - 1)):
            return f"{result} does not fit its name {name}"
        if result.file_bytes != len(valid):
            return f"{result} does not fit the file's size"
        return OTHER_VALID

    outcome(PACK, lambda: read_pack_header(p, header if with_expect else None), EngramError, expect, names=str(p))


@fuzz(20)
@given(kind=SPECIALS)
def test_pack_path_not_a_regular_file(engram, scratch, kind):
    p = scratch.special(pack_name(1, 1, 2), kind)
    outcome(PACK, lambda: read_pack_header(p), EngramError, lambda h: "a header from no file", names=str(p))


def test_packing_over_a_directory_or_fifo_is_refused(engram, scratch):
    root, _, _ = engram
    layout = EngramLayout.from_config(root / "ckpt" / "config.json")
    for kind in ("directory", "fifo"):
        scratch.special(pack_name(1, 0, 2), kind)
        outcome(PACK, lambda: pack(root / "ckpt", scratch.root, layout, 0, 2, layers=[1]), EngramError,
                lambda r: "packed over a non-file")
        scratch.special(pack_name(1, 0, 2), "missing")
        scratch.special(pack_name(1, 0, 2) + ".partial", kind)
        outcome(PACK, lambda: pack(root / "ckpt", scratch.root, layout, 0, 2, layers=[1]), EngramError,
                lambda r: "packed over a non-file")
        scratch.special(pack_name(1, 0, 2) + ".partial", "missing")


# ---------------------------------------------------------------------------------------------- row store
STORE = "Engram row store"
RAM_GIB = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
# valid thread counts and depths kept small: a store allocates 8 KiB per read in flight per thread up front
SMALL_INTS = st.sampled_from([1, 2, 3])
NOT_COUNTS = NUMBERS.filter(lambda v: not (type(v) is int and 4 <= v <= 1024))
OPTIONS = {
    "threads": st.one_of(SMALL_INTS, NOT_COUNTS, st.sampled_from([0, 1025, -1, 2.0, "2", None, True])),
    "queue_depth": st.one_of(SMALL_INTS, NOT_COUNTS, st.sampled_from([0, 1025, 4.5, "8", None])),
    # a valid cache of c GiB fills c * 3% of tags at once: valid sizes stay small here, RAM_GIB at most is checked
    "cache_gib": st.one_of(st.sampled_from([0, 0.0, 0.001, 1e-9, float("inf"), float("nan"), -1.0, 1e6, RAM_GIB * 2,
                                            None, "1", True]),
                           NUMBERS.filter(lambda v: not (type(v) in (int, float) and 0.01 < v <= RAM_GIB))),
    "io_mode": st.one_of(st.sampled_from(["auto", "direct", "buffered", "fast", "", None, 1]), JSON),
    "io_engine": st.one_of(st.sampled_from(["auto", "io_uring", "aio", "pread", "spdk", None]), JSON),
}


def _option_ok(name, v) -> bool:
    """The documented domain of each option (an independent statement of the contract)."""
    if name in ("threads", "queue_depth"):
        return type(v) is int and 1 <= v <= 1024
    if name == "cache_gib":
        return type(v) in (int, float) and v == v and 0 <= v <= RAM_GIB
    return isinstance(v, str) and v in {"io_mode": ("auto", "direct", "buffered"),
                                        "io_engine": ("auto", "io_uring", "aio", "pread")}[name]


@fuzz(400)
@given(options=st.fixed_dictionaries({}, optional=OPTIONS), source=st.sampled_from(["pack", "checkpoint"]),
       rows=st.one_of(st.none(), st.tuples(st.integers(-3, 40), st.integers(-3, 40)), JSON,
                      st.just(RowRange(1, 12, 36, 2, 4))))
def test_store_options(engram, options, source, rows):
    root, valid, header = engram
    options.setdefault("threads", 1)
    if source == "pack":
        call = lambda: EngramStore.from_pack(root / "pack" / pack_name(1, 1, 2), **options)  # noqa: E731
    else:
        call = lambda: EngramStore.from_checkpoint(root / "ckpt", 1, rows, **options)  # noqa: E731

    def expect(store):
        bad = [k for k, v in options.items() if not _option_ok(k, v)]
        if bad:
            return f"option {bad[0]}={options[bad[0]]!r} was accepted"
        if source == "pack":
            return _serves(store, valid, header)
        first, end = (0, 36) if rows is None else (rows.first_row, rows.end_row) if isinstance(rows, RowRange) \
            else rows
        if (store.first_row, store.end_row) != (first, end):
            return f"rows [{store.first_row}, {store.end_row}) instead of [{first}, {end})"
        h = PackHeader(1, 12, 35, 36)  # rows 12..35 are what the rank-1 pack holds: compare those
        w, s = store.lookup(IDS[(IDS >= max(first, 12)) & (IDS < min(end, 36))])
        want = _rows(valid, h, IDS[(IDS >= max(first, 12)) & (IDS < min(end, 36))])
        return None if np.array_equal(np.concatenate([w.view(torch.uint8).numpy(), s.numpy()], 1), want) else \
            "the rows served are not the shard's rows"

    outcome(STORE, call, EngramError, expect)


# ----------------------------------------------------------------------------------------- layout and index
LAYOUT = "Engram layout/index"


def _intended(doc) -> dict | None:
    """Head sizes a config means, or None when it means none (the contract, stated independently)."""
    if not isinstance(doc, dict):
        return None
    sizes = doc.get("engram_head_sizes")
    if sizes is None and isinstance(doc.get("engram"), dict):
        sizes = doc["engram"].get("engram_head_sizes", doc["engram"].get("head_sizes"))
    if not isinstance(sizes, dict) or not sizes:
        return None
    out = {}
    for k, v in sizes.items():
        if not (k.isascii() and k.isdigit()) or int(k) in out or not isinstance(v, list) or not v:
            return None
        if not all(type(x) is int and x > 0 for x in v):
            return None
        out[int(k)] = tuple(v)
    return out


SIZES = st.one_of(st.lists(st.integers(1, 50), min_size=1, max_size=4), st.lists(NUMBERS, max_size=3), JSON)
DOCS = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(["1", "14", "2", "007"]), st.lists(st.integers(1, 10**9), min_size=1, max_size=5),
                    min_size=1, max_size=3).map(lambda s: {"engram_head_sizes": s, "hidden_size": 7}),
    st.dictionaries(st.one_of(st.sampled_from(["1", "14", "01", "-1", "x", "", "١", " 2", "1_0"]), st.text(max_size=3)),
                    SIZES, max_size=3).map(lambda s: {"engram_head_sizes": s}),
    st.dictionaries(st.sampled_from(["1", "14"]), SIZES, max_size=2).map(lambda s: {"engram": {"head_sizes": s}}),
)


@fuzz(800)
@given(doc=DOCS, form=st.sampled_from(["json", "json", "bytes", "special"]), raw=st.binary(max_size=40),
       kind=SPECIALS)
def test_layout_config(scratch, doc, form, raw, kind):
    if form == "json":
        p = scratch.write("config.json", json.dumps(doc))
    elif form == "bytes":
        p = scratch.write("config.json", raw)
    else:
        p = scratch.special("config.json", kind)

    def expect(layout):
        if form != "json":  # bytes that happen to be a valid config (rare) must still mean what they say
            doc2 = json.loads(raw)
        else:
            doc2 = doc
        return equal_or(layout.head_sizes, _intended(doc2), "the head sizes")

    outcome(LAYOUT, lambda: EngramLayout.from_config(p), EngramError, expect, names=str(p),
            valid=form == "json" and _intended(doc) is not None)


WEIGHT_MAPS = st.one_of(
    JSON,
    st.fixed_dictionaries({}, optional={
        "layers.1.engram.embed.weight": st.one_of(st.sampled_from(["model-00047-of-00048.safetensors",
                                                                   "model-00048-of-00048.safetensors", "../ckpt",
                                                                   "", ".", "/etc/passwd", "missing.safetensors"]),
                                                  JSON),
        "layers.1.engram.embed.scale": st.one_of(st.sampled_from(["model-00047-of-00048.safetensors",
                                                                  "model-00048-of-00048.safetensors"]), JSON)}),
)


@fuzz(500)
@given(weight_map=WEIGHT_MAPS, wrap=st.booleans(), raw=st.one_of(st.none(), st.binary(max_size=30)))
def test_index_file(engram, scratch, weight_map, wrap, raw):
    root, _, _ = engram
    ckpt = scratch.root / "ckpt"
    if not ckpt.exists():
        shutil.copytree(root / "ckpt", ckpt)
    valid = locate(root / "ckpt", 1)
    index = json.dumps({"weight_map": weight_map} if wrap else weight_map).encode() if raw is None else raw
    (ckpt / INDEX_NAME).write_bytes(index)

    def expect(t):
        return equal_or((t.weight.start, t.weight.shape, t.scale.start, t.scale.shape, t.weight.path.name,
                         t.scale.path.name),
                        (valid.weight.start, valid.weight.shape, valid.scale.start, valid.scale.shape,
                         valid.weight.path.name, valid.scale.path.name), "the layer's tensors")

    outcome(LAYOUT, lambda: locate(ckpt, 1), EngramError, expect)


@fuzz(25)
@given(kind=SPECIALS)
def test_index_not_a_regular_file(engram, scratch, kind):
    root, _, _ = engram
    ckpt = scratch.root / "ckpt"
    if not ckpt.exists():
        shutil.copytree(root / "ckpt", ckpt)
    scratch.special(f"ckpt/{INDEX_NAME}", kind)
    valid = locate(root / "ckpt", 1)
    outcome(LAYOUT, lambda: locate(ckpt, 1), EngramError,
            lambda t: equal_or(t.weight.start, valid.weight.start, "the weight's offset"))

