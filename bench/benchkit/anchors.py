"""The upstream H200 anchors (bench/anchors_h200.json: the tables of docs anchors-h200.md) as typed rows, with
lookups by shape."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BenchError

ANCHORS_PATH = Path(__file__).resolve().parents[1] / "anchors_h200.json"


@dataclass(frozen=True)
class GemmAnchor:
    k: int
    n: int
    K: int
    m: int
    upstream_us: float


@dataclass(frozen=True)
class DenseAnchor:
    k: int
    n: int
    m: int
    us: float


@dataclass(frozen=True)
class MoeAnchor:
    K: int
    T: int
    us: float
    path: str  # "cooperative" (decode, T <= 8) or "fused_full" (prefill, routing preparation included)


@dataclass(frozen=True)
class MgemmAnchor:
    K: int
    tokens: int
    gate_up_us: float
    down_us: float
    layer_us: float


@dataclass(frozen=True)
class EngramAnchor:
    rows: int
    us: float
    gbps: float


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    bf16_matmul_tflops: float


@dataclass(frozen=True)
class Anchors:
    meta: dict[str, Any]
    ceilings: Ceilings
    gemm_rows: tuple[GemmAnchor, ...]
    dense_rows: tuple[DenseAnchor, ...]
    moe_rows: tuple[MoeAnchor, ...]
    moe_shape: dict[str, int]
    moe_distinct_experts: dict[int, float]
    mgemm_rows: tuple[MgemmAnchor, ...]
    engram_rows: tuple[EngramAnchor, ...]
    engram_table: dict[str, int]

    def gemm(self, *, k: int, n: int, K: int, m: int) -> GemmAnchor | None:
        return next((r for r in self.gemm_rows if (r.k, r.n, r.K, r.m) == (k, n, K, m)), None)

    def dense(self, *, k: int, n: int, m: int) -> DenseAnchor | None:
        return next((r for r in self.dense_rows if (r.k, r.n, r.m) == (k, n, m)), None)

    def moe(self, *, K: int, T: int) -> MoeAnchor | None:
        return next((r for r in self.moe_rows if (r.K, r.T) == (K, T)), None)

    def moe_mgemm(self, *, K: int, tokens: int) -> MgemmAnchor | None:
        return next((r for r in self.mgemm_rows if (r.K, r.tokens) == (K, tokens)), None)

    def engram(self, *, rows: int) -> EngramAnchor | None:
        return next((r for r in self.engram_rows if r.rows == rows), None)


def _rows(doc: dict, key: str, cls: type, path: Path) -> tuple:
    out = []
    names = {f for f in cls.__dataclass_fields__}
    for i, row in enumerate(doc.get(key, [])):
        if set(row) != names:
            raise BenchError(f"{path}: {key}[{i}] has fields {sorted(row)}, expected {sorted(names)}; fix the file")
        typed = {}
        for f, spec in cls.__dataclass_fields__.items():
            v = row[f]
            want = spec.type
            ok = (isinstance(v, int) and not isinstance(v, bool)) if want == "int" else (
                isinstance(v, (int, float)) and not isinstance(v, bool) if want == "float" else isinstance(v, str))
            if not ok:
                raise BenchError(f"{path}: {key}[{i}].{f} = {v!r} is not a {want}; fix the file")
            typed[f] = float(v) if want == "float" else v
        out.append(cls(**typed))
    if not out:
        raise BenchError(f"{path}: the table '{key}' is missing or empty; restore bench/anchors_h200.json")
    return tuple(out)


def load_anchors(path: str | os.PathLike | None = None) -> Anchors:
    """The H200 anchors (default bench/anchors_h200.json of this checkout, or $TWINSPARK_ANCHORS)."""
    p = Path(path or os.environ.get("TWINSPARK_ANCHORS", ANCHORS_PATH))
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise BenchError(f"cannot read the anchors file {p} ({e.strerror}); pass its path or set TWINSPARK_ANCHORS") from None
    except ValueError as e:
        raise BenchError(f"{p} is not valid JSON ({e}); fix the file") from None
    try:
        c = doc["ceilings"]
        ceilings = Ceilings(float(c["copy_gbps"]), float(c["bf16_matmul_tflops"]))
        moe = doc["moe"]
        engram = doc["engram"]
        return Anchors(
            meta=dict(doc.get("meta", {})),
            ceilings=ceilings,
            gemm_rows=_rows(doc, "gemm", GemmAnchor, p),
            dense_rows=_rows(doc, "bf16_dense", DenseAnchor, p),
            moe_rows=_rows(moe, "rows", MoeAnchor, p),
            moe_shape={k: int(v) for k, v in moe["shape"].items()},
            moe_distinct_experts={int(k): float(v) for k, v in moe["distinct_experts"].items()},
            mgemm_rows=_rows(doc, "moe_mgemm", MgemmAnchor, p),
            engram_rows=_rows(engram, "rows", EngramAnchor, p),
            engram_table={k: int(v) for k, v in engram["table"].items()},
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise BenchError(f"{p} lacks the entry {e} or has the wrong structure; restore bench/anchors_h200.json") from None
