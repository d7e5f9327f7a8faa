"""One memory sample: /proc/meminfo plus the torch allocator's reserved/allocated bytes."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """Fields of /proc/meminfo in bytes (MemAvailable, MemFree, Cached, ...)."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


@dataclass(frozen=True)
class MemorySample:
    t: float
    mem_available: int
    mem_free: int
    cached: int
    torch_reserved: int
    torch_allocated: int

    def as_dict(self) -> dict:
        return asdict(self)


def sample(meminfo_path: str | Path = "/proc/meminfo") -> MemorySample:
    info = read_meminfo(meminfo_path)
    reserved = allocated = 0
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    except Exception:  # torch missing or no device: the OS numbers still matter
        pass
    return MemorySample(time.time(), info.get("MemAvailable", 0), info.get("MemFree", 0), info.get("Cached", 0),
                        reserved, allocated)
