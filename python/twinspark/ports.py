"""A free TCP port for a server that binds it later, chosen outside the kernel's ephemeral port range.

``bind(0)`` hands out a port from ``net.ipv4.ip_local_port_range``: the range the kernel also uses for every
outgoing connection (ssh, rsync) and for other processes' ``bind(0)`` (vLLM's internal ZMQ and torch.distributed
ports). A port picked that way and released can be taken again before the server binds it, and the server then
fails with "Address already in use" (seen once in CI: the lab deployment's API port). Ports below that range are
handed out only on request, so a free one stays free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000  # lowest port handed out (well above the registered services most hosts run)
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port in [LOW, first ephemeral port) that ``host`` can bind right now."""
    hi = _ephemeral_low()
    lo = LOW if hi > LOW + 1000 else 1024
    rng = random.Random()  # not the global generator: tests seed that one
    for _ in range(tries):
        port = rng.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port in {lo}..{hi - 1} on {host} after {tries} tries; stop some servers or lower "
                  f"the first ephemeral port ({_RANGE})")
