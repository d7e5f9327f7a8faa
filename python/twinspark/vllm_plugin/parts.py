"""One checkpoint linear arriving tensor by tensor (vLLM's loader hands the plugin one tensor at a time), cut to
this rank's tensor-parallel slice on arrival so a rank never keeps more than its share.

Slices follow exl3-format.md: W is (k, n) with y = x @ W. Column parallel takes output columns: trellis tiles
``[:, n0/16 : n1/16]`` and ``svh[n0:n1]`` (suh whole). Row parallel takes input rows: tiles ``[k0/16 : k1/16]`` and
``suh[k0:k1]`` (svh whole; the per-rank outputs are partial sums vLLM all-reduces). Because Hk and Hn are
block-diagonal with 128-wide blocks, a slice is exact only when it starts and ends on a multiple of 128.

Every problem ends in one Exl3FormatError sentence naming the checkpoint tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinspark.exl3 import reference as ref
from twinspark.exl3.format import MARKERS, Exl3FormatError, _signs_to_scales, require_finite
from twinspark.exl3.layer import Exl3Layer

SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_STORED = {"trellis": torch.int16, "suh": torch.float16, "svh": torch.float16, "su": torch.int16,
           "sv": torch.int16, "mcg": torch.int32, "mul1": torch.int32}


def register_placeholders(layer, loader, prefix: str = "") -> None:
    """One empty parameter per stored EXL3 tensor kind (``{prefix}{suffix}``, in the dtype the checkpoint stores
    it, so vLLM's loader sees no dtype change), each loaded by ``loader(layer, suffix)``."""
    from torch.nn import Parameter

    for suffix in SUFFIXES:
        p = Parameter(torch.empty(0, dtype=_STORED[suffix]), requires_grad=False)
        p.weight_loader = loader(layer, suffix)
        layer.register_parameter(f"{prefix}{suffix}", p)
_FIX = "re-download the shard or re-quantize the layer"


@dataclass(frozen=True)
class Cut:
    """This rank's part of one dimension: [start, start + size); None = the whole dimension."""

    start: int
    size: int


def _err(msg: str) -> Exl3FormatError:
    return Exl3FormatError(f"{msg}; {_FIX}")


class Exl3Parts:
    """Collects `name.{trellis,suh,svh,su,sv,mcg,mul1}` of one checkpoint linear, sliced by `cut_k` / `cut_n`."""

    def __init__(self, name: str, cut_k: Cut | None = None, cut_n: Cut | None = None,
                 codebook: str | None = None):
        self.name, self.cut_k, self.cut_n, self.expected_codebook = name, cut_k, cut_n, codebook
        self.t: dict[str, torch.Tensor] = {}
        self.full: dict[str, tuple[int, ...]] = {}
        self.K: float | None = None
        self.codebook: str | None = None

    def _cut(self, t: torch.Tensor, dim: int, cut: Cut | None, full: int, what: str) -> torch.Tensor:
        """Slice dimension `dim` of t (elements, or tiles of 16 when `what` is trellis)."""
        if cut is None:
            return t
        unit = 16 if what == "trellis" else 1
        if cut.start % 128 or cut.size % 128:
            raise Exl3FormatError(
                f"tensor {self.name}.{what}: this rank's tensor-parallel slice [{cut.start}, {cut.start + cut.size}) "
                f"does not start and end on a 128-wide Hadamard block; use a tensor-parallel size that splits "
                f"this layer into multiples of 128")
        if cut.start + cut.size > full:
            raise Exl3FormatError(
                f"tensor {self.name}.{what} covers {full} channels but this rank needs [{cut.start}, "
                f"{cut.start + cut.size}); the checkpoint does not match the model's config.json")
        return t.narrow(dim, cut.start // unit, cut.size // unit)

    def add(self, suffix: str, t: torch.Tensor, device=None) -> None:
        """Check and keep one tensor, cut to this rank; `device` is where it will live (moved right away, so the
        loader never piles a whole model up in host memory)."""
        n = f"{self.name}.{suffix}"
        if suffix == "trellis":
            if t.dtype != torch.int16 or t.dim() != 3:
                raise _err(f"tensor {n} must be int16 [k/16, n/16, 16*K], got {t.dtype} {list(t.shape)}")
            try:
                K = ref.rate_from_last_dim(t.shape[-1])
            except ValueError as exc:
                raise _err(f"tensor {n}: {exc}") from None
            if self.K is not None and self.K != K:
                raise _err(f"tensor {n} appears in two checkpoint shards with different K ({self.K} and {K})")
            self.K = K
            k, nn = t.shape[0] * 16, t.shape[1] * 16
            t = self._cut(t, 0, self.cut_k, k, "trellis")
            t = self._cut(t, 1, self.cut_n, nn, "trellis")
            self.full["trellis"] = (k, nn)
        elif suffix in ("suh", "svh"):
            if t.dtype != torch.float16 or t.dim() != 1:
                raise _err(f"tensor {n} must be float16 [channels], got {t.dtype} {list(t.shape)}")
            if not t.is_meta:  # a shape-only load (meta tensors) checks shapes and slices, no values
                require_finite(t, n)
            self.full[suffix] = (t.shape[0],)
            t = self._cut(t, 0, self.cut_k if suffix == "suh" else self.cut_n, t.shape[0], suffix)
        elif suffix in ("su", "sv"):
            if t.dtype != torch.int16 or t.dim() != 1:
                raise _err(f"tensor {n} must be int16 packed signs, got {t.dtype} {list(t.shape)}")
            count = t.shape[0] * 16
            scales = _signs_to_scales(t, count)
            full = "suh" if suffix == "su" else "svh"
            self.full[full] = (count,)
            suffix, t = full, self._cut(scales, 0, self.cut_k if full == "suh" else self.cut_n, count, suffix)
        elif suffix in MARKERS:
            if t.dtype != torch.int32 or t.numel() != 1:
                raise _err(f"tensor {n} must be an int32 scalar codebook marker, got {t.dtype} {list(t.shape)}")
            value = MARKERS[suffix] if t.is_meta else int(t.reshape(()).item())
            if value != MARKERS[suffix]:
                raise _err(f"tensor {n} holds {value & 0xFFFFFFFF:#010x}, not the {suffix} marker "
                           f"{MARKERS[suffix] & 0xFFFFFFFF:#010x}: the file is corrupt")
            other = "mcg" if suffix == "mul1" else "mul1"
            if other in self.t:
                raise _err(f"layer {self.name} has both {self.name}.mcg and {self.name}.mul1 markers")
        else:
            raise Exl3FormatError(f"tensor {n}: the exl3 plugin does not know the suffix {suffix!r}")
        if suffix in ("trellis", "suh", "svh"):
            # a copy, never a view: a view would keep the whole loaded tensor alive
            moved = device is not None and torch.device(device) != t.device
            t = (t.to(device) if moved else t.clone()).contiguous()
        self.t[suffix] = t

    def finish(self, device=None) -> Exl3Layer:
        """Check completeness and shapes; this rank's Exl3Layer (bias stays with vLLM's layer)."""
        name = self.name
        if "trellis" not in self.t:
            raise _err(f"tensor {name}.trellis is missing")
        k, n = self.full["trellis"]
        for full, legacy, count in (("suh", "su", k), ("svh", "sv", n)):
            if full not in self.t:
                raise _err(f"tensor {name}.{full} (or legacy {name}.{legacy}) is missing")
            if self.full[full] != (count,):
                raise _err(f"tensor {name}.{full} has shape {list(self.full[full])}, expected [{count}] to match "
                           f"{name}.trellis (k={k}, n={n})")
        markers = [m for m in MARKERS if m in self.t]
        codebook = markers[0] if markers else "3inst"
        K = self.K
        if K in ref.HALF_RATES and codebook != "mul1":
            raise _err(f"tensor {name}.trellis has half rate K={K}, which exists only with the mul1 codebook "
                       f"(this layer is {codebook})")
        if self.expected_codebook and codebook != self.expected_codebook:
            found = f"marker {name}.{codebook}" if markers else f"no {name}.mcg/{name}.mul1 marker (3inst)"
            raise _err(f"tensor {name} has {found}, but config.json quantization_config.codebook is "
                       f"{self.expected_codebook}: the codebook marker is wrong")
        layer = Exl3Layer(self.t["trellis"], self.t["suh"], self.t["svh"], K, codebook, None, name=name)
        return layer.to(device) if device is not None else layer
