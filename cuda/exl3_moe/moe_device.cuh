// Device helpers of exl3_moe: half-rate tile decode into mma B fragments, mma.sync / ldmatrix / cp.async
// wrappers (whole-rate decode and the Hadamard come from cuda/exl3/). sm_80+ PTX only (no wgmma/tcgen05):
// builds for sm_90a and sm_121a.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "exl3/codebook.cuh"
#include "exl3/decode_tile.cuh"
#include "exl3/hadamard.cuh"

namespace twinspark {
namespace moe {

// ------------------------------------------------------------------------------------------------ tile decode
// Whole rates use exl3::decode_lane (exl3/decode_tile.cuh). Half rates (K + 0.5: odd positions carry one more bit)
// are decoded here. Lane L of a warp owns trellis positions 8L..8L+7, exactly its mma.m16n8k16 B-fragment elements
// (exl3-format.md section 2): pairs 0, 1 -> columns 0..7 (b0, b1), pairs 2, 3 -> columns 8..15.
// The 8 states of a lane lie in ring bits [S(8L) - 16, S(8L+7)): at most 7*KA + 4 + 16 bits. Three consecutive
// ring words (wrapping) starting at the first one always hold them once shifted left by the start offset.

// End bit of position 8L+j relative to that of position 8L: j*KA + floor((j+1)/2).
template <int KA>
__host__ __device__ constexpr int rel_end_half(int j) {
  return j * KA + (j + 1) / 2;
}

// The 8 states (clean 0..65535 values) of this lane's positions 8L..8L+7 at half rate KA + 0.5.
template <int KA>
__device__ __forceinline__ void half_states(const uint32_t* tw, int lane, uint32_t (&s)[8]) {
  constexpr int kWords32 = (16 * KA + 8) / 2;
  constexpr int kRing = kWords32 * 32;
  const int t1 = 8 * lane + 1;
  int st = t1 * KA + (t1 >> 1) - 16;
  if (st < 0) st += kRing;
  const int w0 = st >> 5, off = st & 31;
  const int w1 = (w0 + 1 == kWords32) ? 0 : w0 + 1;
  const int w2 = (w1 + 1 == kWords32) ? 0 : w1 + 1;
  const uint32_t a = tw[w0], m = tw[w1], c = tw[w2];
  uint32_t win[3];
  win[0] = __funnelshift_l(m, a, off);  // upper word of (a:m) << off
  win[1] = __funnelshift_l(c, m, off);
  win[2] = c << off;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int p = rel_end_half<KA>(j);  // compile-time after unrolling
    const int q = p >> 5, r = p & 31;
    s[j] = (r <= 16) ? ((win[q] >> (16 - r)) & 0xFFFFu) : (__funnelshift_l(win[q < 2 ? q + 1 : 2], win[q], r) >> 16);
  }
}

template <int CB, int KA>
__device__ __forceinline__ void decode_tile_half(const uint32_t* tw, int lane, uint32_t b[4]) {
  uint32_t s[8];
  half_states<KA>(tw, lane, s);
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = exl3::decode_pair<CB>(s[2 * i], s[2 * i + 1]);
}

// ------------------------------------------------------------------------------------------------ fragments
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

// mma.m16n8k32 with unsigned 8-bit A, signed 8-bit B and int32 accumulators (sm_80+; the byte-sum path).
__device__ __forceinline__ void mma_u8s8_16832(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t a[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
// The same with the shared-memory address already converted (hoisted out of a loop: the conversion from a generic
// pointer costs a few instructions per copy).
__device__ __forceinline__ void cp_async16_shared(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>  // wait until at most N of this thread's committed groups are pending
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace moe
}  // namespace twinspark
