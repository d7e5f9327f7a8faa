"""Connecting the ranks: a full mesh of TCP sockets (the TCP backend's data path, and the RDMA backend's
side channel), and the exchange of CUDA IPC handles. Addresses come from the caller or a torch.distributed store.
"""

from __future__ import annotations

import socket
import struct
import time

_HELLO = struct.Struct("!II")  # (magic, rank) sent by the connecting side
_MAGIC = 0x7453_4152  # "tSAR"


def _unreachable(rank: int, peer: int, addr: tuple[str, int], timeout_s: float, why: str) -> ConnectionError:
    return ConnectionError(
        f"allreduce: rank {rank} could not connect to rank {peer} at {addr[0]}:{addr[1]} within {timeout_s:g} s "
        f"({why}); start every rank, and check the address and that the port is open between the hosts"
    )


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on host:port (port 0: any free port)."""
    srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)
    return srv


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small partials must not wait for Nagle
    sock.setblocking(True)
    return sock


def tcp_mesh(rank: int, world: int, server: socket.socket, addrs: list[tuple[str, int]],
             timeout_s: float = 30.0) -> list[socket.socket | None]:
    """Connect every pair of ranks once: rank j connects to each i < j (addrs[i]) and accepts each k > j on
    ``server``. Returns one connected socket per rank, None at this rank's index."""
    socks: list[socket.socket | None] = [None] * world
    deadline = time.monotonic() + timeout_s
    for peer in range(rank):
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _unreachable(rank, peer, addrs[peer], timeout_s, last)
            try:
                s = socket.create_connection(addrs[peer], timeout=min(left, 2.0))
                s.sendall(_HELLO.pack(_MAGIC, rank))
                socks[peer] = _tune(s)
                break
            except OSError as exc:  # refused until the peer listens: retry until the deadline
                last = exc.strerror or str(exc)
                time.sleep(0.05)
    server.settimeout(0.2)
    while any(socks[k] is None for k in range(rank + 1, world)):
        if time.monotonic() > deadline:
            missing = [k for k in range(rank + 1, world) if socks[k] is None]
            raise ConnectionError(
                f"allreduce: rank {rank} waited {timeout_s:g} s for ranks {missing} to connect to "
                f"{server.getsockname()[0]}:{server.getsockname()[1]}; start every rank and check this address "
                "is reachable from them"
            )
        try:
            s, _ = server.accept()
        except TimeoutError:
            continue
        s.settimeout(max(0.1, deadline - time.monotonic()))
        magic, peer = _HELLO.unpack(_recv_exact(s, _HELLO.size))
        if magic != _MAGIC or not rank < peer < world or socks[peer] is not None:
            s.close()  # not one of ours (a port scan, a stale rank): ignore it
            continue
        socks[peer] = _tune(s)
    return socks


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("allreduce: a peer closed the connection during set-up")
        buf += chunk
    return buf


def store_mesh(store, rank: int, world: int, host: str, tag: str = "default", port: int = 0,
               timeout_s: float = 60.0) -> list[socket.socket | None]:
    """``tcp_mesh`` with addresses swapped through a torch.distributed Store (keys under twinspark/allreduce/)."""
    server = listen(host, port)
    try:
        name, bound = server.getsockname()[:2]
        store.set(f"twinspark/allreduce/{tag}/{rank}", f"{name} {bound}")
        addrs = []
        for r in range(world):
            h, p = store.get(f"twinspark/allreduce/{tag}/{r}").decode().split()
            addrs.append((h, int(p)))
        return tcp_mesh(rank, world, server, addrs, timeout_s)
    finally:
        server.close()


def all_gather_bytes(group, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` through torch.distributed (any backend), in rank order of ``group``."""
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, payload, group=group)
    return [bytes(o) for o in out]  # type: ignore[arg-type]
