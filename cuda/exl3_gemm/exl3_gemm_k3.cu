// EXL3 GEMM kernels for K = 3 bits, all codebooks: small-m (1/2/4/8 token groups), fused large-m (sm_90a) and
// fused mma.sync prefill (every arch).
// One translation unit per rate so the rates compile in parallel.
#include "exl3_gemm/fused_mma.cuh"
#include "exl3_gemm/fused_sm90.cuh"
#include "exl3_gemm/small_m.cuh"

TWINSPARK_EXL3_GEMM_DEFINE(3)
TWINSPARK_EXL3_GEMM_FUSED_DEFINE(3)
TWINSPARK_EXL3_GEMM_FUSED_MMA_DEFINE(3)
