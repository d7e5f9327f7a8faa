"""Torch ops: each is a ``torch.library.custom_op`` under ``twinspark::`` with a fake (meta) implementation,
dispatching to the CUDA kernel or to ``twinspark.reference.<op>`` through ``twinspark._ext.use_kernel``."""

from twinspark.ops.allreduce import allreduce
from twinspark.ops.engram_dequant import engram_dequant
from twinspark.ops.engram_gather import engram_gather
from twinspark.ops.exl3_gemm import exl3_gemm
from twinspark.ops.exl3_gemm_grouped import exl3_gemm_grouped
from twinspark.ops.exl3_moe import exl3_moe
from twinspark.ops.exl3_reconstruct import exl3_reconstruct

__all__ = ["allreduce", "engram_dequant", "engram_gather", "exl3_gemm", "exl3_gemm_grouped", "exl3_moe",
           "exl3_reconstruct"]
