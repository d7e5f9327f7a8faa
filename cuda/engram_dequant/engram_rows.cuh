// Device code shared by engram_dequant and engram_gather: one Engram row is 256 fp8 e4m3 values plus 8 E8M0
// scale bytes (one per block of 32 values); the bf16 output is value * 2^(s-127). The scale is the float32 whose
// bit pattern is s << 23, except the two codes that pattern gets wrong: s = 0 is 2^-127 (a float32 subnormal) and
// s = 255 is NaN (E8M0 has no infinity), as torch.float8_e8m0fnu and the OCP MX spec define them.
// Exactness: e4m3 -> f16 is exact, f16 -> f32 is exact, multiplying by a power of two is exact in f32 except at
// f32 underflow (rounded to nearest even, as torch does on the CPU), and f32 -> bf16 rounds to nearest even,
// which is exact whenever the product is a normal bf16 (3 mantissa bits fit in 7).
//
// Work split: a thread owns 16 consecutive values of a row (one 16-byte load, two 16-byte stores of bf16), so
// 16 threads cover a row and a warp covers 2 rows; consecutive threads touch consecutive bytes (coalesced).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {
namespace engram {

constexpr int kRowValues = 256;   // fp8 values per row
constexpr int kScalesPerRow = 8;  // one E8M0 byte per 32 values
constexpr int kThreadsPerRow = 16;
constexpr int kThreads = 256;  // threads per block: 16 rows per block

// 16 bytes of the table, read once: bypass L1 (rows are gathered at random and never reused in the kernel).
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Four fp8 e4m3 (one 32-bit word) times `scale` -> four bf16 (two 32-bit words).
__device__ __forceinline__ uint2 dequant4(uint32_t w, float scale) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo));
  const float2 b = __half22float2(__half2(hi));
  const __nv_bfloat162 x = __floats2bfloat162_rn(a.x * scale, a.y * scale);
  const __nv_bfloat162 y = __floats2bfloat162_rn(b.x * scale, b.y * scale);
  uint2 out;
  out.x = *reinterpret_cast<const uint32_t*>(&x);
  out.y = *reinterpret_cast<const uint32_t*>(&y);
  return out;
}

// Rows `src(i)` of (weight, scale) -> out row i, i < n. src(i) < 0 means "zero row". Strides in bytes for the
// inputs (weight row stride a multiple of 16) and in elements for out (a multiple of 8); pointers 16-byte aligned.
// IdT: int64_t or int32_t ids; ids == nullptr means row i of the table (plain dequant).
template <typename IdT>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const uint8_t* __restrict__ weight, int64_t weight_stride, const uint8_t* __restrict__ scale,
                int64_t scale_stride, const IdT* __restrict__ ids, int64_t first_row, int64_t table_rows, int64_t n,
                __nv_bfloat16* __restrict__ out, int64_t out_stride) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = t / kThreadsPerRow;
  const int part = static_cast<int>(t % kThreadsPerRow);  // values [16*part, 16*part + 16)
  if (row >= n) return;

  int64_t src = row;
  if (ids != nullptr) {
    // ids outside [first_row, first_row + table_rows) belong to another rank (or are the dead id -1).
    const int64_t id = static_cast<int64_t>(ids[row]);
    src = (id >= first_row && id - first_row < table_rows) ? id - first_row : -1;
  }

  uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
  if (src >= 0) {
    const uint4 q = load_stream(weight + src * weight_stride + part * 16);
    const uint32_t s = __ldg(scale + src * scale_stride + part / 2);
    const float f = __uint_as_float(s == 0 ? 0x00400000u : (s == 255 ? 0x7fc00000u : s << 23));
    const uint2 a = dequant4(q.x, f), b = dequant4(q.y, f), c = dequant4(q.z, f), d = dequant4(q.w, f);
    lo = make_uint4(a.x, a.y, b.x, b.y);
    hi = make_uint4(c.x, c.y, d.x, d.y);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + row * out_stride + part * 16);
  dst[0] = lo;
  dst[1] = hi;
}

// Launch over n rows. Returns cudaErrorInvalidValue when a contract line (alignment, strides) does not hold.
template <typename IdT>
inline cudaError_t launch_rows(const uint8_t* weight, int64_t weight_stride, const uint8_t* scale, int64_t scale_stride,
                               const IdT* ids, int64_t first_row, int64_t table_rows, int64_t n, __nv_bfloat16* out,
                               int64_t out_stride, cudaStream_t stream) {
  if (n < 0 || table_rows < 0 || first_row < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const bool aligned = (reinterpret_cast<uintptr_t>(weight) % 16 == 0) && (weight_stride % 16 == 0) &&
                       (reinterpret_cast<uintptr_t>(out) % 16 == 0) && (out_stride % 8 == 0) &&
                       weight_stride >= kRowValues && scale_stride >= kScalesPerRow && out_stride >= kRowValues;
  if (!aligned) return cudaErrorInvalidValue;
  const int64_t blocks = (n * kThreadsPerRow + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  rows_kernel<IdT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      weight, weight_stride, scale, scale_stride, ids, first_row, table_rows, n, out, out_stride);
  return cudaGetLastError();
}

}  // namespace engram
}  // namespace twinspark
