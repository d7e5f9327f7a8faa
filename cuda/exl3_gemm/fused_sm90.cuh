// Fused prefill EXL3 GEMM for sm_90a: the trellis is decoded straight into wgmma register operands, so W_hat never
// goes through memory (the dequantize + dense matmul path writes and re-reads 2 bytes per weight).
//
// Orientation as in the small kernel: y'^T[n, tokens] = W_hat^T[n, k] · x'^T[k, tokens]. A tile is 128 columns
// (a strip: one output Hadamard block) x BT tokens; a block is 2 warpgroups of compute warps, warpgroup g owns
// columns 64 g .. +63, warp w of it the 16 rows that wgmma takes from that warp, and BT tokens are the wgmma N.
// Each warp decodes its 16x16 tiles into the mma.m16n8k16 A-fragment layout (decode_tile.cuh) and each warpgroup
// issues wgmma.m64nBTk16 with A from those registers and x' from shared memory.
//
// x' comes from exl3_gemm_prep_x_blocked as [k/64][tokens][64] fp16 with the 16-byte pieces of every 128-byte row
// XOR-permuted by row % 8 (the wgmma 128-byte swizzle): a stage's x' (one 64-wide chunk of k, BT tokens) is one
// contiguous copy, and the descriptor is the canonical K-major 128-byte-swizzle one (8-row atoms of 1 KB).
// Pipeline: kFusedStages stages of (x' [BT, 64], trellis [4 k-tiles x 8 n-tiles]), filled by bulk copies
// (cp.async.bulk: the async proxy, completion on one mbarrier per stage) that one thread issues. Chunk g's 4
// wgmmas go out as one group; while they run, each warp decodes chunk g+1 into its other A buffer, and chunk
// g+3 is loaded into chunk g-1's stage once chunk g-1's wgmmas have completed (wait_group 1): signalled through
// a per-stage "empty" mbarrier to a producer warpgroup (BT = 256), or by a block barrier after which thread 0
// issues the copies (BT = 128).
//
// Work split. One tile per block, k split over gridDim.z (fp32 partials [split, m, n] when split); or, BT = 256
// with a.part set (the table's choice, ops/exl3_gemm.py fused_shape), stream-K: the launch's (tile, chunk)
// iterations, tile-major (tile t = strip * ttiles + token tile), are cut into gridDim.x equal runs, one per block,
// so every SM gets the same work whatever the tile count. A run crosses tiles; the stage ring flows on across
// them. A tile's piece that holds its chunk 0 (the head) finishes the tile: it adds the fp32 pieces of the blocks
// after it (each wrote its piece, the first of its run, to its slot of a.part and raised its flag with a release)
// and stores fp16 y'. A block's only non-head piece is its first, so one slot per block, and a head waits only on
// later blocks, which write their piece before they wait on anything: no cycle whatever the residency. Output:
// y' (before the output Hadamard); exl3_gemm_epilogue finishes it. Measured limits and the variants tried: DESIGN.md
// (prefill on sm_90, rejected ideas).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include <atomic>

#include "common/arrive.cuh"
#include "common/pdl.cuh"
#include "exl3/decode_tile.cuh"
#include "exl3_gemm/exl3_gemm.h"
#include "exl3_gemm/small_m.cuh"
#include "exl3_gemm/wgmma_sm90.cuh"

namespace twinspark {
namespace exl3_gemm_detail {

constexpr int kFusedThreads = 256;  // 2 warpgroups of compute warps
// The one-block-per-SM shape (BT = 256) adds a producer warpgroup (warps 8-11; one thread of it issues the bulk
// copies): a stage is refilled once the compute warps have arrived on its "empty" barrier (their wgmmas that read
// it have completed), so the compute warps never meet at a block barrier. Registers are handed over with
// setmaxnreg (producer 40, compute 232; a lone 9th warp would have been allocated as 4, capping every thread at
// 168 registers); it runs stream-K or a k split (fused_kernel). The two-per-SM shape (BT = 128) keeps thread 0 as
// the producer (its two blocks have no registers to spare) and a k split over gridDim.z.
template <int BT>
__host__ __device__ constexpr bool fused_has_producer() {
  return BT == 256;
}
template <int BT>
__host__ __device__ constexpr int fused_threads() {
  return kFusedThreads + (fused_has_producer<BT>() ? 128 : 0);
}
constexpr int kKc = 64;  // k per pipeline stage: 4 wgmma k-steps
constexpr int kFusedStages = 4;
// Block shapes (128 columns x BT tokens), as `block` ids of the launcher: 0: BT = 256 (128 fp32 accumulators per
// thread, one block per SM, stream-K); 2: BT = 128 (64 accumulators, two blocks per SM, split-k).
template <int BT>
__host__ __device__ constexpr int fused_x_bytes() {
  return BT * kKc * 2;
}
template <int K>
__host__ __device__ constexpr int fused_trellis_bytes() {
  return (kKc / 16) * 8 * 32 * K;
}
template <int K, int BT>
__host__ __device__ constexpr int fused_stage_bytes() {
  return fused_x_bytes<BT>() + fused_trellis_bytes<K>();
}
template <int K, int BT>
__host__ __device__ constexpr int fused_smem_bytes() {
  return kFusedStages * fused_stage_bytes<K, BT>();
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
// Barrier 1 over the `count` compute threads (the producer warpgroup never joins it).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// bytes (multiple of 16) from global to shared memory; completion counted on the mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <int K, int CB, int BT>
__global__ void __launch_bounds__(fused_threads<BT>(), BT == 128 ? 2 : 1) fused_kernel(const Exl3GemmFusedArgs a) {
  constexpr bool kProducer = fused_has_producer<BT>();
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const bool stream_k = kProducer && a.part != nullptr;
  constexpr int kXBytes = fused_x_bytes<BT>(), kStageBytes = fused_stage_bytes<K, BT>();
  constexpr int kRowBytes = 8 * 32 * K;              // one k-tile row of a strip's 8 n-tiles
  extern __shared__ __align__(1024) uint8_t smem[];  // 1 KB: the swizzle atom
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = warp >> 2, wl = warp & 3;
  const int tiles_n = a.n >> 4;
  const int chunks = a.k / kKc;       // per tile
  const int groups = (a.m + 7) >> 3;  // token groups of 8 in xb
  const int ttiles = (a.m + BT - 1) / BT;
  // The block's run of iterations [it0, it1) over (tile t = strip * ttiles + token tile, chunk of k).
  const int total = a.n / 128 * ttiles * chunks;
  int it0, it1;
  if (stream_k) {
    it0 = static_cast<int>(static_cast<long>(total) * blockIdx.x / gridDim.x);
    it1 = static_cast<int>(static_cast<long>(total) * (blockIdx.x + 1) / gridDim.x);
  } else {  // one tile (strip blockIdx.x, token tile blockIdx.y), k split over gridDim.z
    const int t0 = (blockIdx.x * ttiles + blockIdx.y) * chunks;
    it0 = t0 + blockIdx.z * a.chunks_per_split;
    it1 = t0 + min(chunks, static_cast<int>(blockIdx.z + 1) * a.chunks_per_split);
  }
  const int nit = it1 - it0;
  const char* xb = static_cast<const char*>(a.xb);  // [k/64][groups][1 KB]

  __shared__ __align__(8) uint64_t full[kFusedStages], empty[kFusedStages];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint32_t empty0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty));
  const bool loader = threadIdx.x == (kProducer ? kFusedThreads : 0);
  // One thread fills a stage with the iteration at its cursor: the k-tile rows of its strip, then x' of its token
  // tile (groups past m are not copied: those wgmma columns hold stale data and are never stored). The cursor
  // steps without divisions (they delayed the refills measurably).
  struct Cursor {
    int c, ttile, strip;
  };
  const int t_first = it0 / chunks;
  Cursor lc{it0 - t_first * chunks, t_first % ttiles, t_first / ttiles};
  auto step = [&](Cursor& q) {
    if (++q.c == chunks) {
      q.c = 0;
      if (++q.ttile == ttiles) q.ttile = 0, ++q.strip;
    }
  };
  auto tile_groups = [&](const Cursor& q) { return min(BT / 8, groups - q.ttile * (BT / 8)); };
  auto load_weights = [&](const Cursor& q, int s) {  // arms the stage's barrier for the whole stage
    const uint32_t st = smem_base + s * kStageBytes, bar = bar0 + 8 * s;
    mbar_expect_tx(bar, tile_groups(q) * 1024 + (kKc / 16) * kRowBytes);
#pragma unroll
    for (int kt = 0; kt < kKc / 16; ++kt) {
      const int16_t* row = a.trellis + (static_cast<long>(q.c * (kKc / 16) + kt) * tiles_n + 8 * q.strip) * 16 * K;
      bulk_copy(st + kXBytes + kt * kRowBytes, row, kRowBytes, bar);
    }
  };
  auto load_x = [&](const Cursor& q, int s) {
    bulk_copy(smem_base + s * kStageBytes, xb + (static_cast<long>(q.c) * groups + q.ttile * (BT / 8)) * 1024,
              tile_groups(q) * 1024, bar0 + 8 * s);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kFusedStages; ++s) {
      mbar_init(bar0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8);  // lane 0 of every compute warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Launched with launch_pdl after the x' prep kernel (common/pdl.cuh): the first stages' weights are fetched
  // before waiting for it, their x' after. The epilogue kernel may launch once every block has started.
  pdl_launch_dependents();
  if (loader) {
    Cursor q = lc;
    for (int s = 0; s < kFusedStages - 1 && s < nit; ++s, step(q)) load_weights(q, s);
  }
  pdl_wait();
  if (loader) {
    for (int s = 0; s < kFusedStages - 1 && s < nit; ++s, step(lc)) load_x(lc, s);
  }
  if constexpr (kProducer) {
    // The producer warpgroup: the block's chunk g goes into stage g % kFusedStages once chunk g - kFusedStages,
    // which used it, has been released by the compute warps.
    if (threadIdx.x >= kFusedThreads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
      if (loader) {
        for (int g = kFusedStages - 1; g < nit; ++g) {
          if (g >= kFusedStages) mbar_wait(empty0 + 8 * (g % kFusedStages), (g / kFusedStages - 1) & 1);
          load_weights(lc, g % kFusedStages);
          load_x(lc, g % kFusedStages);
          step(lc);
        }
      }
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  }

  float acc[BT / 2];
  // A fragments of a whole chunk (4 k-steps), double-buffered by chunk: chunk g+1 is decoded while the tensor cores
  // run chunk g's wgmmas.
  uint32_t afr[2][kKc / 16][4];
  const exl3::LaneWindow<K> lw(lane);
  // Descriptor constant part, 128-byte swizzle (mode 1 in bits 62-63): a token's 64 k-values are one 128-byte
  // row, 8-row atoms of 1 KB (SBO); LBO is unused for swizzled K-major layouts; a k-step of 16 advances the start
  // address by 32 bytes.
  constexpr uint64_t kDescHi = (uint64_t{1} << 62) | (uint64_t{1} << 16) | (static_cast<uint64_t>(1024 >> 4) << 32);

  // warpgroup wg holds columns 64 wg .. +63 of the strip (n-tiles 4 wg .. +3); this warp decodes n-tile 4 wg + wl
  auto decode_chunk = [&](int g, uint32_t (&af)[kKc / 16][4]) {
    const int s = g % kFusedStages;
    mbar_wait(bar0 + 8 * s, (g / kFusedStages) & 1);
    const uint32_t* tr = reinterpret_cast<const uint32_t*>(smem + s * kStageBytes + kXBytes) + (4 * wg + wl) * 8 * K;
#pragma unroll
    for (int kk = 0; kk < kKc / 16; ++kk) {
      uint32_t p[4];
      exl3::decode_lane<K, CB>(tr + kk * kRowBytes / 4, lw, p);
      af[kk][0] = p[0], af[kk][1] = p[2], af[kk][2] = p[1], af[kk][3] = p[3];
    }
  };
  // The block's chunk g: its wgmmas (A in af; `first` of a tile piece starts the sum), then — once chunk g-1's
  // wgmmas are complete everywhere — release chunk g-1's stage and decode chunk g+1 into the other buffer.
  auto run_chunk = [&](int g, bool first, uint32_t (&af)[kKc / 16][4], uint32_t (&next)[kKc / 16][4],
                       bool decode_next) {
    const uint32_t xaddr = smem_base + (g % kFusedStages) * kStageBytes;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kKc / 16; ++kk) {
      const uint64_t desc = kDescHi | static_cast<uint64_t>(((xaddr + kk * 32) & 0x3FFFF) >> 4);
      wgmma::mma_rs<BT>(acc, af[kk], desc, kk > 0 || !first);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    // Chunk g-1's wgmmas have completed: keep their A registers live until here so the compiler does not hand
    // them to the next decode while the tensor cores still read them.
#pragma unroll
    for (int kk = 0; kk < kKc / 16; ++kk)
      asm volatile("" : "+r"(next[kk][0]), "+r"(next[kk][1]), "+r"(next[kk][2]), "+r"(next[kk][3])::"memory");
    if constexpr (kProducer) {  // chunk g-1's stage is free (its wgmmas completed; its decode was long before)
      if (!first && lane == 0) mbar_arrive(empty0 + 8 * ((g - 1) % kFusedStages));
    } else {
      __syncthreads();
      if (threadIdx.x == 0 && g + kFusedStages - 1 < nit) {
        load_weights(lc, (g + kFusedStages - 1) % kFusedStages);
        load_x(lc, (g + kFusedStages - 1) % kFusedStages);
        step(lc);
      }
    }
    if (decode_next) decode_chunk(g + 1, next);
  };
  // C fragment of m64nBT: row (n) 16*wl + lane/4 (+8), columns (tokens) 8q + 2*(lane%4) + {0, 1}.
  // fp16 y'[m, n]; or, split k, fp32 partials y'[split][m, n] (exl3_gemm_epilogue sums them).
  auto store_y = [&](int t) {
    const int strip = t / ttiles, ttile = t - strip * ttiles;
    const long col = static_cast<long>(strip) * 128 + 64 * wg + 16 * wl + (lane >> 2);
#pragma unroll
    for (int q = 0; q < BT / 8; ++q) {
      const int tok = ttile * BT + 8 * q + 2 * (lane & 3);
      const float v[4] = {acc[4 * q], acc[4 * q + 2], acc[4 * q + 1], acc[4 * q + 3]};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tt = tok + (e >> 1);
        if (tt >= a.m) continue;
        const long idx = static_cast<long>(tt) * a.n + col + 8 * (e & 1);
        if (stream_k || a.splits == 1)
          static_cast<half*>(a.y)[idx] = __float2half_rn(v[e]);
        else
          static_cast<float*>(a.y)[static_cast<long>(blockIdx.z) * a.m * a.n + idx] = v[e];
      }
    }
  };
  // Stream-K: a tile piece that does not start at chunk 0 goes to this block's slot of a.part (fp32, fragment
  // order: coalesced 16-byte stores) with a release flag; the tile's head piece adds the later blocks' slots.
  float4* const slots = reinterpret_cast<float4*>(a.part) + threadIdx.x;
  constexpr int kSlot = (BT / 8) * kFusedThreads;  // float4s per slot

  int g = 0;  // the block's chunk count: position in the stage ring
  for (int it = it0; it < it1;) {
    const int t = it / chunks, c0 = it - t * chunks;
    const int nch = min(chunks - c0, it1 - it);
    decode_chunk(g, afr[0]);
    for (int i = 0; i < nch; i += 2) {
      run_chunk(g + i, i == 0, afr[0], afr[1], i + 1 < nch);
      if (i + 1 < nch) run_chunk(g + i + 1, false, afr[1], afr[0], i + 2 < nch);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");
    if constexpr (kProducer) {
      if (lane == 0) mbar_arrive(empty0 + 8 * ((g + nch - 1) % kFusedStages));
    }
    if (stream_k) {
      if (c0 > 0) {  // not the tile's head: hand the piece over (a block's first piece only)
        float4* dst = slots + static_cast<long>(blockIdx.x) * kSlot;
#pragma unroll
        for (int q = 0; q < BT / 8; ++q)
          __stcg(dst + q * kFusedThreads, make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
        named_barrier_sync(1, kFusedThreads);
        if (threadIdx.x == 0) store_release(a.flags + blockIdx.x, 1);
      } else {
        if (c0 + nch < chunks) {  // the rest of the tile is on the next blocks, each a first piece of theirs
          auto block_of = [&](int x) { return static_cast<int>(((x + 1L) * gridDim.x + total - 1) / total - 1); };
          const int b1 = block_of(t * chunks + chunks - 1);
          for (int b = block_of(it1); b <= b1; ++b) {
            if (threadIdx.x == 0) {
              while (load_acquire(a.flags + b) == 0) __nanosleep(64);
              a.flags[b] = 0;  // consumed: zero again for the next call
            }
            named_barrier_sync(1, kFusedThreads);
            const float4* src = slots + static_cast<long>(b) * kSlot;
#pragma unroll
            for (int q = 0; q < BT / 8; ++q) {
              const float4 v = __ldcg(src + q * kFusedThreads);
              acc[4 * q] += v.x, acc[4 * q + 1] += v.y, acc[4 * q + 2] += v.z, acc[4 * q + 3] += v.w;
            }
          }
        }
        store_y(t);
      }
    } else {
      store_y(t);
    }
    g += nch;
    it += nch;
  }
#else
  __trap();  // built for another arch: the launcher refuses non-sm_90 devices before this can run
#endif
}

template <int K, int CB, int BT>
cudaError_t launch_fused(const Exl3GemmFusedArgs& a, cudaStream_t stream) {
  constexpr int smem = fused_smem_bytes<K, BT>();
  static std::atomic<uint64_t> raised{0};  // one bit per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (!(raised.load(std::memory_order_acquire) >> (dev & 63) & 1)) {
    err = cudaFuncSetAttribute(fused_kernel<K, CB, BT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    raised.fetch_or(uint64_t{1} << (dev & 63), std::memory_order_acq_rel);
  }
  const dim3 grid = a.part ? dim3(a.splits) : dim3(a.n / 128, (a.m + BT - 1) / BT, a.splits);
  return launch_pdl(fused_kernel<K, CB, BT>, grid, dim3(fused_threads<BT>()), smem, stream, a);
}

template <int K>
cudaError_t launch_fused_k(const Exl3GemmFusedArgs& a, int codebook, int block, cudaStream_t stream) {
  return exl3::with_codebook(codebook, [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
    switch (block) {
      case 0:
        return launch_fused<K, CB, 256>(a, stream);
      case 2:
        return launch_fused<K, CB, 128>(a, stream);
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
