// Fused prefill EXL3 GEMM for sm_90a: the trellis is decoded straight into wgmma register operands, so W_hat never
// goes through memory (the dequantize + dense matmul path writes and re-reads 2 bytes per weight).
//
// Orientation as in the small kernel: y'^T[n, tokens] = W_hat^T[n, k] · x'^T[k, tokens]. A block is 2 warpgroups;
// warpgroup g owns S slabs of 64 columns (n-tiles 4 (S g + j) .. +3 of the block's 8 S), warp w of it the 16 rows
// of each slab that wgmma takes from that warp, and BT tokens are the wgmma N. Each warp decodes its 16x16 tiles
// into the mma.m16n8k16 A-fragment layout (decode_tile.cuh) and each warpgroup issues wgmma.m64nBTk16 with A from
// those registers and x' from shared memory.
//
// x' comes from exl3_gemm_prep_x_blocked as [k/64][tokens][64] fp16 with the 16-byte pieces of every 128-byte row
// XOR-permuted by row % 8 (the wgmma 128-byte swizzle): a stage's x' (one 64-wide chunk of k, BT tokens) is one
// contiguous copy, and the descriptor is the canonical K-major 128-byte-swizzle one (8-row atoms of 1 KB).
// Pipeline: kFusedStages stages of (x' [BT, 64], trellis [4 k-tiles x the block's n-tiles]), filled by bulk copies
// (cp.async.bulk: the async proxy, completion on one mbarrier per stage) that one thread issues. Chunk i's 4 (x S)
// wgmmas go out as one group; while they run, each warp decodes chunk i+1 into its other A buffer, and chunk
// i+3 is loaded into chunk i-1's stage once chunk i-1's wgmmas have completed (wait_group 1): signalled through
// a per-stage "empty" mbarrier to a producer warpgroup (one-block-per-SM shapes), or by a block barrier after
// which thread 0 issues the copies (the two-per-SM shape). k may be split over gridDim.z. Output: y' (before the
// output Hadamard) fp16 [m, n], or fp32 partials [split, m, n]; exl3_gemm_epilogue finishes both. Measured
// history and limits: NOTES.md v5 and v9.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include <atomic>

#include "common/pdl.cuh"
#include "exl3/decode_tile.cuh"
#include "exl3_gemm/exl3_gemm.h"
#include "exl3_gemm/small_m.cuh"
#include "exl3_gemm/wgmma_sm90.cuh"

namespace twinspark {
namespace exl3_gemm_detail {

constexpr int kFusedThreads = 256;  // 2 warpgroups of compute warps
// One-block-per-SM shapes add a producer warpgroup (warps 8-11; one thread of it issues the bulk copies): a stage
// is refilled once the compute warps have arrived on its "empty" barrier (their wgmmas that read it have
// completed), so the compute warps no longer meet at a block barrier every chunk nor wait for warp 0's copy issue.
// Registers are handed over with setmaxnreg (producer 40, compute 232; a lone 9th warp would have been allocated
// as 4, capping every thread at 168 registers). The two-per-SM shape keeps thread 0 as the producer (its two
// blocks have no registers to spare).
template <int BT, int S>
__host__ __device__ constexpr bool fused_has_producer() {
  return BT * S != 128;
}
template <int BT, int S>
__host__ __device__ constexpr int fused_threads() {
  return kFusedThreads + (fused_has_producer<BT, S>() ? 128 : 0);
}
constexpr int kKc = 64;  // k per pipeline stage: 4 wgmma k-steps
constexpr int kFusedStages = 4;
// Block shapes (tokens BT x slabs S of 64 columns per warpgroup), as `block` ids of the launcher:
// 0: (256, 1) = 128 columns x 256 tokens; 1: (128, 2) = 256 x 128 (both 128 fp32 accumulators per thread, one
// block per SM); 2: (128, 1) = 128 x 128 (64 accumulators, two blocks per SM).
template <int BT>
__host__ __device__ constexpr int fused_x_bytes() {
  return BT * kKc * 2;
}
template <int K, int S>
__host__ __device__ constexpr int fused_trellis_bytes() {
  return (kKc / 16) * 8 * S * 32 * K;
}
template <int K, int BT, int S>
__host__ __device__ constexpr int fused_stage_bytes() {
  return fused_x_bytes<BT>() + fused_trellis_bytes<K, S>();
}
template <int K, int BT, int S>
__host__ __device__ constexpr int fused_smem_bytes() {
  return kFusedStages * fused_stage_bytes<K, BT, S>();
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// bytes (multiple of 16) from global to shared memory; completion counted on the mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <int K, int CB, int BT, int S>
__global__ void __launch_bounds__(fused_threads<BT, S>(), BT* S == 128 ? 2 : 1)
    fused_kernel(const Exl3GemmFusedArgs a) {
  constexpr bool kProducer = fused_has_producer<BT, S>();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kXBytes = fused_x_bytes<BT>(), kStageBytes = fused_stage_bytes<K, BT, S>();
  constexpr int kStripTiles = 8 * S;                 // n-tiles per block
  extern __shared__ __align__(1024) uint8_t smem[];  // 1 KB: the swizzle atom
  const int strip = blockIdx.x, ttile = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = warp >> 2, wl = warp & 3;
  const int tiles_n = a.n >> 4;
  const int strip_tiles = min(kStripTiles, tiles_n - kStripTiles * strip);  // 8 when n % 256 == 128 (last strip)
  const bool wg_on = 4 * S * wg < strip_tiles;  // warpgroup-uniform: its slabs hold real columns
  const int c0 = split * a.chunks_per_split;
  const int nchunks = min(a.k / kKc, c0 + a.chunks_per_split) - c0;
  const int groups = (a.m + 7) >> 3;  // token groups of 8 in xb
  const int g0 = ttile * (BT / 8);
  const char* xb = static_cast<const char*>(a.xb);  // [k/64][groups][1 KB]

  __shared__ __align__(8) uint64_t full[kFusedStages], empty[kFusedStages];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint32_t empty0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty));
  const bool loader = threadIdx.x == (kProducer ? kFusedThreads : 0);
  // One thread fills a stage: x' of the token tile (groups past m are not copied: those wgmma columns hold stale
  // data and are never stored), then the k-tile rows of the block's real n-tiles.
  const int tile_groups = min(BT / 8, groups - g0);
  const uint32_t stage_tx = tile_groups * 1024 + (kKc / 16) * strip_tiles * 32 * K;
  auto load_weights = [&](int c, int s) {  // arms the stage's barrier for the whole stage
    const uint32_t st = smem_base + s * kStageBytes, bar = bar0 + 8 * s;
    mbar_expect_tx(bar, stage_tx);
#pragma unroll
    for (int kt = 0; kt < kKc / 16; ++kt) {
      const int16_t* row =
          a.trellis + (static_cast<long>(c * (kKc / 16) + kt) * tiles_n + kStripTiles * strip) * 16 * K;
      bulk_copy(st + kXBytes + kt * kStripTiles * 32 * K, row, strip_tiles * 32 * K, bar);
    }
  };
  auto load_x = [&](int c, int s) {
    bulk_copy(smem_base + s * kStageBytes, xb + (static_cast<long>(c) * groups + g0) * 1024, tile_groups * 1024,
              bar0 + 8 * s);
  };
  auto load_stage = [&](int c, int s) {
    load_weights(c, s);
    load_x(c, s);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kFusedStages; ++s) {
      mbar_init(bar0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 4 * S < strip_tiles ? 8 : 4);  // the warps of the active compute warpgroups
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Launched with launch_pdl after the x' prep kernel (common/pdl.cuh): the first stages' weights are fetched
  // before waiting for it, their x' after. The epilogue kernel may launch once every block has started.
  pdl_launch_dependents();
  if (loader) {
    for (int s = 0; s < kFusedStages - 1 && s < nchunks; ++s) load_weights(c0 + s, s);
  }
  pdl_wait();
  if (loader) {
    for (int s = 0; s < kFusedStages - 1 && s < nchunks; ++s) load_x(c0 + s, s);
  }
  if constexpr (kProducer) {
    // The producer warpgroup: chunk i goes into stage i % kFusedStages once chunk i - kFusedStages, which used it,
    // has been released by the compute warps.
    if (threadIdx.x >= kFusedThreads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (loader) {
        for (int i = kFusedStages - 1; i < nchunks; ++i) {
          if (i >= kFusedStages) mbar_wait(empty0 + 8 * (i % kFusedStages), (i / kFusedStages - 1) & 1);
          load_stage(c0 + i, i % kFusedStages);
        }
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  }

  float acc[S][BT / 2];
#pragma unroll
  for (int j = 0; j < S; ++j)
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) acc[j][i] = 0.f;
  // A fragments of a whole chunk (4 k-steps x S slabs), double-buffered by chunk: chunk i+1 is decoded while the
  // tensor cores run chunk i's wgmmas.
  uint32_t afr[2][kKc / 16][S][4];
  const exl3::LaneWindow<K> lw(lane);
  // Descriptor constant part, 128-byte swizzle (mode 1 in bits 62-63): a token's 64 k-values are one 128-byte
  // row, 8-row atoms of 1 KB (SBO); LBO is unused for swizzled K-major layouts; a k-step of 16 advances the start
  // address by 32 bytes.
  constexpr uint64_t kDescHi = (uint64_t{1} << 62) | (uint64_t{1} << 16) | (static_cast<uint64_t>(1024 >> 4) << 32);

  // slab j of warpgroup wg: n-tiles 4 * (S * wg + j) .. +3 of the block; this warp decodes tile + wl
  auto decode_chunk = [&](int i, uint32_t (&af)[kKc / 16][S][4]) {
    const int s = i % kFusedStages;
    mbar_wait(bar0 + 8 * s, (i / kFusedStages) & 1);
    const uint32_t* tr =
        reinterpret_cast<const uint32_t*>(smem + s * kStageBytes + kXBytes) + (4 * S * wg + wl) * 8 * K;
#pragma unroll
    for (int kk = 0; kk < kKc / 16; ++kk)
#pragma unroll
      for (int j = 0; j < S; ++j) {
        uint32_t p[4];
        exl3::decode_lane<K, CB>(tr + kk * kStripTiles * 8 * K + j * 32 * K, lw, p);
        af[kk][j][0] = p[0], af[kk][j][1] = p[2], af[kk][j][2] = p[1], af[kk][j][3] = p[3];
      }
  };
  // Chunk i: its wgmmas (A in af), then — once chunk i-1's wgmmas are complete everywhere — refill chunk i-1's stage
  // with chunk i + kFusedStages - 1 and decode chunk i+1 into the other buffer.
  auto run_chunk = [&](int i, uint32_t (&af)[kKc / 16][S][4], uint32_t (&next)[kKc / 16][S][4]) {
    if (wg_on) {
      const uint32_t xaddr = smem_base + (i % kFusedStages) * kStageBytes;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kKc / 16; ++kk) {
        const uint64_t desc = kDescHi | static_cast<uint64_t>(((xaddr + kk * 32) & 0x3FFFF) >> 4);
#pragma unroll
        for (int j = 0; j < S; ++j) wgmma::mma_rs<BT>(acc[j], af[kk][j], desc);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      // Chunk i-1's wgmmas have completed: keep their A registers live until here so the compiler does not hand
      // them to the next decode while the tensor cores still read them.
#pragma unroll
      for (int kk = 0; kk < kKc / 16; ++kk)
#pragma unroll
        for (int j = 0; j < S; ++j)
          asm volatile(""
                       : "+r"(next[kk][j][0]), "+r"(next[kk][j][1]), "+r"(next[kk][j][2]),
                         "+r"(next[kk][j][3])::"memory");
    }
    if constexpr (kProducer) {  // chunk i-1's stage is free (its wgmmas completed; its decode was long before)
      if (wg_on && i > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kFusedStages));
    } else {
      __syncthreads();
      if (threadIdx.x == 0 && i + kFusedStages - 1 < nchunks) {
        load_stage(c0 + i + kFusedStages - 1, (i + kFusedStages - 1) % kFusedStages);
      }
    }
    if (wg_on && i + 1 < nchunks) decode_chunk(i + 1, next);
  };

  if (wg_on && nchunks > 0) decode_chunk(0, afr[0]);
  for (int i = 0; i < nchunks; i += 2) {
    run_chunk(i, afr[0], afr[1]);
    if (i + 1 < nchunks) run_chunk(i + 1, afr[1], afr[0]);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int j = 0; j < S; ++j)
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) asm volatile("" : "+f"(acc[j][i])::"memory");
  if (!wg_on) return;

  // C fragment of m64nBT: row (n) 16*wl + lane/4 (+8), columns (tokens) 8q + 2*(lane%4) + {0, 1}.
  // One split: fp16 y'[m, n]; several: fp32 partials y'[split][m, n] (exl3_gemm_epilogue sums them).
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const long col = static_cast<long>(strip) * 128 * S + 64 * (S * wg + j) + 16 * wl + (lane >> 2);
#pragma unroll
    for (int q = 0; q < BT / 8; ++q) {
      const int t = ttile * BT + 8 * q + 2 * (lane & 3);
      const float v[4] = {acc[j][4 * q], acc[j][4 * q + 2], acc[j][4 * q + 1], acc[j][4 * q + 3]};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tt = t + (e >> 1);
        if (tt >= a.m) continue;
        const long idx = static_cast<long>(tt) * a.n + col + 8 * (e & 1);
        if (a.splits == 1)
          static_cast<half*>(a.y)[idx] = __float2half_rn(v[e]);
        else
          static_cast<float*>(a.y)[static_cast<long>(split) * a.m * a.n + idx] = v[e];
      }
    }
  }
#else
  __trap();  // built for another arch: the launcher refuses non-sm_90 devices before this can run
#endif
}

template <int K, int CB, int BT, int S>
cudaError_t launch_fused(const Exl3GemmFusedArgs& a, cudaStream_t stream) {
  constexpr int smem = fused_smem_bytes<K, BT, S>();
  static std::atomic<uint64_t> raised{0};  // one bit per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (!(raised.load(std::memory_order_acquire) >> (dev & 63) & 1)) {
    err = cudaFuncSetAttribute(fused_kernel<K, CB, BT, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    raised.fetch_or(uint64_t{1} << (dev & 63), std::memory_order_acq_rel);
  }
  const dim3 grid((a.n + 128 * S - 1) / (128 * S), (a.m + BT - 1) / BT, a.splits);
  return launch_pdl(fused_kernel<K, CB, BT, S>, grid, dim3(fused_threads<BT, S>()), smem, stream, a);
}

template <int K>
cudaError_t launch_fused_k(const Exl3GemmFusedArgs& a, int codebook, int block, cudaStream_t stream) {
  return exl3::with_codebook(codebook, [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
    switch (block) {
      case 0:
        return launch_fused<K, CB, 256, 1>(a, stream);
      case 1:
        return launch_fused<K, CB, 128, 2>(a, stream);
      case 2:
        return launch_fused<K, CB, 128, 1>(a, stream);
      default:
        return cudaErrorInvalidValue;
    }
  });
}

}  // namespace exl3_gemm_detail
}  // namespace twinspark

#define TWINSPARK_EXL3_GEMM_FUSED_DEFINE(K)                                                               \
  namespace twinspark {                                                                                   \
  cudaError_t exl3_gemm_fused_k##K(const Exl3GemmFusedArgs& a, int codebook, int block, cudaStream_t s) { \
    return exl3_gemm_detail::launch_fused_k<K>(a, codebook, block, s);                                    \
  }                                                                                                       \
  }
