"""Reference for twinspark.ops.exl3_moe: a pure-PyTorch loop over the experts with dequantized weights.

    out[t] = sum_j  w[t, j] * down_e( act( gate_e(x[t]), up_e(x[t]) ) ),   e = topk_ids[t, j] - first_expert

over the pairs whose e is one of this rank's experts (0 <= e < E); other ids (other ranks' experts, negative ids)
contribute nothing. act = SiLU(gate) * up; with ``limit`` gate is clamped to <= limit and up to [-limit, limit]
first (the "SwiGLU limit" of DeepSeek V4 / gpt-oss). Everything in float32; the result is rounded once to x's dtype.
Runs on the CPU and the GPU.
"""

from __future__ import annotations

import torch

from twinspark.moe_layout import DOWN, GATE, UP, Exl3MoeExperts

ACTIVATIONS = ("silu",)


def act(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", limit: float | None = None) -> torch.Tensor:
    """SiLU(gate) * up in float32, with the optional clamp."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"exl3_moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def exl3_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3MoeExperts,
             activation: str = "silu", limit: float | None = None) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32), topk_ids [T, top_k] int, topk_weights [T, top_k] -> [T, H] in x's dtype."""
    T = x.shape[0]
    xf = x.to(torch.float32)
    out = torch.zeros(T, experts.hidden, dtype=torch.float32, device=x.device)
    local = topk_ids.to(torch.int64) - experts.first_expert
    valid = (local >= 0) & (local < experts.num_experts)
    w = topk_weights.to(torch.float32)
    for e in torch.unique(local[valid]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)  # a token may list e twice: each pair counts
        xe = xf[tok]
        g = xe @ experts.layer(e, GATE).weight()
        u = xe @ experts.layer(e, UP).weight()
        y = act(g, u, activation, limit) @ experts.layer(e, DOWN).weight()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
    return out.to(x.dtype)
