"""Where an Engram layer's rows are in the original checkpoint, from safetensors headers only.

Tensors ``layers.{L}.engram.embed.weight`` (F8_E4M3, [rows, 256]) and ``layers.{L}.engram.embed.scale`` (U8 or
F8_E8M0, [rows, 8]); they may sit in different shards. ``model.safetensors.index.json`` names the shards when it
is present, otherwise every ``*.safetensors`` header in the directory is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from twinspark.engram.errors import EngramError
from twinspark.fileio import read_json
from twinspark.safetensors_io import SafetensorsError, TensorInfo, read_header, shard_files

WEIGHT_BYTES = 256
SCALE_BYTES = 8
RECORD_BYTES = WEIGHT_BYTES + SCALE_BYTES
INDEX_NAME = "model.safetensors.index.json"


def weight_name(layer: int) -> str:
    return f"layers.{layer}.engram.embed.weight"


def scale_name(layer: int) -> str:
    return f"layers.{layer}.engram.embed.scale"


@dataclass(frozen=True)
class LayerTensors:
    layer: int
    weight: TensorInfo
    scale: TensorInfo

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    def extents(self) -> list[tuple[str, int, int, int, int]]:
        """(path, offset of row 0, stride, length, offset in the 264-byte record) for the C++ store."""
        return [(str(self.weight.path), self.weight.start, WEIGHT_BYTES, WEIGHT_BYTES, 0),
                (str(self.scale.path), self.scale.start, SCALE_BYTES, SCALE_BYTES, WEIGHT_BYTES)]


def locate(checkpoint: str | Path, layer: int) -> LayerTensors:
    """The two tensors of one Engram layer, checked for dtype and shape."""
    names = (weight_name(layer), scale_name(layer))
    found: dict[str, TensorInfo] = {}
    try:
        for f in _candidate_files(Path(checkpoint), names):
            header = read_header(f)
            found.update({n: header[n] for n in names if n in header})
    except SafetensorsError as exc:
        raise EngramError(str(exc)) from None
    missing = [n for n in names if n not in found]
    if missing:
        raise EngramError(f"{checkpoint} has no tensor {missing[0]}; point at the original checkpoint's shards "
                          "47 and 48 (with model.safetensors.index.json)")
    w, s = found[names[0]], found[names[1]]
    if w.dtype != "F8_E4M3" or len(w.shape) != 2 or w.shape[1] != WEIGHT_BYTES or w.shape[0] < 1:
        raise EngramError(f"{w.name} in {w.path} is {w.dtype} {list(w.shape)}, expected F8_E4M3 [rows, 256]; "
                          "this is not the original Engram checkpoint")
    if s.dtype not in ("U8", "F8_E8M0") or list(s.shape) != [w.shape[0], SCALE_BYTES]:
        raise EngramError(f"{s.name} in {s.path} is {s.dtype} {list(s.shape)}, expected U8 [{w.shape[0]}, 8]; "
                          "this is not the original Engram checkpoint")
    return LayerTensors(layer, w, s)


def _candidate_files(root: Path, names: tuple[str, ...]) -> list[Path]:
    index = root / INDEX_NAME if root.is_dir() else None
    if index is not None and index.exists():
        try:
            doc = read_json(index)
        except OSError as exc:
            raise EngramError(f"cannot read {index}: {exc.strerror}; re-download it") from None
        except ValueError as exc:
            raise EngramError(f"{index} is not valid JSON ({exc}); re-download it") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise EngramError(f"{index} has no weight_map object (tensor name -> shard file); re-download it")
        files = set()
        for n in names:
            f = weight_map.get(n)
            if f is None:
                continue
            if not isinstance(f, str) or f in ("", ".", "..") or "/" in f or not (root / f).is_file():
                raise EngramError(f"{index} puts {n} in {f!r:.80}, which is not a shard file in {root}; download "
                                  "that shard or re-download the index")
            files.add(f)
        if files:
            return [root / f for f in sorted(files)]
    try:
        return shard_files(root)
    except SafetensorsError as exc:
        raise EngramError(str(exc)) from None
