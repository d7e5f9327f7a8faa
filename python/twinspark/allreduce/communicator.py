"""The all-reduce a model calls: a one-shot transport for small messages and torch.distributed for large ones,
chosen per call by message size from the crossover table (see config.py)."""

from __future__ import annotations

import itertools
import socket
import weakref

import torch

from twinspark.allreduce.base import Transport, check_input
from twinspark.allreduce.config import AllreduceConfig

_ids = itertools.count(1)
_registry: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()


def lookup(comm_id: int) -> Communicator:
    comm = _registry.get(comm_id)
    if comm is None:
        raise ValueError(f"allreduce: no communicator with id {comm_id} (it was closed or never made)")
    return comm


class Communicator:
    """``fast`` (ipc or host transport, may be None) up to ``crossover_bytes``, ``fallback`` (torch.distributed,
    may be None) above. ``id`` names it in the ``twinspark::allreduce`` op."""

    def __init__(self, fast: Transport | None, fallback: Transport | None, crossover_bytes: int):
        if fast is None and fallback is None:
            raise ValueError("allreduce: a communicator needs at least one transport")
        self.fast, self.fallback = fast, fallback
        self.crossover_bytes = int(crossover_bytes)
        any_t = fast or fallback
        self.rank, self.world = any_t.rank, any_t.world
        self.id = next(_ids)
        _registry[self.id] = self

    def choose(self, nbytes: int) -> Transport:
        fast = self.fast
        if fast is not None and nbytes <= self.crossover_bytes and (fast.max_bytes is None or nbytes <= fast.max_bytes):
            return fast
        if self.fallback is not None:
            return self.fallback
        return fast  # type: ignore[return-value]  # its capacity check gives the error

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, None)
        return self.choose(x.numel() * x.element_size()).allreduce(x)

    def check(self) -> None:
        for t in (self.fast, self.fallback):
            if t is not None:
                t.check()

    def close(self) -> None:
        for t in (self.fast, self.fallback):
            if t is not None:
                t.close()
        _registry.pop(self.id, None)


def _same_host(group) -> bool:
    from twinspark.allreduce.rendezvous import all_gather_bytes

    names = all_gather_bytes(group, socket.gethostname().encode())
    return len(set(names)) == 1


def _my_address(cfg: AllreduceConfig) -> str:
    import os

    if cfg.host.address:
        return cfg.host.address
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    return socket.gethostbyname(socket.gethostname())


def create(group=None, transport: str = "auto", config: AllreduceConfig | None = None, device=None) -> Communicator:
    """A communicator for this process's rank of ``group`` (torch.distributed; collective: every rank calls it).

    transport: "ipc" (CUDA IPC, one host), "host" (pinned host memory + proxy; the two-node path; CPU tensors
    too), "nccl" (torch.distributed only) or "auto" (ipc when every rank is on this host and on a GPU, else host).
    """
    import torch.distributed as dist

    from twinspark.allreduce.nccl import DistTransport

    cfg = config or AllreduceConfig.load()
    fallback = DistTransport(group)
    if transport == "nccl":
        return Communicator(None, fallback, 0)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if transport == "auto":
        transport = "ipc" if device.type == "cuda" and _same_host(group) else "host"
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if transport == "ipc":
        from twinspark.allreduce.ipc import IpcTransport

        fast = IpcTransport.from_group(group, cfg.capacity_bytes, device, cfg.timeout_s, cfg.max_blocks)
    elif transport == "host":
        from twinspark.allreduce.hostmem import HostTransport
        from twinspark.allreduce.rendezvous import all_gather_bytes, listen, tcp_mesh

        server = listen(_my_address(cfg))
        try:
            host, port = server.getsockname()[:2]
            addrs = [tuple(a.decode().rsplit(" ", 1)) for a in all_gather_bytes(group, f"{host} {port}".encode())]
            socks = tcp_mesh(rank, world, server, [(h, int(p)) for h, p in addrs], timeout_s=cfg.timeout_s)
        finally:
            server.close()
        backend = cfg.host.backend if device.type == "cuda" else "tcp"
        fast = HostTransport.connect(
            rank, world, socks, cfg.capacity_bytes, device, backend=backend, timeout_s=cfg.timeout_s,
            spin_us=cfg.host.spin_us, max_blocks=cfg.max_blocks, rdma_device=cfg.host.rdma_device,
            rdma_port=cfg.host.rdma_port, rdma_gid_index=cfg.host.rdma_gid_index)
    else:
        raise ValueError(f"allreduce: expected transport auto, ipc, host or nccl, got {transport!r}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Communicator(fast, fallback, cfg.crossover_bytes(transport, world, name))
