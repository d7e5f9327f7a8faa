"""The all-reduce settings file (configs/allreduce.json): communicator sizes, the host path's backend, the
crossover table that picks a transport by message size, and the vLLM switch.

Crossover table: for (transport, world, device) a message of at most ``max_bytes`` goes through the one-shot
transport, a larger one through torch.distributed (NCCL). ``python -m twinspark.allreduce.tune`` measures an
entry and writes it back (``measured`` records where and when); hand-written entries carry ``measured: null``.
File lookup: the explicit path, else $TWINSPARK_ALLREDUCE_CONFIG, else configs/allreduce.json of the checkout;
without a file the defaults below apply.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from twinspark.fileio import atomic_write
from twinspark.paths import project_root

DEFAULT_PATH = project_root() / "configs" / "allreduce.json"
# Used only when the table has no entry for a (transport, world, device): small enough that the one-shot kernel
# wins on every fabric we know (its cost grows with world * size, NCCL's stays flat), until tuning says otherwise.
FALLBACK_CROSSOVER = 64 * 1024


class ConfigError(ValueError):
    """The settings file is malformed."""


@dataclass
class Crossover:
    transport: str  # "ipc" or "host"
    world: int
    device: str = "*"  # torch.cuda.get_device_name() or "cpu"; "*" matches any
    max_bytes: int = FALLBACK_CROSSOVER
    measured: str | None = None  # "2026-11-29 H200 (tune)" when measured; None for a default


@dataclass
class HostSettings:
    backend: str = "rdma"  # rdma | tcp
    address: str = ""  # this node's address for the side channel; "" -> $VLLM_HOST_IP, else the hostname's
    rdma_device: str = ""  # "" -> the first device
    rdma_port: int = 1
    rdma_gid_index: int = 3
    spin_us: float = 50.0


@dataclass
class VllmSettings:
    enabled: bool = False
    transport: str = "auto"  # auto | ipc | host


@dataclass
class AllreduceConfig:
    capacity_bytes: int = 8 * 1024 * 1024
    timeout_s: float = 30.0
    max_blocks: int = 24
    host: HostSettings = field(default_factory=HostSettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    crossover: list[Crossover] = field(default_factory=list)
    path: str | None = None

    def crossover_bytes(self, transport: str, world: int, device: str) -> int:
        """The largest message the one-shot ``transport`` takes for ``world`` ranks on ``device``."""
        exact = [c for c in self.crossover if c.transport == transport and c.world == world and c.device == device]
        wild = [c for c in self.crossover if c.transport == transport and c.world == world and c.device == "*"]
        hit = (exact or wild or [None])[0]
        return hit.max_bytes if hit else FALLBACK_CROSSOVER

    def set_crossover(self, entry: Crossover) -> None:
        self.crossover = [
            c for c in self.crossover
            if (c.transport, c.world, c.device) != (entry.transport, entry.world, entry.device)
        ] + [entry]

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> AllreduceConfig:
        p = Path(path or os.environ.get("TWINSPARK_ALLREDUCE_CONFIG") or DEFAULT_PATH)
        if not p.exists():
            if path or os.environ.get("TWINSPARK_ALLREDUCE_CONFIG"):
                raise ConfigError(f"allreduce config {p} does not exist; create it or unset the path to use defaults")
            return cls()
        try:
            raw = json.loads(p.read_text())
            cfg = cls(
                capacity_bytes=int(raw.get("capacity_bytes", cls.capacity_bytes)),
                timeout_s=float(raw.get("timeout_s", cls.timeout_s)),
                max_blocks=int(raw.get("max_blocks", cls.max_blocks)),
                host=HostSettings(**raw.get("host", {})),
                vllm=VllmSettings(**raw.get("vllm", {})),
                crossover=[Crossover(**c) for c in raw.get("crossover", [])],
                path=str(p),
            )
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ConfigError(f"allreduce config {p} is not valid ({exc}); fix it or delete it to use defaults") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        where = f"allreduce config {self.path or '(defaults)'}"
        if self.capacity_bytes <= 0 or self.capacity_bytes > 1 << 30:
            raise ConfigError(f"{where}: capacity_bytes must be in 1..2^30, got {self.capacity_bytes}")
        if self.timeout_s <= 0:
            raise ConfigError(f"{where}: timeout_s must be > 0, got {self.timeout_s}")
        if not 1 <= self.max_blocks <= 64:
            raise ConfigError(f"{where}: max_blocks must be 1..64, got {self.max_blocks}")
        if self.host.backend not in ("rdma", "tcp"):
            raise ConfigError(f"{where}: host.backend must be 'rdma' or 'tcp', got {self.host.backend!r}")
        if self.vllm.transport not in ("auto", "ipc", "host"):
            raise ConfigError(f"{where}: vllm.transport must be auto, ipc or host, got {self.vllm.transport!r}")
        for c in self.crossover:
            if c.transport not in ("ipc", "host") or c.world < 1 or c.max_bytes < 0:
                raise ConfigError(f"{where}: bad crossover entry {asdict(c)}")

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the file (temp name, then rename)."""
        p = Path(path or self.path or DEFAULT_PATH)
        data = asdict(self)
        data.pop("path")
        return atomic_write(p, json.dumps(data, indent=2) + "\n")
