"""The interface every all-reduce transport implements, and the input contract they share."""

from __future__ import annotations

import abc

import torch

from twinspark.reference.allreduce import DTYPES

# Kernel dtype codes (cuda/allreduce/allreduce.h: DType).
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def check_input(x: torch.Tensor, max_bytes: int | None, op: str = "allreduce") -> None:
    """Contract: float32/float16/bfloat16, contiguous, at most ``max_bytes`` bytes (when given)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected x to be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{op}: expected x to be float32, float16 or bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{op}: expected x to be contiguous, got strides {x.stride()} for shape {tuple(x.shape)}")
    nbytes = x.numel() * x.element_size()
    if max_bytes is not None and nbytes > max_bytes:
        raise ValueError(
            f"{op}: x has {nbytes} bytes, more than this communicator's capacity {max_bytes}; "
            "create it with a larger capacity or route larger tensors to NCCL"
        )


class Transport(abc.ABC):
    """One rank's end of an all-reduce among ``world`` ranks.

    ``allreduce(x)`` returns a new tensor, the sum over ranks (fp32 accumulation in rank order for the one-shot
    transports). Every rank must call it with the same shape and dtype in the same order. Calls run back to back
    without host synchronisation; a failure of a peer surfaces as :class:`AllreduceError` at the latest on the
    next call or on :meth:`check`.
    """

    name: str = "?"
    rank: int
    world: int
    max_bytes: int | None = None  # None: any size

    @abc.abstractmethod
    def allreduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def check(self) -> None:  # noqa: B027  (optional override: transports without async failures keep it)
        """Raise the error of an earlier call that failed asynchronously (a no-op when all is well)."""

    def close(self) -> None:  # noqa: B027  (optional override)
        """Release buffers and threads (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
