// 128-point Hadamard transforms of activations, one warp per 128 values (exl3-format.md §4):
// lane L holds elements 4L..4L+3 in fp32; bits 0-1 of the index are butterflies inside the lane, bits 2-6 are
// warp shuffles (xor 1..16). Natural (Sylvester) order, scaled by 1/sqrt(128): H[i, j] = (-1)^popcount(i & j).
// Also: 4-element fp16/bf16 loads and stores used around it (8 bytes per lane, coalesced across the warp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace twinspark {
namespace exl3 {

__device__ __forceinline__ void hadamard128_warp(float (&v)[4], int lane) {
  const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2, v[1] = a1 + a3, v[2] = a0 - a2, v[3] = a1 - a3;
#pragma unroll
  for (int b = 1; b < 32; b <<= 1) {
    const bool upper = lane & b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float o = __shfl_xor_sync(0xFFFFFFFFu, v[i], b);
      v[i] = upper ? o - v[i] : v[i] + o;
    }
  }
  constexpr float kScale = 0.08838834764831845f;  // 1/sqrt(128)
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kScale;
}

// Four 16-bit floats packed in a uint2 (element 0 in the low half of .x) -> fp32.
__device__ __forceinline__ void unpack4(const uint2 u, bool bf16, float (&v)[4]) {
  if (bf16) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
}

// Four consecutive 16-bit floats (8-byte aligned) -> fp32.
__device__ __forceinline__ void load4(const void* p, bool bf16, float (&v)[4]) {
  unpack4(*reinterpret_cast<const uint2*>(p), bf16, v);
}

__device__ __forceinline__ void load4_half(const void* p, float (&v)[4]) { load4(p, false, v); }

__device__ __forceinline__ void store4(void* p, bool bf16, const float (&v)[4]) {
  uint2 u;
  if (bf16) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    u.x = *reinterpret_cast<const uint32_t*>(&lo), u.y = *reinterpret_cast<const uint32_t*>(&hi);
  } else {
    const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
    u.x = *reinterpret_cast<const uint32_t*>(&lo), u.y = *reinterpret_cast<const uint32_t*>(&hi);
  }
  *reinterpret_cast<uint2*>(p) = u;
}

}  // namespace exl3
}  // namespace twinspark
