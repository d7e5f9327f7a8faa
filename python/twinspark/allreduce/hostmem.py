"""Host-memory all-reduce (transport "host"): the path between two Sparks, whose NICs cannot reach GPU memory.

Each rank owns one host allocation (pinned and mapped into the GPU for a CUDA communicator; plain memory for a
CPU one) holding a send slot pair and a recv slot pair per peer, plus a proxy thread (C++,
cuda/allreduce_host/) that forwards the send slot to every peer and raises the peer's recv flag when the bytes
landed. Backends: ``rdma`` (ibverbs RDMA write with immediate; RoCE between the Sparks), ``tcp`` (anywhere),
``loopback`` (ranks of one process; the proxy copies host to host, standing in for the NIC).

On a CUDA device the one-shot kernel (mode kHostProxy) writes the partial straight into pinned memory and reads
the peers' partials from it; epochs live on the device, so the call is CUDA-graph safe (buffers are registered
when the communicator is made, before any capture). On the CPU, or with TWINSPARK_FORCE_REFERENCE=1, the same
protocol runs on the host with :func:`twinspark.reference.allreduce.allreduce` doing the sum: a rank on the
reference path interoperates with a peer on the kernel path and produces the same bits.
"""

from __future__ import annotations

import ctypes
import socket

import numpy as np
import torch

from twinspark import _ext
from twinspark.allreduce.base import DTYPE_CODE, Transport, check_input
from twinspark.allreduce.errors import AllreduceError, AllreduceTimeout, PeerFailed, timeout_message
from twinspark.reference.allreduce import allreduce as reference_allreduce

MODE_HOST_PROXY = 1
BACKENDS = ("rdma", "tcp", "loopback")


def _raw(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over raw host memory (no copy; the owner keeps it alive)."""
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr)))


class HostTransport(Transport):
    """One rank of the host-memory all-reduce. Make one with :meth:`connect` (ranks in different processes or
    hosts) or :meth:`loopback_group` (every rank in this process)."""

    name = "host"

    def __init__(self, comm, device: torch.device, timeout_s: float, max_blocks: int = 24):
        self._comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.max_bytes = comm.capacity
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.backend = comm.backend
        self._mem = _raw(comm.base, comm.nbytes)
        self._base = comm.base
        self._failed: AllreduceError | None = None
        self._plan = None
        self._counters = None
        if self.device.type == "cuda":
            C = _ext.module()
            _ext.use_kernel(torch.empty(0, device=self.device))  # "not built for sm_XX" now, not mid-capture
            # counters[0] holds the last epoch; the reference path reads and bumps it too, so both paths agree.
            self._counters = torch.zeros(4, dtype=torch.int32, device=self.device)
            self._plan = C.AllreducePlan(
                rank=self.rank, world=self.world, mode=MODE_HOST_PROXY, max_blocks=max_blocks,
                timeout_s=self.timeout_s, status=comm.status_addr(), counters=self._counters.data_ptr(),
                publish=[comm.send_slot(0), comm.send_slot(1)],
                src=[[0, 0] if r == self.rank else [comm.recv_slot(r, 0), comm.recv_slot(r, 1)]
                     for r in range(self.world)],
                post=[comm.header(0), comm.header(1)] + [0] * max(0, self.world - 2),
                wait=[0 if r == self.rank else comm.recv_flag(r) for r in range(self.world)],
                capacity=comm.capacity,
            )
        self._epoch = 0  # CPU communicators only
        comm.start()

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _new_comm(rank: int, world: int, capacity: int, device: torch.device, spin_us: float):
        return _ext.module().AllreduceHostComm(rank, world, int(capacity), device.type == "cuda", float(spin_us))

    @classmethod
    def loopback_group(cls, world: int, capacity: int, device="cpu", timeout_s: float = 10.0,
                       spin_us: float = 50.0, max_blocks: int = 24) -> list[HostTransport]:
        """Every rank of a ``world``-rank communicator in this process (virtual ranks), linked by the loopback
        backend. Call each rank from its own thread (CPU) or CUDA stream (GPU): a rank waits for the others."""
        device = torch.device(device)
        comms = [cls._new_comm(r, world, capacity, device, spin_us) for r in range(world)]
        for c in comms:
            c.connect_loopback(comms)
        return [cls(c, device, timeout_s, max_blocks) for c in comms]

    @classmethod
    def connect(cls, rank: int, world: int, socks: list[socket.socket | None], capacity: int, device="cpu",
                backend: str = "tcp", timeout_s: float = 10.0, spin_us: float = 50.0, max_blocks: int = 24,
                rdma_device: str = "", rdma_port: int = 1, rdma_gid_index: int = 3) -> HostTransport:
        """One rank, linked to its peers by ``socks`` (from :func:`twinspark.allreduce.rendezvous.tcp_mesh`; the
        TCP backend sends data over them, the RDMA backend only swaps queue-pair data). Takes the sockets over."""
        if backend not in ("tcp", "rdma"):
            raise ValueError(f"allreduce: expected backend 'tcp' or 'rdma' for connect(), got {backend!r}")
        device = torch.device(device)
        comm = cls._new_comm(rank, world, capacity, device, spin_us)
        fds = [-1 if s is None else s.fileno() for s in socks]
        if backend == "tcp":
            comm.connect_tcp(fds)
        else:
            try:
                comm.connect_rdma(fds, rdma_device, rdma_port, rdma_gid_index)
            except RuntimeError as exc:
                raise AllreduceError(str(exc)) from None
        for s in socks:
            if s is not None:
                s.detach()  # the C++ backend owns (and closes) the descriptors now
        return cls(comm, device, timeout_s, max_blocks)

    # ------------------------------------------------------------------ calls
    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed
        code, peer, epoch, _ = self._comm.status()
        if code == 0:
            return
        if code == 1:
            self._failed = AllreduceTimeout(timeout_message(self.rank, peer, epoch, self.timeout_s))
        else:
            self._failed = PeerFailed(
                f"allreduce: rank {self.rank}'s proxy failed: {self._comm.error() or 'unknown error'}"
            )
        raise self._failed

    def check(self) -> None:
        self._raise_if_failed()

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        # Contract: x float32/float16/bfloat16, contiguous, <= capacity bytes, on this communicator's device
        # (CPU communicators take CPU tensors). Same shape/dtype on every rank, same call order.
        check_input(x, self.max_bytes)
        if x.device.type != self.device.type:
            raise ValueError(f"allreduce: x is on {x.device}, this communicator was made for {self.device}")
        self._raise_if_failed()
        if self._plan is not None and _ext.use_kernel(x):
            return self._kernel(x)
        return self._reference(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.data_ptr() % 16:
            x = x.clone()  # the kernel moves 16-byte vectors
        out = torch.empty_like(x)
        self._plan.launch(x.data_ptr(), out.data_ptr(), x.numel(), DTYPE_CODE[x.dtype], _ext.stream_ptr(x.device))
        return out

    def _next_epoch(self) -> int:
        if self._counters is None:
            self._epoch += 1
            return self._epoch
        # A CUDA communicator on the reference path (TWINSPARK_FORCE_REFERENCE): keep the device epoch in step.
        e = int(self._counters[0].item()) + 1
        self._counters[0] = e
        return e

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        e = self._next_epoch()
        slot = e & 1
        c = self._comm
        flat = x.detach().reshape(-1)
        if nbytes:
            off = c.send_slot(slot) - self._base
            self._mem[off:off + nbytes].copy_(flat.view(torch.uint8).cpu())
        c.post(e & 0xFFFFFFFF, nbytes)
        parts = []
        for r in range(self.world):
            if r == self.rank:
                parts.append(flat.cpu())
                continue
            if not c.wait(r, e & 0xFFFFFFFF, self.timeout_s):
                code = c.status()[0]
                if code == 0:
                    self._failed = AllreduceTimeout(timeout_message(self.rank, r, e, self.timeout_s))
                    raise self._failed
                self._raise_if_failed()
            off = c.recv_slot(r, slot) - self._base
            parts.append(self._mem[off:off + nbytes].view(x.dtype))
        return reference_allreduce(parts).view(x.shape).to(x.device)

    def close(self) -> None:
        if self._comm is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no kernel may still read the pinned buffers we free
            self._comm.stop()
            self._plan = None
            self._mem = None
            self._comm = None  # frees the buffers (and closes sockets / RDMA resources)
