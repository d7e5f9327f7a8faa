"""Shared fixtures: fresh random generators (with a seed to replay) and the GPU gate.

Seeds: every test that takes ``gen`` gets a torch.Generator seeded fresh for that test, and prints ``seed=N`` (pytest
shows it beside a failure, under "Captured stdout setup"). To replay a failure with the same inputs, give that seed:

    pytest tests/test_exl3_gemm.py::test_kernel_parity --seed N

With ``--seed`` every test that takes ``gen`` gets that seed (run the one test that failed). The GPU tests draw their
inputs on the CPU from ``gen``, so a seed replays them on any machine: the reference part everywhere, the kernel part
on a GPU.

GPU tests (marker gpu) run their reference part everywhere (inputs made from ``gen``, the reference computed and
checked against an independent expectation: the spec decoder of tests/exl3_spec.py, float64 math, invariants) and then
call ``twinspark.testing.need_cuda()``, which skips the kernel part with a reason where there is no CUDA GPU (CI). The
``cuda`` fixture skips a whole test before it starts: only for tests that have no reference part.
"""

from __future__ import annotations

import pytest
import torch
from twinspark.testing import cuda_reason


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None, metavar="N",
                     help="seed every test's `gen` generator with N (replays a failure; the seed is printed per test)")


@pytest.fixture
def cuda():
    """The CUDA device, for a test with no reference part; skips the whole test with a reason when there is none."""
    reason = cuda_reason()
    if reason:
        pytest.skip(reason)
    return torch.device("cuda")


@pytest.fixture
def gen(request):
    """A generator seeded fresh for every test, or with --seed N; the seed is printed, so a failure can be replayed."""
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = torch.randint(0, 2**31 - 1, ()).item()
    print(f"seed={seed} (replay: --seed {seed})")
    return torch.Generator().manual_seed(seed)
