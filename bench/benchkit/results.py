"""Benchmark records and results files: Record (one measured case), write_results / load_results (JSON in
$TWINSPARK_BENCH_OUT or bench/results, with the machine's description), save_figure (PNG, temp + rename)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twinspark.fileio import atomic_write, read_json

from .errors import BenchError
from .timing import Timing, gbps


@dataclass
class Record:
    """One measured case. ``bytes`` = bytes one call must move (weights + activations), for GB/s against the
    copy ceiling; ``anchor_us`` = the upstream H200 number for the same case (None when there is none);
    ``dense_us`` = the bf16 dense torch.mm time of the same shape, when it applies."""

    op: str
    shape: dict[str, int]
    timing: Timing | None = None
    median_us: float | None = None
    bytes: int | None = None
    flops: int | None = None
    anchor_us: float | None = None
    dense_us: float | None = None
    variant: str = "twinspark"
    notes: str = ""
    samples_us: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.op or not isinstance(self.shape, dict):
            raise BenchError(f"Record: expected an op name and a shape dict, got op={self.op!r}, shape={self.shape!r}")
        if self.timing is not None:
            self.median_us = self.timing.median_us
            self.samples_us = list(self.timing.samples_us)
        if self.median_us is None:
            raise BenchError(f"Record {self.op} {self.shape}: give timing= or median_us=")

    @property
    def gbps(self) -> float | None:
        return gbps(self.bytes, self.median_us) if self.bytes else None

    @property
    def vs_anchor(self) -> float | None:
        """Speed-up over the upstream anchor (> 1: faster than upstream)."""
        return self.anchor_us / self.median_us if self.anchor_us and self.median_us else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timing")
        d["gbps"] = self.gbps
        d["vs_anchor"] = self.vs_anchor
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        keep = {k: d[k] for k in ("op", "shape", "median_us", "bytes", "flops", "anchor_us", "dense_us",
                                   "variant", "notes", "samples_us") if k in d}
        return cls(**keep)


def machine_info() -> dict[str, Any]:
    """GPU name, SM count, capability, torch and CUDA versions, host and date (UTC) of this run."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            info.update(gpu=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                        gpu_memory_gib=round(p.total_memory / 2**30, 1))
            try:
                import subprocess

                info["driver"] = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
            except (OSError, IndexError, subprocess.SubprocessError):
                pass
        else:
            info["gpu"] = None
    except ImportError:
        info["torch"] = None
    return info


def default_out_dir() -> Path:
    """$TWINSPARK_BENCH_OUT (set by bench/run.py) or bench/results."""
    return Path(os.environ.get("TWINSPARK_BENCH_OUT") or "bench/results")


def write_results(name: str, records: Iterable[Record], out_dir: str | os.PathLike | None = None,
                  ceilings: dict[str, float] | None = None, machine: dict[str, Any] | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` (temp + rename): machine info, ceilings and every record.
    ``out_dir`` defaults to default_out_dir(), so a bench file run by bench/run.py writes where run.py reads."""
    if not name or "/" in name:
        raise BenchError(f"write_results: expected a plain name like 'exl3_gemm', got {name!r}")
    recs = list(records)
    bad = [r for r in recs if not isinstance(r, Record)]
    if bad:
        raise BenchError(f"write_results: expected Record objects, got {type(bad[0]).__name__}")
    doc = {
        "name": name,
        "machine": machine if machine is not None else machine_info(),
        "ceilings": dict(ceilings or {}),
        "records": [r.to_json() for r in recs],
    }
    path = Path(out_dir if out_dir is not None else default_out_dir()) / f"{name}.json"
    atomic_write(path, json.dumps(doc, indent=1) + "\n")
    return path


def save_figure(fig, png: str | os.PathLike, dpi: int = 100) -> Path:
    """Write a matplotlib figure to ``png`` (temp name, then rename: never a half-written PNG) and close it."""
    import matplotlib.pyplot as plt

    png = Path(png)
    tmp = png.with_name(f".{png.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return png


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A results file back: {"name", "machine", "ceilings", "records": [Record, ...]}."""
    p = Path(path)
    try:
        doc = read_json(p)  # a regular file only: a FIFO would block the reader
        doc["records"] = [Record.from_json(r) for r in doc["records"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{p} is not a benchkit results file ({e}); re-run the benchmark that wrote it") from None
    return doc
