// exl3_reconstruct: EXL3 trellis -> W_hat (the inner weight, before scales and Hadamard transforms).
// Contract: trellis int16 [tiles_k, tiles_n, words16] contiguous, words16 = 16*ka (+8 when half);
// out fp16 or bf16 [16*tiles_k, 16*tiles_n] contiguous row-major; codebook 0=3inst 1=mcg 2=mul1;
// ka 1..8 (half rates: ka 1..3 with half=true). Bit-exact with twinspark.exl3.reference.inner_weight
// (bf16 out = the fp16 value rounded to nearest even).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {

cudaError_t exl3_reconstruct(const int16_t* trellis, int tiles_k, int tiles_n, int ka, bool half, int codebook,
                             void* out, bool out_bf16, cudaStream_t stream);

}  // namespace twinspark
