// Small-m EXL3 GEMM kernels for K = 7 bits (all codebooks, 1/2/4/8 token groups): one translation unit per
// rate so the 96 kernels compile in parallel.
#include "exl3_gemm/small_m.cuh"

TWINSPARK_EXL3_GEMM_DEFINE(7)
