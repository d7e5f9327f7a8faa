"""Read, validate and write EXL3 layers in safetensors files (exl3-format.md section 1).

Every malformed input ends in one Exl3FormatError sentence that names the tensor, what is wrong and what to do."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from twinspark.exl3 import reference as ref
from twinspark.exl3.layer import Exl3Layer
from twinspark.safetensors_io import SafetensorsError, index_tensors

MARKERS = {"mcg": -877912083, "mul1": -2082680531}  # 0xCBAC1FED, 0x83DCD12D as int32
_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")


class Exl3FormatError(ValueError):
    """An EXL3 tensor that cannot be used: the message names the tensor and what to do."""


def _fix(msg: str) -> str:
    return f"{msg}; re-download the shard or re-quantize the layer"


def require_finite(t: torch.Tensor, name: str) -> None:
    """Refuse NaN or inf in a scale (suh, svh) or bias: one such value turns every output of the layer into NaN."""
    if not bool(torch.isfinite(t).all()):
        raise Exl3FormatError(_fix(f"tensor {name} holds NaN or infinite values"))


def _signs_to_scales(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Legacy su/sv: int16 words, bit i of word w is channel 16w+i, set = -1 -> float16 +-1 [count]."""
    words = packed.to(torch.int64) & 0xFFFF
    bits = (words.unsqueeze(1) >> torch.arange(16)) & 1
    return (1 - 2 * bits.reshape(-1)[:count]).to(torch.float16)


def validate_layer(tensors: Mapping[str, torch.Tensor], prefix: str) -> Exl3Layer:
    """Check one layer's tensors (keys are full names `prefix.suffix`) and build an Exl3Layer."""
    get = lambda s: tensors.get(f"{prefix}.{s}")  # noqa: E731
    trellis = get("trellis")
    if trellis is None:
        raise Exl3FormatError(_fix(f"tensor {prefix}.trellis is missing"))
    if trellis.dtype != torch.int16:
        raise Exl3FormatError(_fix(f"tensor {prefix}.trellis must be int16, got {trellis.dtype}"))
    if trellis.dim() != 3:
        raise Exl3FormatError(_fix(f"tensor {prefix}.trellis must be 3-D [k/16, n/16, 16*K], got shape "
                                   f"{list(trellis.shape)}"))
    try:
        K = ref.rate_from_last_dim(trellis.shape[-1])
    except ValueError as exc:
        raise Exl3FormatError(_fix(f"tensor {prefix}.trellis: {exc}")) from None
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16

    codebook = "3inst"
    found = [s for s in ("mcg", "mul1") if get(s) is not None]
    if len(found) > 1:
        raise Exl3FormatError(_fix(f"layer {prefix} has both {prefix}.mcg and {prefix}.mul1 markers"))
    if found:
        name, marker = found[0], get(found[0])
        if marker.dtype != torch.int32 or marker.numel() != 1:
            raise Exl3FormatError(_fix(f"tensor {prefix}.{name} must be an int32 scalar marker, got "
                                       f"{marker.dtype} of shape {list(marker.shape)}"))
        value = int(marker.reshape(()).item())
        if value != MARKERS[name]:
            raise Exl3FormatError(_fix(f"tensor {prefix}.{name} holds {value & 0xFFFFFFFF:#010x}, not the {name} "
                                       f"marker {MARKERS[name] & 0xFFFFFFFF:#010x}: the file is corrupt"))
        codebook = name
    if K in ref.HALF_RATES and codebook != "mul1":
        raise Exl3FormatError(_fix(f"tensor {prefix}.trellis has half rate K={K}, which exists only with the "
                                   f"mul1 codebook (this layer is {codebook})"))

    def scales(full: str, legacy: str, count: int) -> torch.Tensor:
        t = get(full)
        if t is not None:
            if t.dtype != torch.float16:
                raise Exl3FormatError(_fix(f"tensor {prefix}.{full} must be float16, got {t.dtype}"))
            if tuple(t.shape) != (count,):
                raise Exl3FormatError(_fix(f"tensor {prefix}.{full} has shape {list(t.shape)}, expected [{count}] "
                                           f"to match {prefix}.trellis {list(trellis.shape)}"))
            require_finite(t, f"{prefix}.{full}")
            return t
        t = get(legacy)
        if t is None:
            raise Exl3FormatError(_fix(f"tensor {prefix}.{full} (or legacy {prefix}.{legacy}) is missing"))
        if t.dtype != torch.int16:
            raise Exl3FormatError(_fix(f"tensor {prefix}.{legacy} must be int16 packed signs, got {t.dtype}"))
        if tuple(t.shape) != (count // 16,):
            raise Exl3FormatError(_fix(f"tensor {prefix}.{legacy} has shape {list(t.shape)}, expected "
                                       f"[{count // 16}] to match {prefix}.trellis {list(trellis.shape)}"))
        return _signs_to_scales(t, count)

    suh = scales("suh", "su", k)
    svh = scales("svh", "sv", n)
    bias = get("bias")
    if bias is not None:
        if bias.dtype != torch.float16:
            raise Exl3FormatError(_fix(f"tensor {prefix}.bias must be float16, got {bias.dtype}"))
        if tuple(bias.shape) != (n,):
            raise Exl3FormatError(_fix(f"tensor {prefix}.bias has shape {list(bias.shape)}, expected [{n}]"))
        require_finite(bias, f"{prefix}.bias")
    return Exl3Layer(trellis, suh, svh, K, codebook, bias, name=prefix)


def read_layer(source, prefix: str) -> Exl3Layer:
    """Read and validate layer `prefix` from a .safetensors file, a list of files or a checkpoint directory."""
    from safetensors import SafetensorError, safe_open

    try:
        index = index_tensors(source)
    except SafetensorsError as exc:
        raise Exl3FormatError(str(exc)) from None
    wanted = {f"{prefix}.{s}": index[f"{prefix}.{s}"] for s in _SUFFIXES if f"{prefix}.{s}" in index}
    if not wanted:
        raise Exl3FormatError(f"no tensors named {prefix}.* in {source}; check the layer name")
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, info in wanted.items():
        by_file.setdefault(info.path, []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # the header was checked: the file changed or cannot be read
            raise Exl3FormatError(_fix(f"cannot read layer {prefix} from {path} ({exc})")) from None
    return validate_layer(tensors, prefix)


def layer_tensors(layer: Exl3Layer, prefix: str) -> dict[str, torch.Tensor]:
    """The stored tensors of one layer (the new suh/svh form; the codebook marker unless 3inst)."""
    out = {f"{prefix}.trellis": layer.trellis.contiguous().cpu(), f"{prefix}.suh": layer.suh.contiguous().cpu(),
           f"{prefix}.svh": layer.svh.contiguous().cpu()}
    if layer.codebook in MARKERS:
        out[f"{prefix}.{layer.codebook}"] = torch.tensor(MARKERS[layer.codebook], dtype=torch.int32)
    if layer.bias is not None:
        out[f"{prefix}.bias"] = layer.bias.contiguous().cpu()
    return out


def write_layers(path: str | os.PathLike, layers: Mapping[str, Exl3Layer],
                 extra: Mapping[str, torch.Tensor] | None = None, metadata: Mapping[str, str] | None = None) -> Path:
    """Write layers (prefix -> layer) plus extra tensors into one .safetensors file, atomically (temp + rename)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for prefix, layer in layers.items():
        tensors.update(layer_tensors(layer, prefix))
    for name, t in (extra or {}).items():
        tensors[name] = t.contiguous().cpu()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=dict(metadata or {}))
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
