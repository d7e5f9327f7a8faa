"""Shared fixtures: fresh random generators and the GPU gate (kernel parts skip with a reason)."""

from __future__ import annotations

import pytest
import torch
from twinspark.testing import cuda_reason


@pytest.fixture
def cuda():
    """The CUDA device for a test's kernel part; skips with a reason when there is none."""
    reason = cuda_reason()
    if reason:
        pytest.skip(reason)
    return torch.device("cuda")


@pytest.fixture
def gen():
    """A generator seeded fresh for every test (the seed is printed, so a failure can be replayed)."""
    seed = torch.randint(0, 2**31 - 1, ()).item()
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
