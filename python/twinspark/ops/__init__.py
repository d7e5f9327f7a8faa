"""Torch ops: each is a ``torch.library.custom_op`` under ``twinspark::`` with a fake (meta) implementation,
dispatching to the CUDA kernel or to ``twinspark.reference.<op>`` through ``twinspark._ext.use_kernel``."""

from twinspark.ops.exl3_reconstruct import exl3_reconstruct

__all__ = ["exl3_reconstruct"]
