// Small-m EXL3 GEMM kernel (m <= 64 per launch): decode in registers, tensor cores through mma.sync.
//
// Orientation: y^T[n, tokens] = W_hat^T[n, k] · x'^T[k, tokens]. A decoded 16x16 tile is the A operand of
// mma.m16n8k16 (decode_tile.cuh), 8 tokens are the N side, so m <= 8 costs one mma per tile and every extra
// group of 8 tokens reuses the decoded registers (decode is the expensive part on the H200).
// 3inst and mcg at m <= 8 (one token group) decode "raw" (decode_lane_raw): each weight's register keeps the
// codebook's two fp16 halves un-added and x' is stored with every value duplicated in both halves, so the tile
// takes two mmas (k' = 2k + half) instead of 2 PRMT + 1 HADD2 per pair of weights (12 fewer instructions per
// tile, one more mma; the tensor pipe is idle at m <= 8): -10..12% on the H200 (DESIGN.md, small m). mul1 keeps the
// packed decode (its raw form measured no gain).
//
// Grid (n/128 strips, splits). Block = 8 warps = the 8 n-tiles of one 128-column strip; it walks its share of
// k in 128-row chunks. Per chunk: each warp's 8 trellis tiles (its n-tile, 8 k-tiles) arrive by cp.async in
// the warp's slice of a 2-4 stage ring; x' = fp16(H128(x ⊙ suh)) is computed by the block (warp per token or per
// chunk, shuffles); each warp decodes its n-tile's 8 k-tiles and issues `groups` mmas per tile.
// Reduction over splits: fp32 red.add into ws[token, n]; the last block of the strip (an acquire-release
// arrival on its counter) applies the output Hadamard, svh and bias, writes out, and clears its ws strip and
// counter (graph-safe, no memset).
// Grouped launch (exl3_gemm_grouped: the kernel's parameter is an Exl3GemmGroupedArgs): grid.z = mats matrices of
// one shape, block z works on matrix z with its own x, trellis, scales, output, ws slice and counters. With one
// matrix (an Exl3GemmSmallArgs) the matrix index and offsets are the constant 0 and fold away: the same SASS as
// before the grouped mode existed (cuobjdump, sm_90a, nvcc 13.0).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "common/arrive.cuh"
#include "common/pdl.cuh"
#include "common/tensor_map.h"
#include "exl3/decode_tile.cuh"
#include "exl3/hadamard.cuh"
#include "exl3_gemm/exl3_gemm.h"

namespace twinspark {
namespace exl3_gemm_detail {

constexpr int kThreads = 256;
constexpr int kXRow = 136;     // halves per token row of x' in shared memory (128 + 8: conflict-free ldmatrix)
constexpr int kXRowRaw = 264;  // the same for one token group (duplicated x' of the raw path: 256 + 8)

__host__ __device__ constexpr int stage_words(int K) { return 64 * 8 * K; }  // 64 tiles x 8K u32
__host__ __device__ constexpr int num_stages(int K) {
  // ~48 KB of trellis in flight per block at most (GB10: <= 99 KB per block together with x').
  return (49152 / (stage_words(K) * 4)) > 4 ? 4
                                            : ((49152 / (stage_words(K) * 4)) < 2 ? 2 : 49152 / (stage_words(K) * 4));
}
// One token group (m <= 8): x' of kXChunks chunks is made at once, one chunk per warp (the block's warps share
// the Hadamard work instead of warp t doing token t's every chunk while the others wait at the barrier), m rows
// per chunk: 4.2 KB at m = 1, 33.8 KB at m = 8.
constexpr int kXChunks = 8;
__host__ __device__ constexpr int x_chunks(int groups) { return groups == 1 ? kXChunks : 2; }
// Dynamic shared memory for m tokens per launch (m <= 8 * groups).
__host__ __device__ constexpr int smem_bytes(int K, int groups, int m) {
  return num_stages(K) * stage_words(K) * 4 +
         (groups == 1 ? kXChunks * m * kXRowRaw * 2 : x_chunks(groups) * 8 * groups * kXRow * 2);
}
__host__ __device__ constexpr int smem_bytes(int K, int groups) { return smem_bytes(K, groups, 8 * groups); }

// Blocks per SM the register budget is sized for: m <= 8 runs at up to 6 per SM (python plan, BLOCKS_PER_SM), as
// many as the H200's 228 KB of shared memory allow at m <= 2; more token groups keep the compiler's choice.
__host__ __device__ constexpr int min_blocks(int K, int groups) {
  return groups != 1 ? 1 : (233472 / (smem_bytes(K, 1, 2) + 1024) < 6 ? 233472 / (smem_bytes(K, 1, 2) + 1024) : 6);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x2(const void* p, uint32_t& r0, uint32_t& r1) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(s));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// This lane's 4 values of x'[t, 128 cc + 4 lane ..] of matrix mat (x at a.x + x_off elements) as fp16 (zero for
// t >= m; t is warp-uniform): copied from the prep buffer a.xh (exl3_gemm_prep_x made x' once: many tokens, where
// every strip would redo the Hadamard), or fp16(H128(x ⊙ suh)) with s = this lane's 4 suh values of chunk cc.
__device__ __forceinline__ uint2 x_row(const Exl3GemmSmallArgs& a, int mat, long x_off, int t, int cc,
                                       const float (&s)[4], int lane) {
  if (t >= a.m) return make_uint2(0u, 0u);
  // (Each matrix offset is added to the base pointer on its own: with one matrix, mat is the constant 0 and the
  // expressions after it are the single-matrix kernel's.)
  if (a.xh)
    return *reinterpret_cast<const uint2*>(static_cast<const half*>(a.xh) + static_cast<size_t>(mat) * a.m * a.k +
                                           static_cast<size_t>(t) * a.k + 128 * cc + 4 * lane);
  float v[4];
  const char* x = static_cast<const char*>(a.x) + x_off * 2;
  exl3::load4(x + (static_cast<size_t>(t) * a.x_stride + 128 * cc + 4 * lane) * 2, a.bf16, v);
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] *= s[e];
  exl3::hadamard128_warp(v, lane);
  const __half2 lo = __floats2half2_rn(v[0], v[1]), hi = __floats2half2_rn(v[2], v[3]);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

__device__ __forceinline__ void suh4(const Exl3GemmSmallArgs& a, int mat, int cc, int lane, float (&s)[4]) {
  s[0] = s[1] = s[2] = s[3] = 0.f;
  if (!a.xh) exl3::load4_half(static_cast<const half*>(a.suh) + mat * a.k + 128 * cc + 4 * lane, s);
}

// x'[t, 0:128] of chunk c for tokens t < 8*groups (rows >= m are zero), fp16 into xs (row stride kXRow): warp w
// makes rows w, w + 8, ... (Tried: issuing chunk c+1's loads before chunk c's decode; measured slower on the H200
// at every m, with 125 registers at 8 groups: DESIGN.md, rejected ideas.)
template <int G>
__device__ __forceinline__ void make_x_chunk(const Exl3GemmSmallArgs& a, int mat, long x_off, int c, half* xs, int warp,
                                             int lane) {
  float s[4];
  suh4(a, mat, c, lane, s);
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int t = warp + 8 * i;
    *reinterpret_cast<uint2*>(xs + t * kXRow + 4 * lane) = x_row(a, mat, x_off, t, c, s, lane);
  }
}

// x' of chunks c .. c+n-1 (n <= kXChunks) for tokens t < m (<= 8): warp w makes chunk c+w into
// xs + w * m * kXRowRaw (m rows per chunk, row stride kXRowRaw), duplicated (exl3::store_x4_dup) for the raw
// decode, else plain. The ldmatrix addresses of tokens >= m repeat row m - 1 (their outputs are never stored).
template <bool RAW>
__device__ __forceinline__ void make_x_chunks(const Exl3GemmSmallArgs& a, int mat, long x_off, int c, int n, half* xs,
                                              int warp, int lane) {
  if (warp >= n) return;
  half* xw = xs + warp * a.m * kXRowRaw;
  float s[4];
  suh4(a, mat, c + warp, lane, s);
#pragma unroll 1
  for (int t = 0; t < a.m; ++t) {  // a.m <= 8 here
    const uint2 v = x_row(a, mat, x_off, t, c + warp, s, lane);
    if constexpr (RAW) {
      exl3::store_x4_dup(reinterpret_cast<uint32_t*>(xw + t * kXRowRaw), lane, v);
    } else {
      *reinterpret_cast<uint2*>(xw + t * kXRowRaw + 4 * lane) = v;
    }
  }
}

// The small kernel's parameter: one matrix, or the grouped launch (its matrix count and group strides).
__host__ __device__ __forceinline__ const Exl3GemmSmallArgs& args_of(const Exl3GemmSmallArgs& a) { return a; }
__host__ __device__ __forceinline__ const Exl3GemmSmallArgs& args_of(const Exl3GemmGroupedArgs& g) { return g.a; }
template <class P>
constexpr bool kGrouped = std::is_same_v<P, Exl3GemmGroupedArgs>;

template <int K, int CB, int G, class P>
__global__ void __launch_bounds__(kThreads, min_blocks(K, G)) small_m_kernel(const P p) {
  const Exl3GemmSmallArgs& a = args_of(p);
  constexpr int kStages = num_stages(K);
  constexpr int kStageWords = stage_words(K);
  extern __shared__ uint4 smem_raw[];
  uint32_t* stages = reinterpret_cast<uint32_t*>(smem_raw);
  half* xs = reinterpret_cast<half*>(stages + kStages * kStageWords);
  __shared__ int s_last;

  const int strip = blockIdx.x, split = blockIdx.y;
  // This block's matrix and where its x and out start (one matrix: the constant 0, every offset folds away).
  int mat = 0;
  long x_off = 0, out_off = 0;
  if constexpr (kGrouped<P>) mat = blockIdx.z, x_off = mat * p.x_gstride, out_off = mat * p.out_gstride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kc = a.k >> 7;
  const int c0 = split * a.chunks_per_split;
  const int c1 = min(kc, c0 + a.chunks_per_split);
  const int nchunks = c1 - c0;
  const int tiles_n = a.n >> 4;

  // Each warp streams its own tiles: the 8 k-tiles of n-tile `warp` of chunk c (one tile from each of the chunk's
  // 8 rows), into its own slice of every stage ([warp][kt][8K words]), so the ring needs no block barrier: a warp
  // waits for its own copies and syncs its lanes. (Before: the block loaded whole rows and every chunk ended in a
  // __syncthreads; ncu at m=1: barrier stalls were 22% of the warps' cycles, H200 2026-12-01.)
  // A compile-time trip count per lane (1-4 copies): a run-time strided loop here cost ~150 instructions per
  // chunk (unroll-by-4 + remainder scaffolding), as much as decoding two tiles (SASS, H200 run 2026-12-01).
  auto load_tiles = [&](int c, int stage) {
    uint4* dst = reinterpret_cast<uint4*>(stages + stage * kStageWords + warp * 64 * K);
    constexpr int kTileVec = 2 * K;  // uint4 per tile (32K bytes / 16)
    constexpr int kTotal = 8 * kTileVec, kIters = (kTotal + 31) / 32;
    // matrix mat's trellis [k/16, n/16, 16K] starts at tile row mat * k/16 of the stacked [mats * k/16, ...]
    const uint4* base =
        reinterpret_cast<const uint4*>(a.trellis + 8L * mat * kc * tiles_n * 16 * K +
                                       (static_cast<long>(8 * c) * tiles_n + 8 * strip + warp) * 16 * K);
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int i = lane + 32 * j;
      if (kTotal % 32 == 0 || i < kTotal) {
        const int kt = i / kTileVec, v = i - kt * kTileVec;
        cp_async16(dst + i, base + static_cast<long>(kt) * tiles_n * kTileVec + v);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load_tiles(c0 + s, s);
    cp_async_commit();
  }
  // Launched with launch_pdl (common/pdl.cuh): the first weights are on their way while the kernel before this
  // one finishes; x, x' (prep), ws, the counters and out are touched only after the wait. The next call's blocks
  // may launch once all of this grid's blocks have started.
  pdl_launch_dependents();
  pdl_wait();

  float acc[G][4];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
  constexpr bool kRaw = G == 1 && CB != exl3::kCbMul1;
  const exl3::LaneWindow<K> lw(lane);
  // ldmatrix row address of this lane inside a chunk's x': matrix mi = lane / 8 (k half, then group + 1).
  // One group: row = token (rows >= m repeat row m - 1); raw: matrix mi at word 4 mi of the k-tile's 16 words.
  const int mi = lane >> 3;
  const int x_row = G == 1 ? min(lane & 7, a.m - 1) : 8 * (mi >> 1) + (lane & 7);
  const int x_col = kRaw ? 8 * mi : 8 * (mi & 1);

  for (int i = 0; i < nchunks; ++i) {
    half* xb;
    if constexpr (G == 1) {
      // x' of kXChunks chunks per round (m rows each): the only block barriers of the loop.
      xb = xs + (i % kXChunks) * a.m * kXRowRaw;
      if (i % kXChunks == 0) {
        if (i > 0) __syncthreads();  // everyone is done with the previous round's x'
        make_x_chunks<kRaw>(a, mat, x_off, c0 + i, min(kXChunks, nchunks - i), xs, warp, lane);
        __syncthreads();
      }
    } else {
      xb = xs + (i & 1) * (8 * G * kXRow);
      make_x_chunk<G>(a, mat, x_off, c0 + i, xb, warp, lane);
      __syncthreads();  // x' of this chunk is made by all warps
    }
    cp_async_wait<kStages - 2>();  // this lane's copies of chunk i have landed
    __syncwarp();                  // and every lane's: the warp's slice of stage i is ready, stage i - 1 is free
    if (i + kStages - 1 < nchunks) load_tiles(c0 + i + kStages - 1, (i + kStages - 1) % kStages);
    cp_async_commit();

    const uint32_t* st = stages + (i % kStages) * kStageWords + warp * 64 * K;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      if constexpr (kRaw) {
        // Raw registers r[j] = position 8 lane + j; mma e takes the positions of k = 2 (lane % 4) + e (+8).
        uint32_t r[8], b0, b1, b2, b3;
        exl3::decode_lane_raw<K, CB>(st + kt * 8 * K, lw, r);
        ldmatrix_x4(xb + x_row * kXRowRaw + 32 * kt + x_col, b0, b1, b2, b3);
        const uint32_t a0[4] = {r[0], r[4], r[2], r[6]}, a1[4] = {r[1], r[5], r[3], r[7]};
        mma_16816(acc[0], a0, b0, b1);
        mma_16816(acc[0], a1, b2, b3);
      } else if constexpr (G == 1) {
        uint32_t p[4], b0, b1;
        exl3::decode_lane<K, CB>(st + kt * 8 * K, lw, p);
        const uint32_t afrag[4] = {p[0], p[2], p[1], p[3]};
        ldmatrix_x2(xb + x_row * kXRowRaw + 16 * kt + x_col, b0, b1);
        mma_16816(acc[0], afrag, b0, b1);
      } else {
        uint32_t p[4];
        exl3::decode_lane<K, CB>(st + kt * 8 * K, lw, p);
        const uint32_t afrag[4] = {p[0], p[2], p[1], p[3]};
#pragma unroll
        for (int g = 0; g < G; g += 2) {
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(xb + (8 * g + x_row) * kXRow + 16 * kt + x_col, b0, b1, b2, b3);
          mma_16816(acc[g], afrag, b0, b1);
          mma_16816(acc[g + 1], afrag, b2, b3);
        }
      }
    }
  }
  cp_async_wait<0>();

  // C fragment: rows (n) lane/4 and lane/4 + 8 of this warp's n-tile; columns (tokens) 2*(lane%4) + {0, 1}.
  // Scalar fp32 atomics into token-major ws [64][n]: a warp's adds hit 8 consecutive columns of 4 rows, i.e. few
  // L2 sectors per instruction. (Tried: 16-byte red.add.v4 into a token-minor layout: 2x slower at m=64 on the
  // H200 because each lane then hits its own sector: DESIGN.md, rejected ideas.)
  const int col = strip * 128 + warp * 16 + (lane >> 2);
  float* const ws = a.ws + static_cast<long>(mat) * 64 * a.n;  // this matrix's [64, n] slice
  const int counter = mat * (a.n >> 7) + strip;                // in counters [mats, n / 128]
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int t = 8 * g + 2 * (lane & 3);
    if (t < a.m) {
      atomicAdd(ws + static_cast<long>(t) * a.n + col, acc[g][0]);
      atomicAdd(ws + static_cast<long>(t) * a.n + col + 8, acc[g][2]);
    }
    if (t + 1 < a.m) {
      atomicAdd(ws + static_cast<long>(t + 1) * a.n + col, acc[g][1]);
      atomicAdd(ws + static_cast<long>(t + 1) * a.n + col + 8, acc[g][3]);
    }
  }
  __syncthreads();  // the block's adds, then one acquire-release arrival (common/arrive.cuh)
  if (threadIdx.x == 0) s_last = arrive_acq_rel(a.counters + counter) == a.splits - 1;
  __syncthreads();
  if (!s_last) return;

  // Last block of this strip: every split's partial sum is in ws (L2). Output Hadamard, scales, bias; clear.
  float sv[4], bs[4] = {0.f, 0.f, 0.f, 0.f};
  exl3::load4_half(static_cast<const half*>(a.svh) + mat * a.n + strip * 128 + 4 * lane, sv);  // svh, bias [mats, n]
  if (a.bias) exl3::load4_half(static_cast<const half*>(a.bias) + mat * a.n + strip * 128 + 4 * lane, bs);
  char* const out = static_cast<char*>(a.out) + out_off * 2;
  for (int t = warp; t < a.m; t += 8) {
    float4* w = reinterpret_cast<float4*>(ws + static_cast<long>(t) * a.n + strip * 128 + 4 * lane);
    const float4 q = __ldcg(w);
    __stcg(w, make_float4(0.f, 0.f, 0.f, 0.f));
    float v[4] = {q.x, q.y, q.z, q.w};
    exl3::hadamard128_warp(v, lane);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = v[e] * sv[e] + bs[e];
    exl3::store4(out + (static_cast<size_t>(t) * a.out_stride + strip * 128 + 4 * lane) * 2, a.bf16, v);
  }
  if (threadIdx.x == 0) a.counters[counter] = 0;
}

template <int K, int CB, int G, class P>
cudaError_t launch_small(const P& p, cudaStream_t stream) {
  const Exl3GemmSmallArgs& a = args_of(p);
  constexpr int smem = smem_bytes(K, G);
  static_assert(smem <= 99 * 1024, "GB10: at most 99 KB of shared memory per block");
  // Raising the dynamic shared memory limit is a host-side function attribute: done once per kernel, and
  // legal while a stream is being captured.
  static std::atomic<uint64_t> raised{0};  // one bit per device
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (!(raised.load(std::memory_order_acquire) >> (dev & 63) & 1)) {
    err = cudaFuncSetAttribute(small_m_kernel<K, CB, G, P>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    raised.fetch_or(uint64_t{1} << (dev & 63), std::memory_order_acq_rel);
  }
  int mats = 1;
  if constexpr (kGrouped<P>) mats = p.mats;
  const dim3 grid(a.n / 128, a.splits, mats);
  return launch_pdl(small_m_kernel<K, CB, G, P>, grid, dim3(kThreads), smem_bytes(K, G, a.m < 8 * G ? a.m : 8 * G),
                    stream, p);
}

// Large-m path, folded: the whole weight W [k, n] (row-major) in x's dtype with suh, both Hadamards and svh applied,
// W = diag(suh) · Hk · W_hat · Hn · diag(svh), so the GEMM is one dense matmul y = x @ W (+ bias): no x' pass and
// no epilogue pass. The 128-point transforms go through the tensor cores: with k = 16a + b (and n = 16c + d),
// H128 = H8 ⊗ H16 (Sylvester order), so per 128 x 128 block
//   1. warp w decodes n-tile w's 8 k-tiles (the B operands of mma.m16n8k16, decode_tile.cuh) and applies H8 over
//      their k-tile index a with fp16 butterflies (3 x 16 HADD2/HSUB2 per lane);
//   2. per k-tile a: H16 along k as one mma pair with A = diag(suh / 128) · H16 (built once per block in shared
//      memory); the fp32 results go to shared memory in fp16 (two 64-column halves of 128-byte rows in the TMA's
//      128-byte swizzle, dw_off);
//   3. warp w takes k-tile w's 16 rows of all 8 n-tiles as mma A operands (ldmatrix), applies H8 over the n-tile
//      index c with fp16 butterflies, then H16 along n and svh in one mma pair per n-tile with
//      B = H16 · diag(svh of the tile) (per block in shared memory), and packs the fp32 results straight to x's
//      dtype into the rows it read;
//   4. the block leaves by two TMA tensor stores (one per half, from one thread).
// The exchange of step 3 carries W in fp16 once; svh and the bf16 conversion cost no instruction of their own.
// Rounding: fp16 butterflies and fp16 operands of the second product, ~6.5e-4 relative L2 of W in fp16 (an fp16
// rounding alone is ~2e-4); bf16 output adds its own rounding (~1.8e-3 in all).
constexpr int kDwHalf = 128 * 64;  // halves per 64-column half of the staged block (128 rows of 128 bytes)

// The staged block's layout, dw_off: (row r, column c) at offset (halves)
//   (c / 64) * kDwHalf + 64 r + 8 (((c / 8) % 8) ^ (r % 8)) + c % 8,
// i.e. half c / 64, its 16-byte chunk (c % 64) / 8 stored at chunk ^ (r % 8), the TMA's 128-byte swizzle. The fragment
// scatters (rows g, chunk fixed) and ldmatrix's phases (8 rows, chunk fixed) both land on 8 distinct chunks of 4
// banks: no conflicts.

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void butterfly_half2(uint32_t& a, uint32_t& b) {
  const __half2 x = *reinterpret_cast<const __half2*>(&a), y = *reinterpret_cast<const __half2*>(&b);
  const __half2 s = __hadd2(x, y), d = __hsub2(x, y);
  a = *reinterpret_cast<const uint32_t*>(&s), b = *reinterpret_cast<const uint32_t*>(&d);
}

// Sylvester H16 entry as an fp16 sign: (-1)^popcount(r & c).
__device__ __forceinline__ float h16_sign(int r, int c) { return (__popc(r & c) & 1) ? -1.f : 1.f; }

// Blocks per SM the registers are sized for: 4 on the H200 (64 registers; shared memory would allow 5), 2 on a GB10,
// whose 100 KB of shared memory per SM hold only two blocks anyway (up to 128 registers: 84-85 used, no spills).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define TWINSPARK_DEQUANT_W_MIN_BLOCKS 2
#else
#define TWINSPARK_DEQUANT_W_MIN_BLOCKS 4
#endif

// Step 3 of dequant_w for warp `warp`, after the block's k-side results are staged (it starts with the barrier).
template <bool BF16>
__device__ __forceinline__ void dw_n_side(half* stage, const uint2 (&bfrag)[16][32], int lane, int warp) {
  const int g = lane >> 2, t = lane & 3, g1 = g >> 1, g0 = g & 1;
  __syncthreads();
  // Warp w: rows 16w .. 16w + 15 of every n-tile c as A operands (ldmatrix.x4: lanes 0-15 rows, lanes 16-31 the
  // upper 8 columns), H8 over c, then H16 · diag(svh) per n-tile.
  uint32_t x[8][4];
  {
    const int l7 = lane & 7;
    const half* const lb = stage + (16 * warp + (lane & 15)) * 64 + 8 * ((lane >> 4) ^ (l7 & 1));
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const half* q = lb + (c >> 2) * kDwHalf + 16 * ((c & 3) ^ (l7 >> 1));
      ldmatrix_x4(q, x[c][0], x[c][1], x[c][2], x[c][3]);
    }
  }
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {  // H8 over the n-tile index
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c & h) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) butterfly_half2(x[c][q], x[c + h][q]);
    }
  }
  __syncwarp();  // every lane's rows are read before any lane rewrites them (each warp rewrites only its own rows)
  half* const ob = stage + (16 * warp + g) * 64 + 2 * t;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint2 bf = bfrag[2 * c + e][lane];
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_16816(d, x[c], bf.x, bf.y);  // columns 16c + 8e + 2t, + 1 of rows g, g + 8
      half* const o = ob + (c >> 2) * kDwHalf + 16 * ((c & 3) ^ g1) + 8 * (e ^ g0);
      *reinterpret_cast<uint32_t*>(o) = BF16 ? pack_bf162(d[0], d[1]) : pack_half2(d[0], d[1]);
      *reinterpret_cast<uint32_t*>(o + 512) = BF16 ? pack_bf162(d[2], d[3]) : pack_half2(d[2], d[3]);
    }
  }
}

// What dequant_w does of its work. The package builds kAll only; the other two exist for
// scripts/probe_dequant_w.py, which times the parts to bound the large path (DESIGN.md, large m): kKSide stops after
// step 2 with the k-side results in x's dtype, scaled by 1/sqrt(128) (y = Hn-and-svh of x @ that); kDecode stores the
// decoded registers as they are (no transform: a floor for any whole-weight decode, not a usable W).
enum class DwParts { kAll, kKSide, kDecode };

// BF16: W in bf16, else fp16 (a template argument: as a run-time flag both packs of step 3 were issued, one
// predicated off, 32 instructions per lane).
template <int K, int CB, bool BF16, DwParts kParts = DwParts::kAll>
__global__ void __launch_bounds__(256, TWINSPARK_DEQUANT_W_MIN_BLOCKS)
    dequant_w_kernel(const int16_t* __restrict__ trellis, const half* __restrict__ suh, const half* __restrict__ svh,
                     int tiles_k, int tiles_n, const __grid_constant__ CUtensorMap w_map) {
  __shared__ __align__(16) uint4 afrag[8][32];   // per k-tile a: this lane's A registers of diag(suh / 128) · H16
  __shared__ __align__(16) uint2 bfrag[16][32];  // per n-tile c and half e: this lane's B registers of H16 · diag(svh)
  __shared__ __align__(1024) half stage[2 * kDwHalf];  // the TMA's swizzle needs 1024-byte alignment
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int kb = blockIdx.x, nb = blockIdx.y;
  const exl3::LaneWindow<K> lw(lane);
  uint32_t wd[8][3];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t* tp =
        reinterpret_cast<const uint32_t*>(trellis + (static_cast<long>(8 * kb + j) * tiles_n + 8 * nb + warp) * 16 * K);
    wd[j][0] = __ldg(tp + lw.w0), wd[j][1] = __ldg(tp + lw.w1), wd[j][2] = lw.kTwoWords ? 0u : __ldg(tp + lw.w2);
  }
  // both orthonormal transforms' 1/sqrt(128); kKSide: one
  constexpr float kNorm = kParts == DwParts::kKSide ? 0.08838834764831845f : 1.f / 128.f;
  {  // thread (warp = a, lane) builds afrag[a][lane]: rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9
    const float s0 = __half2float(suh[128 * kb + 16 * warp + g]) * kNorm;
    const float s1 = __half2float(suh[128 * kb + 16 * warp + g + 8]) * kNorm;
    afrag[warp][lane] = make_uint4(pack_half2(s0 * h16_sign(g, 2 * t), s0 * h16_sign(g, 2 * t + 1)),
                                   pack_half2(s1 * h16_sign(g + 8, 2 * t), s1 * h16_sign(g + 8, 2 * t + 1)),
                                   pack_half2(s0 * h16_sign(g, 2 * t + 8), s0 * h16_sign(g, 2 * t + 9)),
                                   pack_half2(s1 * h16_sign(g + 8, 2 * t + 8), s1 * h16_sign(g + 8, 2 * t + 9)));
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // thread (warp = c, lane) builds bfrag[2c + e][lane]: rows 2t, 2t + 1, 2t + 8,
                                 // 2t + 9 of column 8e + g, times that column's svh (fp16 products: exact)
    const float s = __half2float(svh[128 * nb + 16 * warp + 8 * e + g]);
    const int col = 8 * e + g;
    bfrag[2 * warp + e][lane] = make_uint2(pack_half2(s * h16_sign(2 * t, col), s * h16_sign(2 * t + 1, col)),
                                           pack_half2(s * h16_sign(2 * t + 8, col), s * h16_sign(2 * t + 9, col)));
  }
  uint32_t p[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) exl3::decode_lane_words<K, CB>(wd[j][0], wd[j][1], wd[j][2], lw, p[j]);
#pragma unroll
  for (int h = 1; h < (kParts == DwParts::kDecode ? 1 : 8); h <<= 1) {  // H8 over the k-tile index
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j & h) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) butterfly_half2(p[j][q], p[j + h][q]);
    }
  }
  __syncthreads();  // afrag, bfrag
  // Offsets below are dw_off with the lane's part split off: every row a lane touches is g or g + 8 mod 8 (rows
  // lane % 8 for ldmatrix), so chunk ^ (row % 8) separates into per-lane terms and compile-time constants.
  const int g1 = g >> 1, g0 = g & 1;
  {
    // k-side results: rows 16a + g (+ 8) of columns 16 warp + 2t (+ 8): chunks 2 (warp % 4) and 2 (warp % 4) + 1
    const int base = (warp >> 2) * kDwHalf + g * 64 + 16 * ((warp & 3) ^ g1) + 2 * t;
    half* const k0 = stage + base + 8 * g0;        // columns 16 warp + 2t
    half* const k1 = stage + base + 8 * (1 ^ g0);  // columns 16 warp + 8 + 2t
#pragma unroll
    for (int a = 0; a < 8; ++a) {  // H16 along k: rows 16a .. 16a + 15 of n-tile warp, into the stage
      if constexpr (kParts == DwParts::kDecode) {
        *reinterpret_cast<uint32_t*>(k0 + 1024 * a) = p[a][0];
        *reinterpret_cast<uint32_t*>(k1 + 1024 * a) = p[a][1];
        *reinterpret_cast<uint32_t*>(k0 + 1024 * a + 512) = p[a][2];
        *reinterpret_cast<uint32_t*>(k1 + 1024 * a + 512) = p[a][3];
        continue;
      }
      const uint4 af = afrag[a][lane];
      const uint32_t a1[4] = {af.x, af.y, af.z, af.w};
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      mma_16816(c0, a1, p[a][0], p[a][1]);                          // n 0-7 of the tile
      mma_16816(c1, a1, p[a][2], p[a][3]);                          // n 8-15
      constexpr bool kOutBf16 = kParts == DwParts::kKSide && BF16;  // else fp16 for step 3
      *reinterpret_cast<uint32_t*>(k0 + 1024 * a) = kOutBf16 ? pack_bf162(c0[0], c0[1]) : pack_half2(c0[0], c0[1]);
      *reinterpret_cast<uint32_t*>(k1 + 1024 * a) = kOutBf16 ? pack_bf162(c1[0], c1[1]) : pack_half2(c1[0], c1[1]);
      *reinterpret_cast<uint32_t*>(k0 + 1024 * a + 512) =
          kOutBf16 ? pack_bf162(c0[2], c0[3]) : pack_half2(c0[2], c0[3]);
      *reinterpret_cast<uint32_t*>(k1 + 1024 * a + 512) =
          kOutBf16 ? pack_bf162(c1[2], c1[3]) : pack_half2(c1[2], c1[3]);
    }
  }
  if constexpr (kParts == DwParts::kAll) dw_n_side<BF16>(stage, bfrag, lane, warp);
  // The block leaves by two TMA tensor stores from one thread. 16-byte stores from the threads touched 16 L1 lines
  // per warp instruction (87% of the tag lookups); one cp.async.bulk per 256-byte row cost ~10 instructions each
  // (the addresses made warp-uniform lane by lane) and a quarter of the stall samples (ncu, DESIGN.md large m).
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes above, visible to the copy engine
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(stage + h * kDwHalf));
      asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(&w_map),
                   "r"(128 * nb + 64 * h), "r"(128 * kb), "r"(src)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // shared memory stays ours until read
  }
}

template <int K, DwParts kParts = DwParts::kAll>
cudaError_t launch_dequant_w_k(const int16_t* trellis, const void* suh, const void* svh, int tiles_k, int tiles_n,
                               int codebook, bool bf16, void* w, cudaStream_t stream) {
  const dim3 grid(tiles_k / 8, tiles_n / 8);  // k, n multiples of 128 (checked by the caller)
  CUtensorMap map;
  const cudaError_t err = tensor_map_b16_swizzle128(&map, w, 16ull * tiles_k, 16ull * tiles_n, 128);
  if (err != cudaSuccess) return err;
  return exl3::with_codebook(codebook, [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
    const auto* h = static_cast<const half*>(suh);
    const auto* v = static_cast<const half*>(svh);
    if (bf16) {
      dequant_w_kernel<K, CB, true, kParts><<<grid, 256, 0, stream>>>(trellis, h, v, tiles_k, tiles_n, map);
    } else {
      dequant_w_kernel<K, CB, false, kParts><<<grid, 256, 0, stream>>>(trellis, h, v, tiles_k, tiles_n, map);
    }
    return cudaGetLastError();
  });
}

template <int K, class P>
cudaError_t launch_small_k(const P& p, int codebook, int groups, cudaStream_t stream) {
  return exl3::with_codebook(codebook, [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
    switch (groups) {
      case 1:
        return launch_small<K, CB, 1>(p, stream);
      case 2:
        return launch_small<K, CB, 2>(p, stream);
      case 4:
        return launch_small<K, CB, 4>(p, stream);
      case 8:
        return launch_small<K, CB, 8>(p, stream);
      default:
        return cudaErrorInvalidValue;
    }
  });
}

}  // namespace exl3_gemm_detail
}  // namespace twinspark

#define TWINSPARK_EXL3_GEMM_DEFINE(K)                                                                          \
  namespace twinspark {                                                                                        \
  cudaError_t exl3_gemm_small_k##K(const Exl3GemmSmallArgs& a, int codebook, int groups, cudaStream_t s) {     \
    return exl3_gemm_detail::launch_small_k<K>(a, codebook, groups, s);                                        \
  }                                                                                                            \
  cudaError_t exl3_gemm_grouped_k##K(const Exl3GemmGroupedArgs& g, int codebook, int groups, cudaStream_t s) { \
    return exl3_gemm_detail::launch_small_k<K>(g, codebook, groups, s);                                        \
  }                                                                                                            \
  cudaError_t exl3_gemm_dequant_w_k##K(const int16_t* trellis, const void* suh, const void* svh, int tiles_k,  \
                                       int tiles_n, int codebook, bool bf16, void* w, cudaStream_t s) {        \
    return exl3_gemm_detail::launch_dequant_w_k<K>(trellis, suh, svh, tiles_k, tiles_n, codebook, bf16, w, s); \
  }                                                                                                            \
  }
