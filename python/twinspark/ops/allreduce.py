"""twinspark.ops.allreduce: the sum of ``x`` over the ranks of a communicator, as a torch op
(``twinspark::allreduce``) so torch.compile and CUDA graphs see one opaque call.

Which transport runs is the communicator's choice (crossover table by size); inside a transport the kernel vs
reference decision goes through ``twinspark._ext.use_kernel`` (CPU tensors and TWINSPARK_FORCE_REFERENCE=1 take
``twinspark.reference.allreduce`` over the same buffers)."""

from __future__ import annotations

import torch

from twinspark.allreduce.base import check_input
from twinspark.allreduce.communicator import Communicator, lookup


@torch.library.custom_op("twinspark::allreduce", mutates_args=())
def _allreduce(x: torch.Tensor, comm_id: int) -> torch.Tensor:
    return lookup(comm_id).allreduce(x)


@_allreduce.register_fake
def _(x, comm_id):
    return torch.empty_like(x)


def allreduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum of ``x`` over every rank of ``comm`` (out of place).

    Args:
        x: contiguous float32 / float16 / bfloat16 tensor of any shape; the same shape and dtype on every rank,
            the calls in the same order on every rank.
        comm: a :class:`twinspark.allreduce.Communicator` (``twinspark.allreduce.create(group)``).
    Returns:
        A new tensor like ``x``; with the one-shot transports, fp32 accumulation in rank order, bit-identical on
        every rank.
    """
    check_input(x, None)
    return _allreduce(x, comm.id)
