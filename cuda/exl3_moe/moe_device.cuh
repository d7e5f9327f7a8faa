// Device helpers of exl3_moe: tile decode into mma B fragments, the 128-point Hadamard across a warp,
// mma.sync / ldmatrix / cp.async wrappers. sm_80+ PTX only (no wgmma/tcgen05): builds for sm_90a and sm_121a.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "exl3/codebook.cuh"

namespace twinspark {
namespace moe {

// ------------------------------------------------------------------------------------------------ tile decode
// Lane L of a warp owns trellis positions 8L..8L+7, which are exactly its mma.m16n8k16 B-fragment elements
// (exl3-format.md section 2): j = 0..3 -> columns 0..7 (b0..b3), j = 4..7 -> columns 8..15.
// The 8 states of a lane lie in ring bits [S(8L) - 16, S(8L+7)): at most 7*K + 16 + 4 bits. Three consecutive
// ring words (wrapping) starting at the first one always hold them once shifted left by the start offset: the
// offset is ((8L+1)*KA - 16 + half) mod 32 and offset + 7*KA + 16 (+4) <= 96 for every rate (K = 8: offset is 24,
// 24 + 72 = 96; K = 7: at most 31 + 65 = 96).

// End bit of position t relative to that of position 8L: jKA + floor((j+1)/2) for half rates.
template <int KA, bool HALF>
__host__ __device__ constexpr int rel_end(int j) {
  return j * KA + (HALF ? (j + 1) / 2 : 0);
}

template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == exl3::kCbMul1) {
    // 1024 + byte sum as an fp16 bit pattern: dp4a adds the four bytes onto 0x6400 in one instruction; then one
    // fp16 FMA per value (two in one HFMA2): the single rounding the spec asks for.
    const uint32_t h0 = __dp4a(s0 * 0x83DCD12Du, 0x01010101u, 0x6400u);
    const uint32_t h1 = __dp4a(s1 * 0x83DCD12Du, 0x01010101u, 0x6400u);
    const uint32_t packed = h0 | (h1 << 16);
    const __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&packed), __half2half2(__ushort_as_half(0x1EEE)),
                              __half2half2(__ushort_as_half(0xC931)));
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __halves2half2(exl3::decode_state<CB>(s0), exl3::decode_state<CB>(s1));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Decode one 16x16 tile (its words in shared memory) into this lane's B fragments: b[0], b[1] for columns 0..7,
// b[2], b[3] for columns 8..15.
template <int CB, int KA, bool HALF>
__device__ __forceinline__ void decode_tile(const uint32_t* tw, int lane, uint32_t b[4]) {
  constexpr int kWords32 = (16 * KA + (HALF ? 8 : 0)) / 2;
  constexpr int kRing = kWords32 * 32;
  const int t1 = 8 * lane + 1;
  int st = t1 * KA + (HALF ? (t1 >> 1) : 0) - 16;
  if (st < 0) st += kRing;
  const int w0 = st >> 5, off = st & 31;
  const int w1 = (w0 + 1 == kWords32) ? 0 : w0 + 1;
  const int w2 = (w1 + 1 == kWords32) ? 0 : w1 + 1;
  const uint32_t a = tw[w0], m = tw[w1], c = tw[w2];
  uint32_t win[3];
  win[0] = __funnelshift_l(m, a, off);  // upper word of (a:m) << off
  win[1] = __funnelshift_l(c, m, off);
  win[2] = c << off;
  uint32_t s[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int p = rel_end<KA, HALF>(j);  // compile-time after unrolling
    const int q = p >> 5, r = p & 31;
    s[j] = (r <= 16) ? ((win[q] >> (16 - r)) & 0xFFFFu) : (__funnelshift_l(win[q < 2 ? q + 1 : 2], win[q], r) >> 16);
  }
  b[0] = decode_pair<CB>(s[0], s[1]);
  b[1] = decode_pair<CB>(s[2], s[3]);
  b[2] = decode_pair<CB>(s[4], s[5]);
  b[3] = decode_pair<CB>(s[6], s[7]);
}

// ------------------------------------------------------------------------------------------------ Hadamard
// In-place 128-point Walsh-Hadamard (natural order, unnormalized) of a vector spread over a warp: lane L holds
// elements 4L..4L+3. Index bits 0-1 are inside the lane, bits 2-6 across lanes (xor shuffles).
__device__ __forceinline__ void fwht128(float v[4], int lane) {
  const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2;
  v[1] = a1 + a3;
  v[2] = a0 - a2;
  v[3] = a1 - a3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = lane & m;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float o = __shfl_xor_sync(0xffffffffu, v[q], m);
      v[q] = upper ? (o - v[q]) : (v[q] + o);
    }
  }
}

constexpr float kRsqrt128 = 0.08838834764831845f;

// ------------------------------------------------------------------------------------------------ loads, mma
__device__ __forceinline__ void load4(const void* p, bool bf16, float v[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  if (bf16) {
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  } else {
    const __half2 lo = *reinterpret_cast<const __half2*>(&raw.x);
    const __half2 hi = *reinterpret_cast<const __half2*>(&raw.y);
    const float2 a = __half22float2(lo), b = __half22float2(hi);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  }
}

__device__ __forceinline__ void load4_half(const __half* p, float v[4]) { load4(p, false, v); }

__device__ __forceinline__ uint2 pack4_half(const float v[4]) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
  uint2 r;
  r.x = *reinterpret_cast<const uint32_t*>(&lo);
  r.y = *reinterpret_cast<const uint32_t*>(&hi);
  return r;
}

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t a[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace moe
}  // namespace twinspark
