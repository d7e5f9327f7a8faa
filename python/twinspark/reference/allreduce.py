"""Reference all-reduce: the sum of every rank's tensor, accumulated in fp32 in rank order 0..world-1 and cast
back to the input dtype. The one-shot kernel does exactly these additions in this order, so it matches this
bit for bit (fp32 addition is exact IEEE arithmetic on both, and both round to the output dtype to nearest even).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def allreduce(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of ``parts`` (one tensor per rank, in rank order; same shape and dtype) in fp32, in rank order.

    Returns a new tensor with the shape, dtype and device of ``parts[0]``.
    """
    if not parts:
        raise ValueError("allreduce reference: expected at least one part, got none")
    first = parts[0]
    for r, p in enumerate(parts):
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ValueError(
                f"allreduce reference: part {r} is {tuple(p.shape)} {p.dtype}, expected "
                f"{tuple(first.shape)} {first.dtype} like part 0"
            )
    if first.dtype not in DTYPES:
        raise TypeError(f"allreduce reference: expected float32, float16 or bfloat16, got {first.dtype}")
    acc = first.to(torch.float32, copy=True)
    for p in parts[1:]:
        acc += p.to(device=acc.device, dtype=torch.float32)
    return acc.to(first.dtype)
