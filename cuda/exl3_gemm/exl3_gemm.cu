// exl3_gemm launchers: the per-rate dispatch of the small-m kernel, and the two helper kernels of the large-m
// path (x' = H(x ⊙ suh) in fp16 before a dense fp16 matmul on W_hat; Hn, svh and bias after it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/pdl.cuh"
#include "exl3/hadamard.cuh"
#include "exl3_gemm/exl3_gemm.h"

namespace twinspark {
namespace {

// One warp per (row, 128-column block): 8 warps per block. Grouped (exl3_gemm_grouped's x' prep, row-major):
// blockIdx.y is the matrix, its x x_gstride elements after the previous one's, suh [mats, k], xh [mats, rows, k].
template <bool kGrouped>
__global__ void __launch_bounds__(256)
    prep_x_kernel(const void* __restrict__ x, long x_stride, bool bf16, const half* __restrict__ suh, int m, int rows,
                  int k, bool blocked, half* __restrict__ xh, long x_gstride) {
  pdl_launch_dependents();  // the fused GEMM after it may start fetching weights (common/pdl.cuh)
  if constexpr (kGrouped) {
    x = static_cast<const char*>(x) + blockIdx.y * x_gstride * 2;
    suh += static_cast<long>(blockIdx.y) * k;
    xh += static_cast<long>(blockIdx.y) * rows * k;
  }
  const int lane = threadIdx.x & 31;
  const long item = static_cast<long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int blocks = k >> 7;
  if (item >= static_cast<long>(rows) * blocks) return;
  const long row = item / blocks;
  const int c = static_cast<int>(item - row * blocks);
  float v[4] = {0.f, 0.f, 0.f, 0.f}, s[4];
  if (row < m) {  // rows m..rows-1: zero padding of the blocked layout's last token group
    exl3::load4(static_cast<const char*>(x) + (row * x_stride + 128 * c + 4 * lane) * 2, bf16, v);
    exl3::load4_half(suh + 128 * c + 4 * lane, s);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] *= s[e];
    exl3::hadamard128_warp(v, lane);
  }
  const int col = 128 * c + 4 * lane;
  // blocked: [k/64][rows][64] with the 16-byte pieces of each 128-byte row XOR-permuted by row % 8 (the wgmma
  // 128-byte swizzle; fused_sm90.cuh: one chunk of a token range is one contiguous copy); else row-major [rows, k]
  const long idx =
      blocked ? (static_cast<long>(col >> 6) * rows + row) * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7)
              : row * k + col;
  exl3::store4(xh + idx, false, v);
}

__global__ void __launch_bounds__(256)
    epilogue_kernel(const void* __restrict__ y, int splits, const half* __restrict__ svh, const half* __restrict__ bias,
                    int m, int n, void* __restrict__ out, long out_stride, bool bf16) {
  pdl_wait();  // launched with launch_pdl: y comes from the GEMM kernel before it
  const int lane = threadIdx.x & 31;
  const long item = static_cast<long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int blocks = n >> 7;
  if (item >= static_cast<long>(m) * blocks) return;
  const long row = item / blocks;
  const int c = static_cast<int>(item - row * blocks);
  float v[4], sv[4], bs[4] = {0.f, 0.f, 0.f, 0.f};
  const long at = row * n + 128 * c + 4 * lane;
  if (splits == 0) {
    exl3::load4_half(static_cast<const half*>(y) + at, v);
  } else {  // fp32 partials of a split-k fused GEMM
    v[0] = v[1] = v[2] = v[3] = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float4 q =
          *reinterpret_cast<const float4*>(static_cast<const float*>(y) + s * static_cast<long>(m) * n + at);
      v[0] += q.x, v[1] += q.y, v[2] += q.z, v[3] += q.w;
    }
  }
  exl3::load4_half(svh + 128 * c + 4 * lane, sv);
  if (bias) exl3::load4_half(bias + 128 * c + 4 * lane, bs);
  exl3::hadamard128_warp(v, lane);
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = v[e] * sv[e] + bs[e];
  exl3::store4(static_cast<char*>(out) + (row * out_stride + 128 * c + 4 * lane) * 2, bf16, v);
}

bool small_args_ok(const Exl3GemmSmallArgs& a, int groups) {
  return !(a.m < 1 || a.m > 8 * groups || a.k % 128 || a.n % 128 || a.splits < 1 || a.chunks_per_split < 1 ||
           a.x_stride % 4 || a.out_stride % 4 || (a.splits - 1) * a.chunks_per_split >= a.k / 128);
}

}  // namespace

cudaError_t exl3_gemm_small(const Exl3GemmSmallArgs& a, int K, int codebook, int groups, cudaStream_t stream) {
  if (!small_args_ok(a, groups)) return cudaErrorInvalidValue;
  if (a.xh) {
    const cudaError_t err = exl3_gemm_prep_x(a.x, a.x_stride, a.bf16, a.suh, a.m, a.k, a.xh, stream);
    if (err != cudaSuccess) return err;
  }
  switch (K) {
    case 1:
      return exl3_gemm_small_k1(a, codebook, groups, stream);
    case 2:
      return exl3_gemm_small_k2(a, codebook, groups, stream);
    case 3:
      return exl3_gemm_small_k3(a, codebook, groups, stream);
    case 4:
      return exl3_gemm_small_k4(a, codebook, groups, stream);
    case 5:
      return exl3_gemm_small_k5(a, codebook, groups, stream);
    case 6:
      return exl3_gemm_small_k6(a, codebook, groups, stream);
    case 7:
      return exl3_gemm_small_k7(a, codebook, groups, stream);
    case 8:
      return exl3_gemm_small_k8(a, codebook, groups, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t exl3_gemm_grouped(const Exl3GemmGroupedArgs& g, int K, int codebook, int groups, cudaStream_t stream) {
  const Exl3GemmSmallArgs& a = g.a;
  if (!small_args_ok(a, groups) || g.mats < 1 || g.mats > 65535 || g.x_gstride % 4 || g.out_gstride % 4) {
    return cudaErrorInvalidValue;
  }
  if (a.xh) {  // x' of every matrix, [mats, m, k]
    const long items = static_cast<long>(a.m) * (a.k / 128);
    prep_x_kernel<true><<<dim3(static_cast<unsigned>((items + 7) / 8), g.mats), 256, 0, stream>>>(
        a.x, a.x_stride, a.bf16, static_cast<const half*>(a.suh), a.m, a.m, a.k, false, static_cast<half*>(a.xh),
        g.x_gstride);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  switch (K) {
    case 1:
      return exl3_gemm_grouped_k1(g, codebook, groups, stream);
    case 2:
      return exl3_gemm_grouped_k2(g, codebook, groups, stream);
    case 3:
      return exl3_gemm_grouped_k3(g, codebook, groups, stream);
    case 4:
      return exl3_gemm_grouped_k4(g, codebook, groups, stream);
    case 5:
      return exl3_gemm_grouped_k5(g, codebook, groups, stream);
    case 6:
      return exl3_gemm_grouped_k6(g, codebook, groups, stream);
    case 7:
      return exl3_gemm_grouped_k7(g, codebook, groups, stream);
    case 8:
      return exl3_gemm_grouped_k8(g, codebook, groups, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t exl3_gemm_dequant_w(const int16_t* trellis, const void* suh, const void* svh, int k, int n, int K,
                                int codebook, bool bf16, void* w, cudaStream_t stream) {
  if (k % 128 || n % 128 || k <= 0 || n <= 0) return cudaErrorInvalidValue;
  const int tk = k / 16, tn = n / 16;
  switch (K) {
    case 1:
      return exl3_gemm_dequant_w_k1(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 2:
      return exl3_gemm_dequant_w_k2(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 3:
      return exl3_gemm_dequant_w_k3(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 4:
      return exl3_gemm_dequant_w_k4(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 5:
      return exl3_gemm_dequant_w_k5(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 6:
      return exl3_gemm_dequant_w_k6(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 7:
      return exl3_gemm_dequant_w_k7(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    case 8:
      return exl3_gemm_dequant_w_k8(trellis, suh, svh, tk, tn, codebook, bf16, w, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t exl3_gemm_capture_id(cudaStream_t stream, unsigned long long* id) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long cid = 0;
  const cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, &cid);
  *id = status == cudaStreamCaptureStatusActive ? cid : 0;
  return err;
}

cudaError_t exl3_gemm_prep_x(const void* x, long x_stride, bool bf16, const void* suh, int m, int k, void* xh,
                             cudaStream_t stream) {
  if (m < 1 || k % 128 || x_stride % 4) return cudaErrorInvalidValue;
  const long items = static_cast<long>(m) * (k / 128);
  prep_x_kernel<false><<<static_cast<unsigned>((items + 7) / 8), 256, 0, stream>>>(
      x, x_stride, bf16, static_cast<const half*>(suh), m, m, k, false, static_cast<half*>(xh), 0);
  return cudaGetLastError();
}

cudaError_t exl3_gemm_prep_x_blocked(const void* x, long x_stride, bool bf16, const void* suh, int m, int k, void* xb,
                                     cudaStream_t stream) {
  if (m < 1 || k % 128 || x_stride % 4) return cudaErrorInvalidValue;
  const int rows = (m + 7) / 8 * 8;
  const long items = static_cast<long>(rows) * (k / 128);
  prep_x_kernel<false><<<static_cast<unsigned>((items + 7) / 8), 256, 0, stream>>>(
      x, x_stride, bf16, static_cast<const half*>(suh), m, rows, k, true, static_cast<half*>(xb), 0);
  return cudaGetLastError();
}

cudaError_t exl3_gemm_fused(const Exl3GemmFusedArgs& a, int K, int codebook, int block, cudaStream_t stream) {
  if (a.m < 1 || a.k % 128 || a.n % 128 || a.splits < 1 || (block != 0 && block != 2)) return cudaErrorInvalidValue;
  if (a.part) {  // stream-K (block 0): every block gets at least one iteration
    const long iterations = static_cast<long>(a.n / 128) * ((a.m + 255) / 256) * (a.k / 64);
    if (block != 0 || a.splits > iterations || !a.flags) return cudaErrorInvalidValue;
  } else if (a.chunks_per_split < 1 || (a.splits - 1) * a.chunks_per_split >= a.k / 64) {
    return cudaErrorInvalidValue;
  }
  int dev = 0, major = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  if (major != 9) return cudaErrorInvalidDeviceFunction;  // wgmma: sm_90a only
  switch (K) {
    case 1:
      return exl3_gemm_fused_k1(a, codebook, block, stream);
    case 2:
      return exl3_gemm_fused_k2(a, codebook, block, stream);
    case 3:
      return exl3_gemm_fused_k3(a, codebook, block, stream);
    case 4:
      return exl3_gemm_fused_k4(a, codebook, block, stream);
    case 5:
      return exl3_gemm_fused_k5(a, codebook, block, stream);
    case 6:
      return exl3_gemm_fused_k6(a, codebook, block, stream);
    case 7:
      return exl3_gemm_fused_k7(a, codebook, block, stream);
    case 8:
      return exl3_gemm_fused_k8(a, codebook, block, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t exl3_gemm_fused_mma(const Exl3GemmFusedArgs& a, int K, int codebook, int tokens, cudaStream_t stream) {
  if (a.m < 1 || a.k % 128 || a.n % 128 || (tokens != 64 && tokens != 128 && tokens != 256) || a.splits < 1 ||
      a.chunks_per_split < 1 || (a.splits - 1) * a.chunks_per_split >= a.k / 64 || a.m > 65535 * 64) {
    return cudaErrorInvalidValue;
  }
  switch (K) {
    case 1:
      return exl3_gemm_fused_mma_k1(a, codebook, tokens, stream);
    case 2:
      return exl3_gemm_fused_mma_k2(a, codebook, tokens, stream);
    case 3:
      return exl3_gemm_fused_mma_k3(a, codebook, tokens, stream);
    case 4:
      return exl3_gemm_fused_mma_k4(a, codebook, tokens, stream);
    case 5:
      return exl3_gemm_fused_mma_k5(a, codebook, tokens, stream);
    case 6:
      return exl3_gemm_fused_mma_k6(a, codebook, tokens, stream);
    case 7:
      return exl3_gemm_fused_mma_k7(a, codebook, tokens, stream);
    case 8:
      return exl3_gemm_fused_mma_k8(a, codebook, tokens, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t exl3_gemm_epilogue(const void* y, int splits, const void* svh, const void* bias, int m, int n, void* out,
                               long out_stride, bool bf16, cudaStream_t stream) {
  if (m < 1 || n % 128 || out_stride % 4 || splits < 0) return cudaErrorInvalidValue;
  const long items = static_cast<long>(m) * (n / 128);
  return launch_pdl(epilogue_kernel, dim3(static_cast<unsigned>((items + 7) / 8)), dim3(256), 0, stream, y, splits,
                    static_cast<const half*>(svh), static_cast<const half*>(bias), m, n, out, out_stride, bf16);
}

}  // namespace twinspark
