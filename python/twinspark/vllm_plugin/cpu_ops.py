"""Optional decoded serving mode of the plugin (TWINSPARK_EXL3_DECODED=1): EXL3 layers whose W_hat was decoded
once at load.

Why: without CUDA kernels, twinspark.ops' references decode every 16x16 tile on every call (about 40 ms for one
256x256 K=4 layer on this machine's cores; about 0.4 s per generated token of the tiny model against 0.04 s
decoded). In this mode the plugin decodes W_hat once with
``torch.ops.twinspark.exl3_reconstruct`` (bit-exact) and runs the same factorisation as the reference,
``y = ((((x * suh) Hk) W_hat) Hn) * svh``, in float32, through the two custom ops below (vLLM traces ``apply`` with
torch.compile: both have fake implementations and never read tensor data on the traced path).

    twinspark::exl3_decoded_linear(x [T, k], w_hat f32 [k, n], suh f16 [k], svh f16 [n]) -> [T, n] (x.dtype)
    twinspark::exl3_decoded_moe(x [T, H], topk_ids int [T, top_k], topk_weights [T, top_k],
                                w13_hat f32 [E, 2, H, I], w2_hat f32 [E, I, H], suh13 [E, 2, H], svh13 [E, 2, I],
                                suh2 [E, I], svh2 [E, H], first_expert, limit) -> [T, H] (x.dtype), SiLU(gate)*up
"""

from __future__ import annotations

import torch

from twinspark.exl3.reference import hadamard_128


def _had(a: torch.Tensor) -> torch.Tensor:
    """a @ blockdiag(H128/sqrt(128)) along the last dim (multiple of 128)."""
    shape = a.shape
    return (a.reshape(*shape[:-1], shape[-1] // 128, 128) @ hadamard_128(a.device, a.dtype)).reshape(shape)


def decoded_linear_f32(x: torch.Tensor, w_hat: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    a = _had(x.to(torch.float32) * suh.to(torch.float32))
    return _had(a @ w_hat) * svh.to(torch.float32)


@torch.library.custom_op("twinspark::exl3_decoded_linear", mutates_args=())
def exl3_decoded_linear(x: torch.Tensor, w_hat: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    # Contract: x float [T, k]; w_hat float32 [k, n] (k, n multiples of 128); suh [k]; svh [n]; same device.
    if x.dim() != 2 or w_hat.dim() != 2 or x.shape[1] != w_hat.shape[0]:
        raise ValueError(f"exl3_decoded_linear: expected x [T, {w_hat.shape[0]}] and w_hat 2-D, got x "
                         f"{list(x.shape)} and w_hat {list(w_hat.shape)}")
    return decoded_linear_f32(x, w_hat, suh, svh).to(x.dtype)


@exl3_decoded_linear.register_fake
def _(x, w_hat, suh, svh):
    return x.new_empty(x.shape[0], w_hat.shape[1])


@torch.library.custom_op("twinspark::exl3_decoded_moe", mutates_args=())
def exl3_decoded_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_hat: torch.Tensor,
                     w2_hat: torch.Tensor, suh13: torch.Tensor, svh13: torch.Tensor, suh2: torch.Tensor,
                     svh2: torch.Tensor, first_expert: int, limit: float | None) -> torch.Tensor:
    # Contract: x float [T, H]; topk_ids int [T, top_k] global ids (others' experts and -1 add nothing);
    # topk_weights float [T, top_k]; decoded experts as in the module docstring.
    num_experts = w13_hat.shape[0]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local = topk_ids.to(torch.int64) - first_expert
    valid = (local >= 0) & (local < num_experts)
    w = topk_weights.to(torch.float32)
    for e in torch.unique(local[valid]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        xe = x[tok]
        gate = decoded_linear_f32(xe, w13_hat[e, 0], suh13[e, 0], svh13[e, 0])
        up = decoded_linear_f32(xe, w13_hat[e, 1], suh13[e, 1], svh13[e, 1])
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        y = decoded_linear_f32(torch.nn.functional.silu(gate) * up, w2_hat[e], suh2[e], svh2[e])
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
    return out.to(x.dtype)


@exl3_decoded_moe.register_fake
def _(x, topk_ids, topk_weights, w13_hat, w2_hat, suh13, svh13, suh2, svh2, first_expert, limit):
    return torch.empty_like(x)


def decode(trellis: torch.Tensor, K: float, codebook: str) -> torch.Tensor:
    """W_hat float32 [k, n] through the bit-exact reconstruct op (fp16 out is exact)."""
    return torch.ops.twinspark.exl3_reconstruct(trellis, float(K), codebook, torch.float16).to(torch.float32)


def use_decoded(device) -> bool:
    """True when the plugin serves from W_hat decoded at load (TWINSPARK_EXL3_DECODED=1: a faster CPU mode for
    demos and A/B checks). Default: every layer runs through twinspark.ops (exl3_gemm, exl3_moe), the CUDA
    kernels on a GPU and their PyTorch references elsewhere."""
    import os

    return os.environ.get("TWINSPARK_EXL3_DECODED", "") not in ("", "0", "false", "False")
