// Fused prefill EXL3 GEMM through mma.sync (every arch; GB10's tensor-core path, which has no wgmma):
// y'[m, n] = x'[m, k] · W_hat[k, n] with the trellis decoded straight into mma.m16n8k16 A fragments, once per
// token tile of 8·TG tokens (64, 128 or 256), never written out.
//
// Orientation as the small kernel: y'^T = W_hat^T · x'^T, a decoded 16x16 tile is the A operand, 8 tokens the N
// side. Block = 8 warps, tile = 128 columns x 8·TG tokens; warp w owns n-tile w and all of the tile's tokens (TG x 4
// fp32 accumulators per lane), so every weight of the strip is decoded once per block and feeds TG mmas, and each
// x' fragment (ldmatrix.x4: 16 tokens x 16 k) feeds 2.
// k runs in 64-row chunks through a 2-3 stage cp.async ring: each warp copies its own n-tile's 4 trellis tiles, the
// block the chunk's x' tile (8·TG tokens x 64 halves, row stride 72 halves: conflict-free ldmatrix); one block
// barrier per chunk. While a k-tile's mmas run, the next k-tile is decoded (two A buffers; the mma asm is not
// volatile, so the compiler interleaves them).
// x' = fp16(Hk(x ⊙ suh)) comes row-major from exl3_gemm_prep_x; tokens past m read row m - 1 (never stored). The
// output is y' fp16 [m, n] (one split) or fp32 partials [splits, m, n]; exl3_gemm_epilogue applies Hn, svh and
// bias (and sums the partials).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include <atomic>

#include "common/pdl.cuh"
#include "exl3/decode_tile.cuh"
#include "exl3_gemm/exl3_gemm.h"
#include "exl3_gemm/small_m.cuh"

namespace twinspark {
namespace exl3_gemm_detail {

constexpr int kMmaXRow = 72;  // halves per token row of a chunk's x' (64 + 8)

__host__ __device__ constexpr int mma_trellis_bytes(int K) { return 4 * 8 * 32 * K; }  // 4 k-tiles x 8 n-tiles
__host__ __device__ constexpr int mma_stage_bytes(int K, int TG) {
  return mma_trellis_bytes(K) + 8 * TG * kMmaXRow * 2;
}
// Three stages where they fit GB10's 99 KB per block, else two.
__host__ __device__ constexpr int mma_stages(int K, int TG) { return 3 * mma_stage_bytes(K, TG) <= 99 * 1024 ? 3 : 2; }
// Blocks per SM the registers are sized for (ops/exl3_gemm.py MMA_TOKENS: 64, 128, 256 tokens).
__host__ __device__ constexpr int mma_min_blocks(int TG) { return TG == 8 ? 3 : TG == 16 ? 2 : 1; }
__host__ __device__ constexpr int mma_smem_bytes(int K, int TG) { return mma_stages(K, TG) * mma_stage_bytes(K, TG); }

// mma_16816 without `volatile`: a pure register operation the compiler may schedule among the decode instructions.
__device__ __forceinline__ void mma_16816_free(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.x4 at a 32-bit shared-memory address: a chunk's one base plus compile-time offsets, which ptxas folds
// into the instruction (a generic pointer per token group cost a register and two instructions each).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <int K, int CB, int TG>
__global__ void __launch_bounds__(256, mma_min_blocks(TG)) fused_mma_kernel(const Exl3GemmFusedArgs a) {
  constexpr int kStages = mma_stages(K, TG);
  constexpr int kStageBytes = mma_stage_bytes(K, TG);
  constexpr int kTokens = 8 * TG;
  extern __shared__ uint4 smem_raw[];
  char* const smem = reinterpret_cast<char*>(smem_raw);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tile0 = blockIdx.x * 8, tok0 = blockIdx.y * kTokens, split = blockIdx.z;
  const int tiles_n = a.n >> 4;
  const int c0 = split * a.chunks_per_split;
  const int nchunks = min(a.k >> 6, c0 + a.chunks_per_split) - c0;
  const half* const xh = static_cast<const half*>(a.xb);
  // This warp's n-tile in the trellis [k/16][n/16][2K uint4], and this thread's x' rows (compile-time trip counts).
  const uint4* const wtiles = reinterpret_cast<const uint4*>(a.trellis) + static_cast<long>(tile0 + warp) * 2 * K;

  // Stage s of chunk c: trellis [4 kt][8 n-tiles][2K uint4] (warp w copies n-tile w), then x' [kTokens][kMmaXRow].
  auto load = [&](int c, int s) {
    uint4* dst = reinterpret_cast<uint4*>(smem + s * kStageBytes);
    constexpr int kWarpVec = 4 * 2 * K, kIters = (kWarpVec + 31) / 32;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = lane + 32 * j;
      if (kWarpVec % 32 == 0 || i < kWarpVec) {
        const int kt = i / (2 * K), v = i - kt * 2 * K;
        cp_async16(dst + (kt * 8 + warp) * 2 * K + v, wtiles + static_cast<long>(4 * c + kt) * tiles_n * 2 * K + v);
      }
    }
    half* xs = reinterpret_cast<half*>(smem + s * kStageBytes + mma_trellis_bytes(K));
#pragma unroll
    for (int j = 0; j < kTokens * 8 / 256; ++j) {
      const int i = threadIdx.x + 256 * j, row = i >> 3, piece = i & 7;
      const int t = min(tok0 + row, a.m - 1);
      cp_async16(xs + row * kMmaXRow + 8 * piece, xh + static_cast<long>(t) * a.k + 64 * c + 8 * piece);
    }
  };

  pdl_wait();  // x' comes from the prep kernel before this one
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load(c0 + s, s);
    cp_async_commit();
  }

  float acc[TG][4];
#pragma unroll
  for (int g = 0; g < TG; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
  const exl3::LaneWindow<K> lw(lane);
  // ldmatrix.x4 rows: matrix mi = lane / 8 is (k half mi & 1, token group + (mi >> 1)), as in the small kernel.
  const int mi = lane >> 3;
  const int x_row = 8 * (mi >> 1) + (lane & 7), x_col = 8 * (mi & 1);

  for (int i = 0; i < nchunks; ++i) {
    cp_async_wait<kStages - 2>();  // chunk i's copies (this thread's) ...
    __syncthreads();               // ... and everyone's; stage (i - 1) % kStages is free again
    if (i + kStages - 1 < nchunks) load(c0 + i + kStages - 1, (i + kStages - 1) % kStages);
    cp_async_commit();

    const char* st = smem + (i % kStages) * kStageBytes;
    const uint32_t* tr = reinterpret_cast<const uint32_t*>(st) + warp * 8 * K;
    const half* xs = reinterpret_cast<const half*>(st + mma_trellis_bytes(K));
    uint32_t afrag[2][4];
    auto decode = [&](int kt, uint32_t (&f)[4]) {
      uint32_t p[4];
      exl3::decode_lane<K, CB>(tr + kt * 8 * 8 * K, lw, p);
      f[0] = p[0], f[1] = p[2], f[2] = p[1], f[3] = p[3];
    };
    decode(0, afrag[0]);
    const uint32_t xbase = static_cast<uint32_t>(__cvta_generic_to_shared(xs + x_row * kMmaXRow + x_col));
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (kt < 3) decode(kt + 1, afrag[(kt + 1) & 1]);
#pragma unroll
      for (int g = 0; g < TG; g += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(xbase + (8 * g * kMmaXRow + 16 * kt) * 2, b0, b1, b2, b3);
        mma_16816_free(acc[g], afrag[kt & 1], b0, b1);
        mma_16816_free(acc[g + 1], afrag[kt & 1], b2, b3);
      }
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();  // the epilogue's blocks may launch as this grid's blocks finish

  // C fragment: rows (n) lane/4 and lane/4 + 8 of the n-tile; columns (tokens) 8g + 2 (lane % 4) + {0, 1}.
  const bool partial = a.splits > 1;
  const int col = 16 * (tile0 + warp) + (lane >> 2);
#pragma unroll
  for (int g = 0; g < TG; ++g) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = tok0 + 8 * g + 2 * (lane & 3) + e;
      if (t >= a.m) continue;
      const long at = static_cast<long>(t) * a.n + col;
      if (partial) {
        float* y = static_cast<float*>(a.y) + static_cast<long>(split) * a.m * a.n;
        y[at] = acc[g][e];
        y[at + 8] = acc[g][2 + e];
      } else {
        half* y = static_cast<half*>(a.y);
        y[at] = __float2half_rn(acc[g][e]);
        y[at + 8] = __float2half_rn(acc[g][2 + e]);
      }
    }
  }
}

template <int K, int CB, int TG>
cudaError_t launch_fused_mma(const Exl3GemmFusedArgs& a, cudaStream_t stream) {
  constexpr int smem = mma_smem_bytes(K, TG);
  static_assert(smem <= 99 * 1024, "GB10: at most 99 KB of shared memory per block");
  static std::atomic<uint64_t> raised{0};  // one bit per device (as launch_small)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (!(raised.load(std::memory_order_acquire) >> (dev & 63) & 1)) {
    err = cudaFuncSetAttribute(fused_mma_kernel<K, CB, TG>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    raised.fetch_or(uint64_t{1} << (dev & 63), std::memory_order_acq_rel);
  }
  const dim3 grid(a.n / 128, (a.m + 8 * TG - 1) / (8 * TG), a.splits);
  return launch_pdl(fused_mma_kernel<K, CB, TG>, grid, dim3(256), smem, stream, a);
}

template <int K>
cudaError_t launch_fused_mma_k(const Exl3GemmFusedArgs& a, int codebook, int tokens, cudaStream_t stream) {
  return exl3::with_codebook(codebook, [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
    return tokens == 256   ? launch_fused_mma<K, CB, 32>(a, stream)
           : tokens == 128 ? launch_fused_mma<K, CB, 16>(a, stream)
                           : launch_fused_mma<K, CB, 8>(a, stream);
  });
}

}  // namespace exl3_gemm_detail
}  // namespace twinspark

#define TWINSPARK_EXL3_GEMM_FUSED_MMA_DEFINE(K)                                                                \
  namespace twinspark {                                                                                        \
  cudaError_t exl3_gemm_fused_mma_k##K(const Exl3GemmFusedArgs& a, int codebook, int tokens, cudaStream_t s) { \
    return exl3_gemm_detail::launch_fused_mma_k<K>(a, codebook, tokens, s);                                    \
  }                                                                                                            \
  }
