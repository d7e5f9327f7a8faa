"""One EXL3 linear layer in memory, and random valid layers for tests and benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from twinspark.exl3 import reference as ref


@dataclass(frozen=True)
class Exl3Layer:
    """trellis int16 [k/16, n/16, W]; suh fp16 [k]; svh fp16 [n]; optional bias fp16 [n]; y = x @ W + bias."""

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    K: float
    codebook: str
    bias: torch.Tensor | None = None
    name: str = ""

    @property
    def k(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def n(self) -> int:
        return self.trellis.shape[1] * 16

    def to(self, device) -> Exl3Layer:
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, trellis=mv(self.trellis), suh=mv(self.suh), svh=mv(self.svh), bias=mv(self.bias))

    def weight(self) -> torch.Tensor:
        """The full float32 weight [k, n] (reference math)."""
        return ref.weight(self.trellis, self.suh, self.svh, self.K, self.codebook)


def random_trellis(tiles_k: int, tiles_n: int, K: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random valid trellis: every bit pattern is valid, so random int16 words are (spec section 5)."""
    w = ref.words_per_tile(K)
    return torch.randint(-32768, 32768, (tiles_k, tiles_n, w), dtype=torch.int16, generator=generator)


def random_layer(k: int, n: int, K: float, codebook: str = "mul1", bias: bool = False,
                 generator: torch.Generator | None = None, device=None, scale: float = 1.0) -> Exl3Layer:
    """A valid random layer; suh/svh of magnitude ~ 1/sqrt(k) with random signs keep outputs in range."""
    if k % 16 or n % 16:
        raise ValueError(f"random_layer: k and n must be multiples of 16, got {k}x{n}")
    g = generator
    trellis = random_trellis(k // 16, n // 16, K, g)
    sign = lambda m: torch.randint(0, 2, (m,), generator=g).float() * 2 - 1  # noqa: E731
    mag = lambda m: 0.75 + 0.5 * torch.rand(m, generator=g)  # noqa: E731
    suh = (sign(k) * mag(k) * scale / math.sqrt(k)).half()
    svh = (sign(n) * mag(n)).half()
    b = (torch.randn(n, generator=g) * 0.1).half() if bias else None
    layer = Exl3Layer(trellis, suh, svh, float(K), codebook, b)
    return layer.to(device) if device is not None else layer
