"""CUDA IPC all-reduce (transport "ipc"): ranks on one host, every rank's device buffer mapped into every other
rank (cudaIpcGetMemHandle / cudaIpcOpenMemHandle, handles swapped through torch.distributed), or, for virtual
ranks in one process, shared directly. The one-shot kernel (mode kPeerFlags) publishes each rank's input into
its own buffer and stores per-block epoch flags into the peers' buffers; every rank then reads all inputs over
NVLink/PCIe (or from the same GPU's memory for virtual ranks) and sums them in rank order.

Device buffer of a rank: [flags kMaxBlocks x kMaxRanks u32 | pad to 4 KiB][slot 0][slot 1]. Buffers are
allocated when the communicator is made, so calls can be captured into CUDA graphs afterwards.
"""

from __future__ import annotations

import torch

from twinspark import _ext
from twinspark.allreduce.base import DTYPE_CODE, Transport, check_input
from twinspark.allreduce.errors import AllreduceError, AllreduceTimeout, timeout_message

MODE_PEER_FLAGS = 0


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class _Buffer:
    """This rank's device buffer and the peers' mapped buffers (closed/freed on close())."""

    def __init__(self, capacity: int, device: torch.device):
        C = _ext.module()
        if device.index is None:  # "cuda" -> "cuda:N", so device checks compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        # "not built for sm_XX" now, not at the first call (which may sit inside a CUDA-graph capture).
        _ext.use_kernel(torch.empty(0, device=device))
        self.capacity = _round_up(int(capacity), 4096)
        self.header = int(C.allreduce_header_bytes)
        with torch.cuda.device(device):
            self.own = C.allreduce_device_alloc(self.header + 2 * self.capacity)
            self.status = C.allreduce_pinned_alloc(64)
        self.opened: list[int] = []
        self.device = device

    def close(self) -> None:
        C = _ext.module()
        with torch.cuda.device(self.device):
            for p in self.opened:
                C.allreduce_ipc_close(p)
            self.opened = []
            if self.own:
                C.allreduce_device_free(self.own)
                C.allreduce_pinned_free(self.status)
                self.own = 0


class IpcTransport(Transport):
    """One rank of the one-shot all-reduce over CUDA IPC. Make one with :meth:`from_group` (one process per
    rank) or :meth:`local_group` (every rank in this process, e.g. virtual ranks on one GPU)."""

    name = "ipc"

    def __init__(self, rank: int, world: int, buf: _Buffer, peers: list[int], timeout_s: float, max_blocks: int,
                 group=None):
        C = _ext.module()
        self.rank, self.world = rank, world
        self.max_bytes = buf.capacity
        self.device = buf.device
        self.timeout_s = float(timeout_s)
        self._buf = buf
        self._group = group
        self._failed: AllreduceError | None = None
        self._counters = torch.zeros(4, dtype=torch.int32, device=self.device)
        h, cap = buf.header, buf.capacity
        self._plan = C.AllreducePlan(
            rank=rank, world=world, mode=MODE_PEER_FLAGS, max_blocks=max_blocks, timeout_s=self.timeout_s,
            status=buf.status, counters=self._counters.data_ptr(),
            publish=[buf.own + h, buf.own + h + cap],
            src=[[peers[r] + h, peers[r] + h + cap] for r in range(world)],
            post=[0 if r == rank else peers[r] + 4 * rank for r in range(world)],
            wait=[0 if r == rank else buf.own + 4 * r for r in range(world)],
            capacity=cap,
        )

    @classmethod
    def local_group(cls, world: int, capacity: int, device="cuda", timeout_s: float = 10.0,
                    max_blocks: int = 24) -> list[IpcTransport]:
        """All ``world`` ranks in this process on ``device`` (virtual ranks). Launch each rank's call on its own
        CUDA stream: a rank's kernel waits for the others' kernels, which must run concurrently."""
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        bufs = [_Buffer(capacity, device) for _ in range(world)]
        peers = [b.own for b in bufs]
        return [cls(r, world, bufs[r], peers, timeout_s, max_blocks) for r in range(world)]

    @classmethod
    def from_group(cls, group, capacity: int, device=None, timeout_s: float = 10.0,
                   max_blocks: int = 24) -> IpcTransport:
        """This process's rank of ``group`` (a torch.distributed group; gloo is enough, the handles are bytes)."""
        import torch.distributed as dist

        from twinspark.allreduce.rendezvous import all_gather_bytes

        device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        C = _ext.module()
        buf = _Buffer(capacity, device)
        handles = all_gather_bytes(group, C.allreduce_ipc_handle(buf.own))
        peers = []
        with torch.cuda.device(device):
            for r, hnd in enumerate(handles):
                if r == rank:
                    peers.append(buf.own)
                else:
                    p = C.allreduce_ipc_open(hnd)
                    buf.opened.append(p)
                    peers.append(p)
        dist.barrier(group)  # every rank mapped every buffer before anyone writes a flag
        return cls(rank, world, buf, peers, timeout_s, max_blocks, group=group)

    def check(self) -> None:
        if self._failed is not None:
            raise self._failed
        code, peer, epoch, _ = _ext.module().allreduce_status(self._buf.status)
        if code:
            self._failed = AllreduceTimeout(timeout_message(self.rank, peer, epoch, self.timeout_s))
            raise self._failed

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        # Contract: x float32/float16/bfloat16, contiguous, <= capacity bytes, on this communicator's GPU.
        check_input(x, self.max_bytes)
        if x.device != self.device:
            raise ValueError(f"allreduce: x is on {x.device}, this communicator lives on {self.device}")
        self.check()
        if not _ext.use_kernel(x):
            return self._reference(x)
        if x.data_ptr() % 16:
            x = x.clone()  # the kernel moves 16-byte vectors
        out = torch.empty_like(x)
        self._plan.launch(x.data_ptr(), out.data_ptr(), x.numel(), DTYPE_CODE[x.dtype], _ext.stream_ptr(x.device))
        return out

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # TWINSPARK_FORCE_REFERENCE: gather every rank's tensor through torch.distributed, sum in rank order.
        if self._group is None:
            raise AllreduceError(
                "allreduce: TWINSPARK_FORCE_REFERENCE needs a torch.distributed group for the ipc transport; "
                "make it with IpcTransport.from_group, or unset TWINSPARK_FORCE_REFERENCE"
            )
        import torch.distributed as dist

        from twinspark.reference.allreduce import allreduce as reference_allreduce

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self._group)
        return reference_allreduce(parts)

    def close(self) -> None:
        if self._buf is not None:
            torch.cuda.synchronize(self.device)
            self._buf.close()
            self._buf = None
