"""Errors of the all-reduce transports. Each message is one sentence that says what to do."""

from __future__ import annotations


class AllreduceError(RuntimeError):
    """A communicator failed; it is unusable afterwards (epochs of the ranks no longer agree)."""


class AllreduceTimeout(AllreduceError, TimeoutError):
    """A peer never arrived within the communicator's timeout."""


class PeerFailed(AllreduceError):
    """The proxy lost its connection to a peer (the peer process died, or the network dropped)."""


def timeout_message(rank: int, peer: int, epoch: int, timeout_s: float) -> str:
    return (
        f"allreduce: rank {rank} waited {timeout_s:g} s in call {epoch} for rank {peer}, which never arrived; "
        "make every rank call allreduce in the same order (or raise timeout_s if a peer is just slow), "
        "then create a new communicator"
    )
