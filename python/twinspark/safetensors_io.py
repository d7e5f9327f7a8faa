"""Safetensors headers without reading tensor data: the byte ranges of every tensor, with a check that the file
really holds them (a truncated download is named, not discovered as garbage later)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

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
    """Tensor name -> TensorInfo for one .safetensors file (metadata entry skipped)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{p} is not a safetensors file (shorter than 8 bytes); re-download it")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER or 8 + hlen > size:
                raise SafetensorsError(f"{p} is truncated or not a safetensors file (header length {hlen}, "
                                       f"file size {size}); re-download it")
            raw = f.read(hlen)
    except OSError as exc:
        raise SafetensorsError(f"cannot read {p}: {exc.strerror}") from None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise SafetensorsError(f"{p} has a corrupt safetensors header (not JSON); re-download it") from None
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        begin, finish = info["data_offsets"]
        ti = TensorInfo(name, info["dtype"], tuple(info["shape"]), base + begin, base + finish, p)
        if ti.end > size:
            raise SafetensorsError(f"tensor {name} in {p} is truncated (needs bytes up to {ti.end}, the file has "
                                   f"{size}); re-download the shard")
        out[name] = ti
    return out


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
