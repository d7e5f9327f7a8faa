// engram_dequant: Engram rows fp8 e4m3 [n, 256] with E8M0 scales [n, 8] -> bf16 [n, 256] (value * 2^(s-127)).
// Contract: weight rows of 256 bytes, row stride `weight_stride` bytes (multiple of 16, >= 256), pointer 16-byte
// aligned; scale rows of 8 bytes, row stride `scale_stride` bytes (>= 8); out bf16 rows of 256, row stride
// `out_stride` elements (multiple of 8, >= 256), pointer 16-byte aligned. n >= 0. Bit-exact with
// twinspark.reference.engram_dequant. Returns cudaErrorInvalidValue when a contract line does not hold.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {

cudaError_t engram_dequant(const uint8_t* weight, int64_t weight_stride, const uint8_t* scale, int64_t scale_stride,
                           int64_t n, void* out, int64_t out_stride, cudaStream_t stream);

}  // namespace twinspark
