"""Safetensors headers without reading tensor data: the byte ranges of every tensor, with a check that the file
really holds them (a truncated download is named, not discovered as garbage later)."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from twinspark.checks import is_int
from twinspark.fileio import open_regular, parse_json

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file that cannot be used as it is (one sentence: which file, what is wrong, what to do)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for one .safetensors file (metadata entry skipped). The header is checked as
    the safetensors library checks it: known dtypes, shapes of non-negative integers, each tensor's byte range
    as long as its shape says, the ranges back to back from the start of the data to the end of the file."""
    p = Path(path)
    try:
        with open_regular(p) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{p} is not a safetensors file (shorter than 8 bytes); re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER or 8 + hlen > size:
                raise SafetensorsError(f"{p} is truncated or not a safetensors file (header length {hlen}, "
                                       f"file size {size}); re-download it")
            raw = f.read(hlen)
    except OSError as exc:
        raise SafetensorsError(f"cannot read {p}: {exc.strerror}; pass a .safetensors file or its folder") from None
    try:
        meta = parse_json(raw)
    except ValueError as exc:
        raise SafetensorsError(f"{p} has a corrupt safetensors header (not JSON: {exc}); re-download it") from None
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{p} has a corrupt safetensors header (a JSON {type(meta).__name__}, not an "
                               "object); re-download it")
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise SafetensorsError(f"{p} has a corrupt safetensors header (__metadata__ must map names to "
                                       "strings); re-download it")
            continue
        out[name] = _tensor_info(p, name, info, base)
    at = base  # the tensors must tile the data region: no overlap, no gap, nothing after the last one
    for ti in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if ti.end > size:
            raise SafetensorsError(f"tensor {_show(ti.name)} in {p} is truncated (needs bytes up to {_show(ti.end)}, the "
                                   f"file has {size}); re-download the shard")
        if ti.start != at:
            what = "overlaps the tensor before it" if ti.start < at else f"leaves {ti.start - at} bytes unused"
            raise SafetensorsError(f"tensor {_show(ti.name)} in {p} {what} (data_offsets start at "
                                   f"{_show(ti.start - base)}, expected {at - base}); the header is corrupt, re-download "
                                   "the shard")
        at = ti.end
    if at != size:
        raise SafetensorsError(f"{p} has {size - at} bytes after its last tensor (the header describes "
                               f"{at} of {size} bytes); the header is corrupt, re-download the shard")
    return out


def _show(x) -> str:
    """A header value for a message: repr, clipped (a corrupt header can hold anything)."""
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _tensor_info(p: Path, name: str, info, base: int) -> TensorInfo:
    """One header entry, checked: {"dtype": known name, "shape": [ints >= 0], "data_offsets": [begin, end]}."""
    bad = lambda what: SafetensorsError(f"tensor {_show(name)} in {p} {what}; the header is corrupt, "  # noqa: E731
                                        "re-download the shard")
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad("is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise bad(f"has dtype {_show(dtype)}, not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"has shape {_show(shape)}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise bad(f"has data_offsets {_show(offsets)}, not two non-negative integers")
    begin, finish = offsets
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if finish - begin != want:
        raise bad(f"has data_offsets {_show(offsets)}, but {dtype} {_show(shape)} takes {_show(want)} bytes")
    return TensorInfo(name, dtype, tuple(shape), base + begin, base + finish, p)


def _count(x) -> bool:
    return is_int(x) and x >= 0


def shard_files(source: str | os.PathLike | list) -> list[Path]:
    """A file, a list of files, or a directory (its *.safetensors files) -> the shard paths."""
    if isinstance(source, (list, tuple)):
        return [Path(s) for s in source]
    p = Path(source)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"no .safetensors files in {p}")
        return files
    if not p.exists():
        raise SafetensorsError(f"{p} does not exist")
    return [p]


def index_tensors(source) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint (file, files or directory), from headers only."""
    out: dict[str, TensorInfo] = {}
    for f in shard_files(source):
        out.update(read_header(f))
    return out
