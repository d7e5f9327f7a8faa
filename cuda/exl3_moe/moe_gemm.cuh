// The grouped expert GEMM of exl3_moe, one kernel template for both halves of the layer:
//
//   gate/up (DOWN = false): block (item, 128 output columns of gate or up, k-split part). A = rows of x gathered
//     by token, times suh, 128-point Hadamard, fp16. Output: raw sums (before the output Hadamard) into the
//     fp32 gate/up buffer [splitk][P][2I] at the pair's row (each k-split part writes its own partial sums).
//   down (DOWN = true): block (item, 128 output columns of down). A = the pair's gate/up sums: output Hadamard,
//     svh, SiLU(gate) * up (clamped), suh of down, input Hadamard, fp16 (16-row items: made once per item by the
//     last gate/up block of each 128 columns of I, finish_act, and copied from p.act; 64-row items: made by
//     prep_a_kernel and copied, or with prep_a off built by every block). Output: Hadamard, svh, times the pair's
//     routing weight, fp32 atomics into out32 [T, H]; with fuse_convert the last block of each 128 columns writes them
//     to `out` in x's dtype.
//
// An item is up to 16*MT rows (routed pairs) of one expert; warp w owns output tile column w and decodes its 8
// tiles per 128-deep k-block (one Hadamard block) into registers with the GEMM's decoder (exl3/decode_tile.cuh).
// The rate of each expert is read on the device (experts may differ in K); one switch per block picks the decode
// template.
// - MT = 1 (decode, 16-row items): A of up to chunk_kb (8 gate/up, 10 down; fewer where fit_a_bytes shrinks the
//   region for a device with less shared memory, e.g. GB10) k-blocks is built or copied at once
//   (one memory round trip), the trellis streams through a kStages cp.async ring, and the tile is the mma A
//   operand (W_hat^T) against 8 rows of x' (one mma per tile while the item has <= 8 rows). mul1 items of <= 4 rows
//   take the byte-sum mma instead (gemm_body_bytes: u8 products x int8 x', see "byte-sum mma" below). Shared memory:
//   chunk_kb * 16 * 136 fp16 + kStages * 64 tiles * max_words int16 = 34 (42.5 down) + 12 KB at K = 2, + 48 KB
//   at K = 8.
// - MT = 4 (prefill, 64-row items): A and the tiles of the next k-block are staged while this one is multiplied
//   (double buffers); the tile is the mma B operand against 4 groups of 16 rows. A (x' for gate/up, the activations
//   for down) is made once per pair by prep_a_kernel and copied with cp.async (prep_a), or built by every block.
//   2 * 64 * 136 fp16 + 2 * 64 tiles * max_words int16 = 67 KB at K = 8.
// All <= 99 KB (GB10).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <atomic>

#include "common/arrive.cuh"
#include "common/pdl.cuh"
#include "common/trace.cuh"
#include "exl3_moe/exl3_moe.h"
#include "exl3_moe/moe_device.cuh"

namespace twinspark {
namespace moe {

constexpr int kThreads = 256;  // 8 warps: one per 16-column tile of the block's 128 columns
constexpr int kAStride = 136;  // fp16 per A row: 128 + 8 padding (ldmatrix rows land on distinct banks)
constexpr int kCStride = 132;  // fp32 per row of the down epilogue's staging buffer (reuses the A buffers)

struct GemmParams {
  const void* x;
  const float* topk_w;
  const int16_t* trellis;
  const int64_t* offsets;
  const int32_t* words;
  int64_t e_stride, m_stride;  // 0, or (packed layout, words13 and words2 set) offsets[e][mat] = e * e_stride +
                               // mat * m_stride (Exl3MoeArgs)
  const __half* suh13;
  const __half* svh13;
  const __half* suh2;
  const __half* svh2;
  const int32_t* ids;     // [P] global expert ids (read by the in-block routing)
  const int32_t* sorted;  // routing kernel's output (unused with small_route)
  const int32_t* items;
  const int32_t* num_items;
  int32_t* counters;
  float* gu32;  // [splitk][P][2I]: each k-split part writes its own partial sums (no atomics, no zeroing)
  float* out32;
  __half* act;            // down's fp16 activations [P][I] by pair: 16-row items: made once by gate/up (finish_act);
                          // 64-row items with prep_a: made by prep_a_kernel<true> between gate/up and down
  __half* xa;             // 64-row items with prep_a: gate/up's A, x' [2][P][H] fp16 by (mat, pair), made by
                          // prep_a_kernel<false> before gate/up
  bool prep_a;            // 64-row items: A copied from xa / act (made once per pair) instead of built in every block
  int32_t* act_counters;  // [max_items][I/128] arrivals of gate/up blocks, zero between calls
  int32_t* item_ready;    // [max_items] activation slices made (finish_act), then down blocks past wait_act; zero
                          // between calls
  void* out;
  int T, topk, H, I, P, E, first_expert;
  bool small_route;  // P <= 64: every block routes for itself (no routing launch); gate/up zeroes out32
  float limit;       // < 0: none
  bool x_bf16;
  int splitk;        // gate/up k-split parts (the gu32 slots); groups below short_groups use splitk - 1
  int short_groups;  // 16-row gate/up: (item, 128 columns of I) groups, in order, split into splitk - 1 parts; 0: none
  bool fuse_convert;
  int down_min_blocks;        // host side: the 16-row down kernel's variant, sized for 2 or 3 blocks per SM
  int gate_up_min_blocks;     // host side: the 16-row gate/up kernel sized for 3 or (mul1, one rate) 4 per SM
  bool bytesum;               // mul1, 16-row items of <= 4 rows: the byte-sum mma (gemm_body_bytes)
  bool early_down;            // 16-row items: a down block starts its item once that item's activations are made
                              // (wait_act), not when the whole gate/up grid is done
  bool pdl_gate_up;           // host side: gate/up launched with launch_pdl (it waits for the kernel before it first)
  int* residency;             // host side: null, or launch nothing and store the kernel's blocks per SM here
  int* a_kb_out;              // host side, with residency: null, or store the k-blocks its A region holds (16-row)
  int smem_per_sm;            // host side: 0, or the shared memory per SM to size for (Exl3MoeArgs::smem_per_sm)
  bool fit_smem;              // host side: fit_a_bytes on (else the full A region)
  int a_bytes;                // 16-row items: the A region's bytes (a multiple of kAKbBytes; set by the launch)
  int a_kb;                   // a_bytes / kAKbBytes: k-blocks of 16 fp16 rows it holds
  exl3::OpaqueConsts opaque;  // the byte-sum decoder's run-time constants (exl3::lane_state_fma)
  uint64_t* trace;            // null, or per-block timeline marks (common/trace.cuh): kernel 0 gate/up, 1 down; slots
                              // 1 start, 2 routed (body begins), 3 body done (partials stored / down atomics), 4 end,
                              // 5 the block is the one that makes the activations (gate/up) or converts (down)
};

// 16-row items: k-blocks of A built at once (16 rows * 272 B each). Down: 10, so an intermediate size up to 1280
// (1152 per rank here) is one chunk: its second chunk was a serial A build of one k-block (one warp working, the
// rest at the barrier) in the middle of every down block.
__host__ __device__ constexpr int chunk_kb(bool down) { return down ? 10 : 8; }
// 16-row items: bytes of one k-block of fp16 A (16 rows), the unit the A region is sized in.
constexpr int kAKbBytes = 16 * kAStride * 2;
// 16-row items: bytes of the full A chunk region; the trellis buffers follow the region (both bodies: p.a_bytes,
// which fit_a_bytes may make smaller).
__host__ __device__ constexpr int a_region_bytes(bool down) { return chunk_kb(down) * kAKbBytes; }
// The fewest k-blocks a region holds: the down epilogue stages 16 fp32 rows there (16 * kCStride * 4 B) and the
// byte-sum path needs one k-block of x' for 4 rows beside its scales.
constexpr int kAMinKb = 2;
constexpr int kStages = 3;  // 16-row items: trellis buffers (3 * 16 KB at K = 8)

// 16-row items: the A region a kernel launches with, of `full` bytes at most (a_region_bytes). The full one where
// `blocks` blocks per SM (the residency its registers were sized for) fit with it in `per_sm` bytes of shared memory
// per SM; else as many whole k-blocks as leave room for them (at least kAMinKb): a piece then builds its A in more
// chunks (one more memory round trip and barrier each), but keeps its SM's other blocks. The H200 (228 KB per SM) runs
// the full region up to K = 5 (from K = 6 on the smaller one is 0-15% faster there, DESIGN.md); GB10 (compute
// capability 12.x: 100 KB per SM) would run the full gate/up region at 1 block per SM from K = 3 on
// (cuda/exl3_moe/DESIGN.md "Shared memory on small-memory devices").
inline int fit_a_bytes(int full, size_t ring, size_t static_bytes, size_t reserved, size_t per_sm, int blocks) {
  const long room = static_cast<long>(per_sm / blocks) - static_cast<long>(reserved + static_bytes + ring);
  if (room >= full) return full;
  return static_cast<int>((room / kAKbBytes > kAMinKb ? room / kAKbBytes : kAMinKb) * kAKbBytes);
}

// 16-row items: A chunk + kStages tile buffers (K = 8, down: 42.5 + 48 KB); 64-row items: 2 A blocks + 2 tile
// buffers (K = 8: 34 + 32 KB). All <= 99 KB (GB10).
inline size_t gemm_smem_bytes(int mt, bool down, int max_words) {
  const size_t tiles = 64 * static_cast<size_t>(max_words) * 2;
  if (mt == 1) return static_cast<size_t>(a_region_bytes(down)) + kStages * tiles;
  return 2 * static_cast<size_t>(16 * mt) * kAStride * 2 + 2 * tiles;
}

// Rows of out32 [T, 128 columns from col0] -> out in x's dtype. L2 loads (__ldcg): other blocks' atomics.
__device__ __forceinline__ void convert_columns(const GemmParams& p, int col0) {
  for (int i = threadIdx.x; i < p.T * 32; i += blockDim.x) {
    const int t = i >> 5, c = col0 + (i & 31) * 4;
    const size_t o = static_cast<size_t>(t) * p.H + c;
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p.out32 + o));
    if (p.x_bf16) {
      __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + o);
      d[0] = __floats2bfloat162_rn(v.x, v.y);
      d[1] = __floats2bfloat162_rn(v.z, v.w);
    } else {
      __half2* d = reinterpret_cast<__half2*>(static_cast<__half*>(p.out) + o);
      d[0] = __floats2half2_rn(v.x, v.y);
      d[1] = __floats2half2_rn(v.z, v.w);
    }
  }
}

struct RowTables {
  int32_t pair[64];
  int32_t tok[64];
  float weight[64];
  int32_t e, chunk, rcnt, nitems, item;
};

// Routing of up to 64 pairs by warp 0 of every block, identical in every block (no launch, no workspace):
// a pair's rank = earlier pairs of its expert; items are (expert, 16-row chunk), numbered in order of their
// first pair. Fills rows.{e, rcnt, nitems, pair[]} for item `item`. Lane l holds pairs l and 32 + l; ranks come
// from warp match masks (and, past 32 pairs, 32 shuffles for the second half's earlier pairs in the first): the
// per-pair loop over earlier pairs in shared memory it replaces took a median 6.6 us per block at T=4 (v10 trace).
__device__ __forceinline__ void route_small(const GemmParams& p, int item, RowTables& rows) {
  const int lane = threadIdx.x & 31;
  int e2[2], rank[2];
  bool lead[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int q = lane + 32 * h;
    int e = q < p.P ? p.ids[q] - p.first_expert : -1;
    if (e < 0 || e >= p.E) e = -1;
    e2[h] = e;
  }
  const uint32_t below = (1u << lane) - 1u;
  // pairs past P or off this rank (e = -1) get a rank too, never used
  rank[0] = __popc(__match_any_sync(0xffffffffu, e2[0]) & below);
  rank[1] = __popc(__match_any_sync(0xffffffffu, e2[1]) & below);
  if (p.P > 32) {  // block-uniform
#pragma unroll
    for (int j = 0; j < 32; ++j) rank[1] += __shfl_sync(0xffffffffu, e2[0], j) == e2[1];
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) lead[h] = e2[h] >= 0 && (rank[h] & 15) == 0;
  const uint32_t l0 = __ballot_sync(0xffffffffu, lead[0]), l1 = __ballot_sync(0xffffffffu, lead[1]);
  const int id0 = __popc(l0 & below), id1 = __popc(l0) + __popc(l1 & below);
  if (lane == 0) {
    rows.nitems = __popc(l0) + __popc(l1);
    rows.e = -1;
  }
  __syncwarp();
  if (lead[0] && id0 == item) rows.e = e2[0], rows.chunk = rank[0] >> 4;
  if (lead[1] && id1 == item) rows.e = e2[1], rows.chunk = rank[1] >> 4;
  __syncwarp();
  const int ie = rows.e, ic = rows.chunk;
  int n = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool mine = ie >= 0 && e2[h] == ie && (rank[h] >> 4) == ic;
    if (mine) rows.pair[rank[h] & 15] = lane + 32 * h;
    n += __popc(__ballot_sync(0xffffffffu, mine));
  }
  if (lane == 0) rows.rcnt = n;
}

// Gate/up A, this lane's 4 values of k-block kb for token tok: x[tok] * suh of (e, mat), input Hadamard (fp32).
__device__ __forceinline__ void x_values(const GemmParams& p, int tok, int e, int mat, int kb, float (&v)[4]) {
  const int lane = threadIdx.x & 31;
  const int col = kb * 128 + lane * 4;
  const size_t xo = static_cast<size_t>(tok) * p.H + col;
  const void* xp = p.x_bf16 ? static_cast<const void*>(static_cast<const __nv_bfloat16*>(p.x) + xo)
                            : static_cast<const void*>(static_cast<const __half*>(p.x) + xo);
  float s[4];
  exl3::load4(xp, p.x_bf16, v);
  exl3::load4_half(p.suh13 + (static_cast<size_t>(e) * 2 + mat) * p.H + col, s);
#pragma unroll
  for (int q = 0; q < 4; ++q) v[q] *= s[q];
  exl3::hadamard128_warp(v, lane);
}

// Down A, this lane's 4 values of k-block kb for pair `pair` of expert e: the sum of the pair's k-split gate/up
// parts, output Hadamard, svh, SiLU(gate) * up (clamped), suh of down, input Hadamard (fp32).
template <bool SCALES_FIRST = false>
__device__ __forceinline__ void act_values(const GemmParams& p, int pair, int e, int kb, int parts, float (&v)[4]) {
  const int lane = threadIdx.x & 31;
  const int col = kb * 128 + lane * 4;
  float sg[4], su[4], sd[4];
  const auto load_scales = [&] {
    exl3::load4_half(p.svh13 + (static_cast<size_t>(e) * 2 + 0) * p.I + col, sg);
    exl3::load4_half(p.svh13 + (static_cast<size_t>(e) * 2 + 1) * p.I + col, su);
    exl3::load4_half(p.suh2 + static_cast<size_t>(e) * p.I + col, sd);
  };
  // SCALES_FIRST (finish_act, one warp per row on the layer's critical path): the scale loads overlap the parts'
  // L2 round trip (and hit L2 in the one-rate kernels: prefetch_act_scales). The 64-row build keeps them after it
  // (loaded first they cost 100 B of spills there).
  if constexpr (SCALES_FIRST) load_scales();
  const float* g = p.gu32 + static_cast<size_t>(pair) * 2 * p.I + col;
  const size_t part = static_cast<size_t>(p.P) * 2 * p.I;
  float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
  // The k-split parts' loads of a round are all issued before any is used (a plain loop over the run-time part
  // count waited one L2 round trip per part).
  constexpr int kRound = 4;
  for (int s0 = 0; s0 < parts; s0 += kRound) {
    float4 g4[kRound], u4[kRound];
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      const bool in = s0 + j < parts;  // L2 loads: other blocks of the running grid wrote them (finish_act)
      g4[j] = in ? __ldcg(reinterpret_cast<const float4*>(g + (s0 + j) * part)) : make_float4(0.f, 0.f, 0.f, 0.f);
      u4[j] = in ? __ldcg(reinterpret_cast<const float4*>(g + (s0 + j) * part + p.I)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      gv[0] += g4[j].x, gv[1] += g4[j].y, gv[2] += g4[j].z, gv[3] += g4[j].w;
      uv[0] += u4[j].x, uv[1] += u4[j].y, uv[2] += u4[j].z, uv[3] += u4[j].w;
    }
  }
  exl3::hadamard128_warp(gv, lane);
  exl3::hadamard128_warp(uv, lane);
  if constexpr (!SCALES_FIRST) load_scales();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float gq = gv[q] * sg[q], uq = uv[q] * su[q];
    if (p.limit >= 0.f) {
      gq = fminf(gq, p.limit);
      uq = fminf(fmaxf(uq, -p.limit), p.limit);
    }
    v[q] = gq / (1.f + __expf(-gq)) * uq * sd[q];
  }
  exl3::hadamard128_warp(v, lane);
}

// Row r (< rcnt) of the A block of k-block kb, this lane's 4 values: x_values (gate/up) or act_values (down).
template <bool DOWN, bool SCALES_FIRST = false>
__device__ __forceinline__ void a_row(const GemmParams& p, const RowTables& rows, int r, int e, int mat, int kb,
                                      int parts, float (&v)[4]) {
  if constexpr (DOWN) {
    act_values<SCALES_FIRST>(p, rows.pair[r], e, kb, parts, v);
  } else {
    x_values(p, rows.tok[r], e, mat, kb, v);
  }
}

// A block of k-block kb for rows [0, 16*MT): fp16, zero rows past rcnt.
template <bool DOWN, int MT>
__device__ __forceinline__ void produce_a(const GemmParams& p, const RowTables& rows, int rcnt, int e, int mat, int kb,
                                          __half* a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < 16 * MT; r += kThreads / 32) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < rcnt) a_row<DOWN>(p, rows, r, e, mat, kb, 1, v);  // 64-row items: gate/up is not split (one part)
    *reinterpret_cast<uint2*>(a + r * kAStride + lane * 4) = pack4_half(v);
  }
}

// Gate/up, 16-row items: the A blocks of k-blocks kb0 .. kb0+n-1 at once: tasks (k-block, row) are spread over
// the warps k-block first, so the few real rows of a decode item land on different warps and their loads overlap
// (one memory round trip per chunk instead of one per k-block). Block j lives at a + j * arows * kAStride.
// Only rows < rcnt are written (here and in copy_act_chunk): in the transposed mma of 16-row items a row of A is a
// column of the product, and the columns of rows >= rcnt are never stored, so whatever those rows hold cannot
// reach the output.
__device__ __forceinline__ void produce_chunk(const GemmParams& p, const RowTables& rows, int rcnt, int e, int mat,
                                              int kb0, int n, int arows, __half* a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < rcnt * n; i += kThreads / 32) {
    const int r = i / n, j = i - r * n;
    float v[4];
    a_row<false>(p, rows, r, e, mat, kb0 + j, 0, v);
    *reinterpret_cast<uint2*>(a + (j * arows + r) * kAStride + lane * 4) = pack4_half(v);
  }
}

// Down, 16-row items: the A blocks of k-blocks kb0 .. kb0+n-1 copied from the activations gate/up made
// (p.act, fp16 [P][I]): rcnt rows x n k-blocks x 16 pieces of 16 bytes, a round of loads in flight per thread.
__device__ __forceinline__ void copy_act_chunk(const GemmParams& p, const RowTables& rows, int rcnt, int kb0, int n,
                                               int arows, __half* a) {
  constexpr int kRound = 4;
  const int total = rcnt * n * 16;
  for (int i0 = threadIdx.x; i0 < total; i0 += kRound * kThreads) {
    uint4 v[kRound];
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      const int i = i0 + j * kThreads, r = i / (n * 16), q = i - r * n * 16;
      if (i < total)
        v[j] = __ldcg(reinterpret_cast<const uint4*>(p.act + static_cast<size_t>(rows.pair[r]) * p.I + kb0 * 128) + q);
    }
#pragma unroll
    for (int j = 0; j < kRound; ++j) {
      const int i = i0 + j * kThreads, r = i / (n * 16), q = i - r * n * 16;
      if (i < total) *reinterpret_cast<uint4*>(a + ((q >> 4) * arows + r) * kAStride + (q & 15) * 8) = v[j];
    }
  }
}

// The per-column scales a 16-row block's epilogue reads on the layer's critical path, fetched when the block starts
// (cold, they would cost that epilogue an HBM round trip, ~1 us at one token). Gate/up (finish_act: whichever block
// of the group arrives last builds the activations): svh of gate and up and suh of down for the 128 columns of I
// `slice`, 3 x 256 B prefetched into L2 (copied to shared memory instead, the K=3 loop's code grew 3% and the layer
// 2%: DESIGN.md, rejected ideas). Down: svh of down for its 128 output columns, 256 B to shared memory (cp.async, in
// the first group of the trellis ring; down_out reads them there). Only the one-rate kernels (decode) do either:
// with every 16-row kernel staging its scales in shared memory, those that dispatch on every rate spilled (T=32
// +1-2%).
__device__ __forceinline__ void prefetch_act_scales(const GemmParams& p, int e, int slice) {
  const int t = threadIdx.x, c = slice * 128 + (t & 1) * 64;  // 128-byte lines: two per 128 fp16
  if (t >= 6) return;
  const __half* src =
      t < 4 ? p.svh13 + (static_cast<size_t>(e) * 2 + (t >> 1)) * p.I + c : p.suh2 + static_cast<size_t>(e) * p.I + c;
  asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(src));
}
__device__ __forceinline__ __half* staged_svh2() {
  __shared__ __align__(16) __half svh[128];
  return svh;
}
__device__ __forceinline__ void stage_svh2(const GemmParams& p, int e, int slice) {
  const int t = threadIdx.x;
  if (t < 16) cp_async16(staged_svh2() + t * 8, p.svh2 + static_cast<size_t>(e) * p.H + slice * 128 + t * 8);
}

// Gate/up, 16-row items, after the block stored its partial sums: one acquire-release arrival per (item, 128
// columns of I); the last of the 2 * parts blocks (gate and up, every k part) makes down's activations of those
// columns for the item's rows (a_row<true>: part sum, output Hadamards, svh, SiLU(gate) * up, suh of down, input
// Hadamard) into p.act, and clears the counter. Every down block of the item then copies them (copy_act_chunk)
// instead of building them again (40 times per item at H = 5120).
__device__ __forceinline__ void finish_act(const GemmParams& p, const RowTables& rows, int item, int e, int rcnt,
                                           int slice, int parts) {
  __shared__ bool last;
  int32_t* counter = p.act_counters + static_cast<size_t>(item) * (p.I / 128) + slice;
  __syncthreads();  // the block's partial sums are stored
  if (threadIdx.x == 0) last = arrive_acq_rel(counter) == 2 * parts - 1;
  __syncthreads();
  if (!last) return;
  trace_mark(p.trace, 0, 5);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < rcnt; r += kThreads / 32) {
    float v[4];
    a_row<true, true>(p, rows, r, e, 2, slice, parts, v);
    *reinterpret_cast<uint2*>(p.act + static_cast<size_t>(rows.pair[r]) * p.I + slice * 128 + lane * 4) = pack4_half(v);
  }
  __syncthreads();  // the slice's activations are stored: publish them (release) to the item's waiting down blocks
  if (threadIdx.x == 0) {
    *counter = 0;
    if (p.early_down) red_add_release(p.item_ready + item);
  }
}

// Down, 16-row items: wait until this block may read its item's activations. early_down: thread 0 polls the item's
// count of made slices (acquire) until all I/128 are there, then counts itself past; the last of the item's
// gridDim.x down blocks clears the counter for the next call (every arrival of gate/up came before the first pass).
// Down blocks start only once every gate/up block has (pdl), so the wait cannot hold a slot gate/up needs. Should
// the count never arrive (a counter that was not zero on entry) the poll gives up after ~10 ms for the whole gate/up
// grid, which is always enough. Otherwise (and for the out32 atomics, which gate/up zeroes in decode): pdl_wait.
__device__ __forceinline__ void wait_act(const GemmParams& p, int item) {
  if (!p.early_down) {
    pdl_wait();
    return;
  }
  if (threadIdx.x == 0) {
    int32_t* c = p.item_ready + item;
    const int made = p.I / 128;
    for (int spins = 0; load_acquire(c) < made; ++spins) {
      if (spins == (1 << 14)) {
        pdl_wait();
        break;
      }
      __nanosleep(32);
    }
    if (atomicAdd(c, 1) == made + static_cast<int>(gridDim.x) - 1) *c = 0;
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------ byte-sum mma
// mul1, 16-row items of <= 4 rows (every decode item up to T = 4). A mul1 weight is an affine map of h = 1024 + B,
// B = the sum of the four bytes of state * kMul1Mult, so
//   sum_k x'_k w_k = kMul1Scale * (sum_k x'_k B_k + (1024 + kMul1Shift / kMul1Scale) * sum_k x'_k).
// The tiles feed mma.m16n8k32 (u8 x s8 -> s32) with the products themselves, each weight's 4 bytes against x'_k
// repeated in 4 bytes: the tensor cores add the bytes, so a weight costs its state cut and one IMAD instead of
// the cut, IMAD, IDP4A, half a pack and half an HFMA2 (the weights are used exactly: no fp16 rounding of w).
// x' is quantized per row and 128-deep k-block: s = max|x'| / 127, hi = rint(x' / s), lo = rint((x' / s - hi) * 254),
// x' ~= s * (hi + lo / 254) within max|x'| * 1.6e-5. The 8 mma columns are (row r, hi) = 2r and (row r, lo) = 2r + 1.
// Per 16-deep k-tile, two mmas (k-tile columns 0-7 and 8-15 of the tile; 32 bytes = 8 weights each). Lane (g, t)
// of the A operand holds positions j of its decode (exl3-format.md: k = 2t + (j & 1) + 8 (j >> 1 & 1), n = g + 8
// (j >> 2)): mma h takes {x[2h], x[2h + 4], x[2h + 1], x[2h + 5]}, i.e. weight slot t <- k = 2t + 8h and slot 4 + t
// <- k = 2t + 8h + 1; the B registers follow the same slot -> k map.
// Shared memory (inside the A chunk region of the 16-row kernel):
//   xq [slot][chunk k-blocks][8 k-tiles] 16 B: lane (g, t) of B reads slot 4g + t: its registers of both mmas,
//      {x'[2t], x'[2t + 1], x'[2t + 8], x'[2t + 9]} of column g, each as 4 equal bytes. Only columns < 2 rcnt are
//      stored (rcnt KB per k-block); the other lanes read column g & 1 (their products are never stored). Slots are
//      chunk * 128 + 16 bytes apart, so the 8 lanes of a 16-byte load phase hit 8 different bank groups (at
//      chunk * 128 apart they all hit one: an 8-way conflict per tile, 2x slower in the first H200 run);
//   sc [k-blocks][4 rows] {s, s / 254, z, 0}: z = (1024 + kMul1Shift / kMul1Scale) * sum_k x'_k of the k-block.
constexpr int kBytesRows = 4;
constexpr int kBytesMaxKb = 32;
constexpr int kBytesScaleBytes = kBytesMaxKb * kBytesRows * 16;
constexpr float kMul1Offset = 1024.f + exl3::kMul1Shift / exl3::kMul1Scale;

// k-blocks of x' per chunk (the A region minus the scales; with the full region rcnt = 1 .. 4 -> 31 / 15 / 10 / 7
// gate/up, 32 / 20 / 13 / 10 down), and the slot stride in bytes.
__device__ __forceinline__ int bytes_chunk(int a_bytes, int rcnt) {
  return min(kBytesMaxKb, ((a_bytes - kBytesScaleBytes) / (8 * rcnt) - 16) / 128);
}
__device__ __forceinline__ int bytes_slot_stride(int chunk) { return chunk * 128 + 16; }

// Warp: row r of k-block j of the chunk, 4 fp32 values per lane (x'[4 lane .. 4 lane + 3] of the k-block, as from
// a_row) -> its hi / lo bytes in xq and its scale terms in sc.
__device__ __forceinline__ void store_row_bytes(const float (&v)[4], int r, int j, int chunk, uint8_t* xq, float4* sc) {
  const int lane = threadIdx.x & 31;
  float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float inv = m > 0.f ? 127.f / m : 0.f;
  int hi[4], lo[4], sum = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float y = v[q] * inv;
    hi[q] = __float2int_rn(y);
    lo[q] = __float2int_rn((y - static_cast<float>(hi[q])) * 254.f);
    sum += 254 * hi[q] + lo[q];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // value q of this lane is k-tile lane / 4, offset o = 4 (lane % 4) + q: B lane t' = (o % 8) / 2, mma o / 8, and
  // register o % 2 of that mma
  const int kt = lane >> 2, u = lane & 3, t0 = 2 * (u & 1), h = u >> 1;
  const auto rep = [](int b) { return __byte_perm(static_cast<uint32_t>(b), 0u, 0x0000); };
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    const int* q = part ? lo : hi;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int slot = (2 * r + part) * 4 + t0 + i;
      *reinterpret_cast<uint2*>(xq + slot * bytes_slot_stride(chunk) + j * 128 + kt * 16 + 8 * h) =
          make_uint2(rep(q[2 * i]), rep(q[2 * i + 1]));
    }
  }
  if (lane == 0) {
    const float s = m * (1.f / 127.f), s254 = s * (1.f / 254.f);
    sc[j * kBytesRows + r] = make_float4(s, s254, kMul1Offset * s254 * static_cast<float>(sum), 0.f);
  }
}

// Gate/up: the chunk's x' (tasks (row, k-block) over the warps, as produce_chunk).
__device__ __forceinline__ void produce_bytes(const GemmParams& p, const RowTables& rows, int rcnt, int e, int mat,
                                              int kb0, int n, int chunk, uint8_t* xq, float4* sc) {
  const int warp = threadIdx.x >> 5;
  for (int i = warp; i < rcnt * n; i += kThreads / 32) {
    const int r = i / n, j = i - r * n;
    float v[4];
    a_row<false>(p, rows, r, e, mat, kb0 + j, 0, v);
    store_row_bytes(v, r, j, chunk, xq, sc);
  }
}

// Down: the chunk's x' from the activations gate/up made (p.act, fp16 [P][I]); two tasks' loads in flight per warp.
__device__ __forceinline__ void copy_act_bytes(const GemmParams& p, const RowTables& rows, int rcnt, int kb0, int n,
                                               int chunk, uint8_t* xq, float4* sc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, total = rcnt * n;
  constexpr int kWarps = kThreads / 32;
  for (int i0 = warp; i0 < total; i0 += 2 * kWarps) {
    uint2 hv[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = i0 + u * kWarps, r = i / n, j = i - r * n;
      if (i < total)
        hv[u] = __ldcg(reinterpret_cast<const uint2*>(p.act + static_cast<size_t>(rows.pair[r]) * p.I +
                                                      (kb0 + j) * 128 + lane * 4));
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = i0 + u * kWarps, r = i / n, j = i - r * n;
      if (i < total) {  // warp-uniform
        const __half2 a = *reinterpret_cast<const __half2*>(&hv[u].x), b = *reinterpret_cast<const __half2*>(&hv[u].y);
        const float v[4] = {__low2float(a), __high2float(a), __low2float(b), __high2float(b)};
        store_row_bytes(v, r, j, chunk, xq, sc);
      }
    }
  }
}

// One 128-deep k-block of the byte-sum path: warp w decodes its 8 tiles (column tile w) into products, two
// mma.m16n8k32 per tile into int32 sums, then adds s * hi-sums + s / 254 * lo-sums + z into f (rows g and g + 8 of
// the tile's 16 columns for the lane's row t = lane % 4).
template <int KA, bool HALF>
__device__ __forceinline__ void mma_kblock_bytes(const int16_t* tb, const uint4* xk, const float4* scp,
                                                 const exl3::OpaqueConsts& oc, float (&f)[2]) {
  constexpr int kW = 16 * KA + (HALF ? 8 : 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const exl3::LaneWindow<HALF ? 1 : KA> lw(lane);
  const int16_t* tbw = tb + warp * kW;
  int c[4] = {0, 0, 0, 0}, d[4] = {0, 0, 0, 0};  // two chains of 8 dependent mmas instead of one of 16
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    const uint32_t* tw = reinterpret_cast<const uint32_t*>(tbw + kt * 8 * kW);
    uint32_t x[8];
    if constexpr (HALF) {
      uint32_t st[8];
      half_states<KA>(tw, lane, st);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = st[j] * exl3::kMul1Mult;
    } else {
      exl3::mul1_products<KA>(tw, lw, oc, x);
    }
    const uint4 b = xk[kt];
    const uint32_t a0[4] = {x[0], x[4], x[1], x[5]}, a1[4] = {x[2], x[6], x[3], x[7]};
    mma_u8s8_16832(c, a0, b.x, b.y);
    mma_u8s8_16832(d, a1, b.z, b.w);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) c[q] += d[q];
  // c0, c1: output column g, (hi, lo) of row t; c2, c3: column g + 8
  const float4 sc = *scp;
  f[0] += fmaf(sc.x, static_cast<float>(c[0]), fmaf(sc.y, static_cast<float>(c[1]), sc.z));
  f[1] += fmaf(sc.x, static_cast<float>(c[2]), fmaf(sc.y, static_cast<float>(c[3]), sc.z));
}

// Stage the 8x8 trellis tiles of k-block kb for column slice `slice` (8 k-tile rows of 8 consecutive tiles, kW
// int16 per tile) into dst with 16-byte cp.async; the caller commits.
// Compile-time trip count (1-4 copies per thread; see load_chunk in exl3_gemm/small_m.cuh for why).
template <int kW>
__device__ __forceinline__ void issue_tiles(const int16_t* tr, int tiles_n, int slice, int kb, int16_t* dst) {
  const int16_t* src = tr + (static_cast<size_t>(kb) * 8 * tiles_n + slice * 8) * kW;
  constexpr int kTotal = 8 * kW, kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (kTotal % kThreads == 0 || i < kTotal) {
      const int kt = i / kW, c = i - kt * kW;
      cp_async16(dst + kt * 8 * kW + c * 8, src + static_cast<size_t>(kt) * tiles_n * kW + c * 8);
    }
  }
}

// This warp's own 8 tiles of consecutive k-blocks (column tile `warp` of the slice, k-tile rows 0-7): the only tiles
// its mma_kblock / mma_kblock_bytes read, so a warp can wait for its copies alone (cp.async wait + __syncwarp, no
// block barrier per k-block). kW 16-byte pieces per warp: 1-4 per lane. The addresses are made once: per piece a
// global pointer that advances one k-block per issue and its shared-memory address in stage 0 of the ring. Made per
// k-block from (kb, slice, warp) they took ~28 of the K=2 byte-sum loop's 261 instructions per k-block (64-bit
// products, the generic-to-shared conversion).
template <int kW>
struct WarpTiles {
  static constexpr int kPer = kW / 8, kIters = (kW + 31) / 32;  // pieces per tile; copies per lane
  const int16_t* src[kIters];
  uint32_t dst[kIters];
  size_t step;  // int16 per k-block

  __device__ __forceinline__ WarpTiles(const int16_t* tr, int tiles_n, int slice, int kb, const int16_t* tbuf) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    step = static_cast<size_t>(8) * tiles_n * kW;
    const int16_t* base = tr + kb * step + static_cast<size_t>(slice * 8 + warp) * kW;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int c = lane + 32 * j, kt = c / kPer, q = c - kt * kPer;
      src[j] = base + static_cast<size_t>(kt) * tiles_n * kW + q * 8;
      dst[j] = static_cast<uint32_t>(__cvta_generic_to_shared(tbuf + (kt * 8 + warp) * kW + q * 8));
      asm("" : "+r"(dst[j]));  // opaque: kept (or spilled), not remade from the thread index every k-block
    }
  }

  // The next k-block's pieces into the ring stage `stage` int16 past stage 0; the caller commits.
  __device__ __forceinline__ void issue(int stage) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      if (kW % 32 == 0 || lane + 32 * j < kW) cp_async16_shared(dst[j] + 2 * stage, src[j]);
      src[j] += step;
    }
  }
};

// One 128-deep k-block: warp w decodes its 8 tiles (column tile w) and multiplies every 16-row group of A.
// TWO (16-row items): the item has more than 8 rows, so each tile takes a second mma (a block-uniform choice made
// per k-block by the caller: a predicated-off ldmatrix + mma still took two issue slots per tile).
template <int CB, int MT, int KA, bool HALF, bool TWO = true>
__device__ __forceinline__ void mma_kblock(const int16_t* tb, const __half* ab, int rcnt, float acc[MT][2][4]) {
  constexpr int kW = 16 * KA + (HALF ? 8 : 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const exl3::LaneWindow<HALF ? 1 : KA> lw(lane);  // whole rates: the GEMM's per-lane decoder
  // ldmatrix.x4 row address of this lane: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) = a0a1, a2a3, a4a5, a6a7.
  const int a_row_ = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  // 16-row items: all 8 tiles unrolled (the tile and x' addresses become immediate offsets: ~8 fewer address
  // instructions per tile than unroll 2); 64-row items keep unroll 2 (their 32 accumulators).
  const int16_t* tbw = tb + warp * kW;
#pragma unroll(MT == 1 ? 8 : 2)
  for (int kt = 0; kt < 8; ++kt) {
    uint32_t b[4];
    const uint32_t* tw = reinterpret_cast<const uint32_t*>(tbw + kt * 8 * kW);
    if constexpr (HALF) {
      decode_tile_half<CB, KA>(tw, lane, b);
    } else {
      exl3::decode_lane<KA, CB>(tw, lw, b);
    }
    if constexpr (MT == 1) {
      // Decode items: the tile is the A operand (W_hat^T, n x k) and 8 rows of x' the B operand, so an item of
      // up to 8 rows costs one mma per tile (acc[0][h] = C [16 columns x rows 8h..8h+7]).
      const uint32_t af[4] = {b[0], b[2], b[1], b[3]};
      uint32_t x0, x1;
      ldmatrix_x2(x0, x1, ab + (lane & 7) * kAStride + kt * 16 + 8 * ((lane >> 3) & 1));
      mma_16816(acc[0][0], af, x0, x1);
      if (TWO) {
        ldmatrix_x2(x0, x1, ab + (8 + (lane & 7)) * kAStride + kt * 16 + 8 * ((lane >> 3) & 1));
        mma_16816(acc[0][1], af, x0, x1);
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt * 16 < rcnt) {
          uint32_t a[4];
          ldmatrix_x4(a, ab + (mt * 16 + a_row_) * kAStride + kt * 16 + a_col);
          mma_16816(acc[mt][0], a, b[0], b[1]);
          mma_16816(acc[mt][1], a, b[2], b[3]);
        }
      }
    }
  }
}

// Down epilogue: the block's raw sums staged in cbuf [rcnt][kCStride] -> output Hadamard, svh, times the pair's
// routing weight, fp32 atomics into out32. STAGED: svh is in shared memory (stage_svh2), else read from global.
template <bool STAGED>
__device__ __forceinline__ void down_out(const GemmParams& p, const RowTables& rows, int e, int rcnt, int slice,
                                         const float* cbuf) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();  // early_down: gate/up (which zeroes out32 in decode) may still run until here
  if constexpr (STAGED) cp_async_wait<0>();  // the first ring group: long done
  __syncthreads();
  const int col = slice * 128 + lane * 4;
  float sv[4];
  if constexpr (STAGED) {
    exl3::load4_half(staged_svh2() + lane * 4, sv);
  } else {
    exl3::load4_half(p.svh2 + static_cast<size_t>(e) * p.H + col, sv);
  }
  for (int r = warp; r < rcnt; r += kThreads / 32) {
    const float4 c4 = *reinterpret_cast<const float4*>(cbuf + r * kCStride + lane * 4);
    float v[4] = {c4.x, c4.y, c4.z, c4.w};
    exl3::hadamard128_warp(v, lane);
    const float w = rows.weight[r];
    float* d = p.out32 + static_cast<size_t>(rows.tok[r]) * p.H + col;
#pragma unroll
    for (int q = 0; q < 4; ++q) atomicAdd(d + q, v[q] * w * sv[q]);
  }
}

// 16-row items (both bodies): A of up to `chunk` k-blocks is built (gate/up) or copied (down) at once (one memory
// round trip per chunk) and the trellis streams through kStages buffers (kStages - 1 k-blocks in flight while one is
// multiplied). fill(c0, cn): A of the chunk's k-blocks kb0 + c0 .. kb0 + c0 + cn - 1; step(tb, j): multiply k-block j
// of the chunk, its tiles in tb. Each warp streams its own tiles (WarpTiles) and waits for them alone: the
// block meets at a barrier once per chunk (A), not once per k-block, so its warps need not run in step.
template <bool DOWN, int kW, class Fill, class Step>
__device__ __forceinline__ void chunk_ring(const GemmParams& p, const RowTables& rows, const int16_t* tr, int slice,
                                           int kb0, int nkb, int chunk, int16_t* tbuf, Fill&& fill, Step&& step) {
  constexpr int kStage = 64 * kW, kLast = (kStages - 1) * kStage;  // int16 per ring stage; the last stage
  WarpTiles<kW> tiles(tr, (DOWN ? p.H : p.I) / 16, slice, kb0, tbuf);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nkb) tiles.issue(s * kStage);
    cp_async_commit();
  }
  if constexpr (DOWN) wait_act(p, rows.item);  // the weights are on their way; A is what the gate/up kernel made
  int rd = 0, wr = kLast;  // ring stages of k-block i and of k-block i + kStages - 1 (issued at step i)
  for (int c0 = 0; c0 < nkb; c0 += chunk) {
    const int cn = min(chunk, nkb - c0);
    if (c0 > 0) __syncthreads();  // everyone is done with the previous chunk's A
    fill(c0, cn);
    __syncthreads();  // A is ready
    for (int i = c0; i < c0 + cn; ++i) {
      cp_async_wait<kStages - 2>();  // this lane's copies of k-block i have landed
      __syncwarp();                  // the warp's have; its buffer (i - 1) % kStages is free (its lanes are past it)
      if (i + kStages - 1 < nkb) tiles.issue(wr);
      cp_async_commit();  // possibly empty: keeps one group per k-block
      step(tbuf + rd, i - c0);
      rd = rd == kLast ? 0 : rd + kStage;
      wr = wr == kLast ? 0 : wr + kStage;
    }
  }
}

// The 16-row body for mul1 items of <= 4 rows with the byte-sum mma (see "byte-sum mma" above): the same chunked
// A and trellis ring as gemm_body (chunk_ring), x' as bytes.
template <bool DOWN, bool STAGED, int KA, bool HALF>
__device__ __forceinline__ void gemm_body_bytes(const GemmParams& p, char* smem, const RowTables& rows, int e, int rcnt,
                                                int mat, int slice, int part, int kb0, int kb1, const int16_t* tr) {
  constexpr int kW = 16 * KA + (HALF ? 8 : 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nkb = kb1 - kb0, chunk = bytes_chunk(p.a_bytes, rcnt);
  uint8_t* xq = reinterpret_cast<uint8_t*>(smem);
  float4* sc = reinterpret_cast<float4*>(smem + p.a_bytes - kBytesScaleBytes);
  int16_t* tbuf = reinterpret_cast<int16_t*>(smem + p.a_bytes);  // [kStages][64][kW]
  const int g = lane >> 2, t = lane & 3;
  const uint8_t* xl = xq + ((g < 2 * rcnt ? g : (g & 1)) * 4 + t) * bytes_slot_stride(chunk);  // this lane's slot
  float f[2] = {0.f, 0.f};
  chunk_ring<DOWN, kW>(
      p, rows, tr, slice, kb0, nkb, chunk, tbuf,
      [&](int c0, int cn) {
        if constexpr (DOWN) {
          copy_act_bytes(p, rows, rcnt, kb0 + c0, cn, chunk, xq, sc);
        } else {
          produce_bytes(p, rows, rcnt, e, mat, kb0 + c0, cn, chunk, xq, sc);
        }
      },
      [&](const int16_t* tb, int j) {
        mma_kblock_bytes<KA, HALF>(tb, reinterpret_cast<const uint4*>(xl + j * 128), sc + j * kBytesRows + t, p.opaque,
                                   f);
      });
  // lane (g, t): output columns warp * 16 + g and + 8 of row t
  const float y0 = exl3::kMul1Scale * f[0], y1 = exl3::kMul1Scale * f[1];
  if constexpr (!DOWN) {
    if (t < rcnt) {
      float* dst = p.gu32 + static_cast<size_t>(part) * p.P * 2 * p.I + static_cast<size_t>(rows.pair[t]) * 2 * p.I +
                   static_cast<size_t>(mat) * p.I + slice * 128 + warp * 16 + g;
      dst[0] = y0;
      dst[8] = y1;
    }
  } else {
    __syncthreads();  // all warps are done reading x': reuse the region for the fp32 staging rows
    float* cbuf = reinterpret_cast<float*>(smem);
    if (t < rcnt) {
      cbuf[t * kCStride + warp * 16 + g] = y0;
      cbuf[t * kCStride + warp * 16 + g + 8] = y1;
    }
    down_out<STAGED>(p, rows, e, rcnt, slice, cbuf);
  }
}

// STAGED: a one-rate kernel, whose down blocks stage svh (stage_svh2). COPY (64-row items, prep_a): A is copied from
// what prep_a_kernel made (a kernel of its own, so the kernel that builds A in every block stays as it was).
template <int CB, int MT, bool DOWN, bool STAGED, int KA, bool HALF, bool COPY = false>
__device__ __forceinline__ void gemm_body(const GemmParams& p, char* smem, const RowTables& rows, int e, int rcnt,
                                          int mat, int slice, int part, int kb0, int kb1, const int16_t* tr) {
  constexpr int kW = 16 * KA + (HALF ? 8 : 0);  // int16 per tile
  constexpr int kRows = 16 * MT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles_n = (DOWN ? p.H : p.I) / 16;
  const int nkb = kb1 - kb0;
  if constexpr (MT == 1 && CB == exl3::kCbMul1) {
    if (p.bytesum && rcnt <= kBytesRows) {
      gemm_body_bytes<DOWN, STAGED, KA, HALF>(p, smem, rows, e, rcnt, mat, slice, part, kb0, kb1, tr);
      return;
    }
  }

  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][h][q] = 0.f;

  if constexpr (MT == 1) {
    // 16-row items (decode): A of up to a_bytes / kAKbBytes k-blocks (chunk_kb with the full region) is built
    // (gate/up) or copied (down) at once (one memory round trip per chunk) and the trellis streams through kStages
    // buffers (kStages - 1 k-blocks in flight while one is multiplied).
    // Items of <= 8 rows (most decode items) read only rows 0-7 of A: their k-blocks are 8 rows apart, so twice
    // as many fit in the chunk (gate/up at 3 k-split parts: 14 k-blocks, one A build instead of two).
    const int arows = rcnt > 8 ? 16 : 8;
    const int chunk = rcnt > 8 ? p.a_kb : 2 * p.a_kb;
    __half* abuf = reinterpret_cast<__half*>(smem);                // [chunk][arows][kAStride]
    int16_t* tbuf = reinterpret_cast<int16_t*>(smem + p.a_bytes);  // [kStages][64][kW]
    chunk_ring<DOWN, kW>(
        p, rows, tr, slice, kb0, nkb, chunk, tbuf,
        [&](int c0, int cn) {
          if constexpr (DOWN) {
            copy_act_chunk(p, rows, rcnt, kb0 + c0, cn, arows, abuf);
          } else {
            produce_chunk(p, rows, rcnt, e, mat, kb0 + c0, cn, arows, abuf);
          }
        },
        [&](const int16_t* tb, int j) {
          const __half* ab = abuf + j * arows * kAStride;
          if (rcnt > 8) {
            mma_kblock<CB, MT, KA, HALF, true>(tb, ab, rcnt, acc);
          } else {
            mma_kblock<CB, MT, KA, HALF, false>(tb, ab, rcnt, acc);
          }
        });
  } else {
    // 64-row items (prefill): A and the tiles of the next k-block are staged while this one is multiplied. A is
    // copied with the tiles (prep_a: x' or the activations, made once per pair by prep_a_kernel; the rows past rcnt
    // are left as they are: a row of A only reaches the same row of the product, which is never stored), or built
    // here by every block that multiplies it (18 gate/up blocks per item and matrix pair, H/128 down blocks).
    __half* abuf = reinterpret_cast<__half*>(smem);                           // [2][kRows][kAStride]
    int16_t* tbuf = reinterpret_cast<int16_t*>(abuf + 2 * kRows * kAStride);  // [2][64][kW]
    const __half* asrc = DOWN ? p.act : p.xa + static_cast<size_t>(mat) * p.P * p.H;
    const int ald = DOWN ? p.I : p.H;
    const auto copy_a = [&](int kb, __half* a) {
      for (int i = threadIdx.x; i < rcnt * 16; i += kThreads) {
        const int r = i >> 4, c = i & 15;
        cp_async16(a + r * kAStride + c * 8, asrc + static_cast<size_t>(rows.pair[r]) * ald + kb * 128 + c * 8);
      }
    };
    issue_tiles<kW>(tr, tiles_n, slice, kb0, tbuf);
    if constexpr (DOWN) pdl_wait();  // the weights are on their way; A reads what the kernels before made
    if constexpr (COPY) copy_a(kb0, abuf);
    cp_async_commit();
    if constexpr (!COPY) produce_a<DOWN, MT>(p, rows, rcnt, e, mat, kb0, abuf);
    for (int i = 0; i < nkb; ++i) {
      cp_async_wait<0>();
      __syncthreads();  // tiles and A of k-block i ready; everyone is done with the other buffers
      if (i + 1 < nkb) {
        issue_tiles<kW>(tr, tiles_n, slice, kb0 + i + 1, tbuf + ((i + 1) & 1) * 64 * kW);
        if constexpr (COPY) copy_a(kb0 + i + 1, abuf + ((i + 1) & 1) * kRows * kAStride);
        cp_async_commit();
      }
      mma_kblock<CB, MT, KA, HALF>(tbuf + (i & 1) * 64 * kW, abuf + (i & 1) * kRows * kAStride, rcnt, acc);
      if constexpr (!COPY) {
        if (i + 1 < nkb)
          produce_a<DOWN, MT>(p, rows, rcnt, e, mat, kb0 + i + 1, abuf + ((i + 1) & 1) * kRows * kAStride);
      }
    }
  }

  // Accumulator fragment, MT = 4: c0,c1 at (row lane/4, cols 2*(lane%4) + {0,1}), c2,c3 at row + 8.
  // MT = 1 (transposed): acc[0][h][q] is row 8h + 2*(lane%4) + (q & 1), column lane/4 + 8*(q >> 1).
  const int fr = lane >> 2, fc = 2 * (lane & 3);
  if constexpr (MT == 1 && !DOWN) {
    float* dst = p.gu32 + static_cast<size_t>(part) * p.P * 2 * p.I + static_cast<size_t>(mat) * p.I + slice * 128 +
                 warp * 16 + fr;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = 8 * h + fc + (q & 1);
        if (r < rcnt) dst[static_cast<size_t>(rows.pair[r]) * 2 * p.I + 8 * (q >> 1)] = acc[0][h][q];
      }
  } else if constexpr (!DOWN) {
    float* dst = p.gu32 + static_cast<size_t>(part) * p.P * 2 * p.I + static_cast<size_t>(mat) * p.I + slice * 128 +
                 warp * 16 + fc;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = mt * 16 + fr + 8 * hr;
        if (r < rcnt) {
          float* d = dst + static_cast<size_t>(rows.pair[r]) * 2 * p.I;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(d + h * 8) = make_float2(acc[mt][h][2 * hr], acc[mt][h][2 * hr + 1]);
        }
      }
  } else {
    __syncthreads();                               // all warps are done reading A: reuse it for the fp32 staging rows
    float* cbuf = reinterpret_cast<float*>(smem);  // [kRows][kCStride]
    if constexpr (MT == 1) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          cbuf[(8 * h + fc + (q & 1)) * kCStride + warp * 16 + fr + 8 * (q >> 1)] = acc[0][h][q];
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + fr + 8 * hr;
            *reinterpret_cast<float2*>(cbuf + r * kCStride + warp * 16 + h * 8 + fc) =
                make_float2(acc[mt][h][2 * hr], acc[mt][h][2 * hr + 1]);
          }
    }
    down_out<MT == 1 && STAGED>(p, rows, e, rcnt, slice, cbuf);
  }
}

// Rate of expert e's matrix from its words per tile; calls the body decoded for that rate. words and tr (the
// matrix's trellis) are read by the caller, both loads in flight at once (the switch and the first weight fetch wait
// for one round trip, not two in a row). WORDS != 0: a kernel for layers whose matrices of this half all have that
// rate (the host knows: Exl3MoeArgs::words13 / words2) holds that body alone: ~1/11 of the code (at T=1 the
// once-per-warp code runs cold on every SM) and 71-88 registers instead of 101 (down) with no spills. H200, same
// build, with cap_blocks_per_sm (DESIGN.md "The 16-row decode body"): T=1 -2.3 / -1.7 / -4.5%, T=2 -4.3 / -0.7 /
// -4.2% at K=2/3/4.
template <int CB, int MT, bool DOWN, int WORDS, bool COPY = false>
__device__ __forceinline__ void dispatch_rate(const GemmParams& p, char* smem, const RowTables& rows, int e, int rcnt,
                                              int mat, int slice, int part, int kb0, int kb1, int words,
                                              const int16_t* tr) {
  if constexpr (WORDS != 0) {
    if (words == WORDS)  // always, by the host's contract
      gemm_body<CB, MT, DOWN, MT == 1, WORDS / 16, WORDS % 16 == 8>(p, smem, rows, e, rcnt, mat, slice, part, kb0, kb1,
                                                                    tr);
    return;
  }
#define TS_MOE_RATE(KA, HALF)                                                                               \
  case 16 * KA + (HALF ? 8 : 0):                                                       \
    gemm_body<CB, MT, DOWN, false, KA, HALF, COPY>(p, smem, rows, e, rcnt, mat, slice, part, kb0, kb1, tr); \
    break;
  switch (words) {
    TS_MOE_RATE(1, false)
    TS_MOE_RATE(2, false)
    TS_MOE_RATE(3, false)
    TS_MOE_RATE(4, false)
    TS_MOE_RATE(5, false)
    TS_MOE_RATE(6, false)
    TS_MOE_RATE(7, false)
    TS_MOE_RATE(8, false)
    TS_MOE_RATE(1, true)
    TS_MOE_RATE(2, true)
    TS_MOE_RATE(3, true)
    default:
      break;  // not a rate: the layout builder never writes one
  }
#undef TS_MOE_RATE
}

// What one block computes: gate/up of (item, mat, 128 columns `slice`), k part `part` of `parts`; down: (item,
// 128 output columns `slice`).
struct Piece {
  int item, mat, slice, part, parts;
};

// Down: grid (H/128, max_items), item-major: an item's blocks start together, so with early_down the first down
// blocks to get SM slots are those of the first items gate/up finishes.
__device__ __forceinline__ Piece down_piece() {
  return Piece{static_cast<int>(blockIdx.y), 2, static_cast<int>(blockIdx.x), 0, 1};
}

// Gate/up with short_groups > 0 (16-row items, decode): a 1-D grid of pieces, largest first. The first
// short_groups (item, slice) groups are split into splitk - 1 parts, the others into splitk, so the grid fills the
// SMs' block slots without a second wave; blocks start in index order, spread over the SMs, so each SM gets at most
// one of the larger pieces (T=1 at 5120/1152 on 132 SMs: 108 pieces of 12-14 k-blocks, 288 of 10, at most 34
// k-blocks per SM against 42 for the uniform 3-part split). Within a part: groups in order, gate then up.
// Otherwise the 3-D grid (mat * slices + slice, part, item): item-major, so items finish in order (early_down).
__device__ __forceinline__ Piece gate_up_piece(const GemmParams& p) {
  const int slices = p.I / 128;
  if (p.short_groups == 0) {
    const int x = blockIdx.x, mat = x / slices;
    return Piece{static_cast<int>(blockIdx.z), mat, x - mat * slices, static_cast<int>(blockIdx.y), p.splitk};
  }
  const int ns = p.short_groups, ps = p.splitk - 1, n_short = 2 * ns * ps;
  int i = blockIdx.x, span, first, parts;
  if (i < n_short) {
    span = 2 * ns, first = 0, parts = ps;
  } else {
    i -= n_short;
    span = (gridDim.x - n_short) / p.splitk, first = ns, parts = p.splitk;  // 2 * (long groups)
  }
  const int part = i / span, j = i - part * span, g = first + (j >> 1);
  const int item = g / slices;
  return Piece{item, j & 1, g - item * slices, part, parts};
}

// MINB: blocks per SM the registers are sized for. Gate/up of 16-row items 3 (80 registers), or 4 (64 registers) for
// mul1's one-rate kernels where the device holds 4 (python: _config); down of 16-row items 2 (104 registers), 3 (80)
// or (mul1, one rate, where the device holds 4) 4 (64), chosen by the plan (python: plan_launch); 64-row items 2.
// WORDS: 0, or the one rate of every matrix the kernel decodes (dispatch_rate).
template <int CB, int MT, bool DOWN, int MINB = MT == 1 && !DOWN ? 3 : 2, int WORDS = 0, bool COPY = false>
__global__ void __launch_bounds__(kThreads, MINB) moe_gemm_kernel(GemmParams p) {
  extern __shared__ __align__(16) char smem[];
  __shared__ RowTables rows;
  if constexpr (!DOWN) {
    // pdl_gate_up: this grid may be scheduled while the kernel before it on the stream (another layer's down, the
    // router, anything) drains; everything below reads or writes memory that kernel may still touch, so wait first.
    // Without the launch attribute the wait returns at once.
    pdl_wait();
    // The down kernel is launched with launch_pdl (common/pdl.cuh): once every gate/up block has started (and so
    // passed its wait), its blocks may take free SM slots, route and fetch their first weight tiles, and wait there
    // for gate/up to finish.
    pdl_launch_dependents();
  }
  trace_mark(p.trace, DOWN, 1);
  const Piece pc = DOWN ? down_piece() : gate_up_piece(p);
  const int item = pc.item;
  if (p.small_route) {
    if (!DOWN) {
      // No routing launch zeroes the workspace: gate/up clears out32 (the down kernel's atomics land there) and
      // the slice counters; the down kernel runs after this one on the stream.
      const size_t nblocks = static_cast<size_t>(gridDim.x) * gridDim.y * gridDim.z;
      const size_t b = (static_cast<size_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
      const size_t n4 = static_cast<size_t>(p.T) * p.H / 4;
      for (size_t i = b * kThreads + threadIdx.x; i < n4; i += nblocks * kThreads)
        reinterpret_cast<float4*>(p.out32)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (b == 0)
        for (int c = threadIdx.x; c < p.H / 128; c += kThreads) p.counters[c] = 0;
    }
    if (threadIdx.x < 32) route_small(p, item, rows);
    __syncthreads();
  }
  const int nitems = p.small_route ? rows.nitems : *p.num_items;
  if (item >= nitems) {
    // No local pair at all: nobody counts the slices, so item 0 writes the (zero) output itself.
    if (DOWN && p.fuse_convert && nitems == 0 && item == 0) {
      pdl_wait();  // gate/up zeroed out32
      convert_columns(p, pc.slice * 128);
    }
    return;
  }
  const int e = p.small_route ? rows.e : p.items[3 * item];
  const int rcnt = p.small_route ? rows.rcnt : p.items[3 * item + 2];
  const int rbeg = p.small_route ? 0 : p.items[3 * item + 1];
  const int mat = pc.mat, slice = pc.slice;
  const int kbs = (DOWN ? p.I : p.H) / 128, per = (kbs + pc.parts - 1) / pc.parts;
  const int kb0 = pc.part * per, kb1 = min(kbs, kb0 + per);
  // The matrix's rate and trellis: read (both loads in flight over the row tables' barrier), or, in the one-rate
  // kernels of a packed layout (e_stride != 0), known without a load: at one token that load was a cold round trip
  // between routing and the first weight fetch of every block.
  int words;
  const int16_t* tr;
  if (WORDS != 0 && p.e_stride != 0) {
    words = WORDS;
    tr = p.trellis + e * p.e_stride + mat * p.m_stride;
  } else {
    words = p.words[e * 3 + mat];
    tr = p.trellis + p.offsets[e * 3 + mat];
  }
  if constexpr (MT == 1 && WORDS != 0) {  // the one-rate kernels (prefetch_act_scales)
    if constexpr (DOWN) {
      stage_svh2(p, e, slice);  // committed with the ring's first k-block
    } else {
      prefetch_act_scales(p, e, slice);
    }
  }
  if (threadIdx.x == 0) rows.item = item;
  for (int r = threadIdx.x; r < rcnt; r += kThreads) {
    const int pair = p.small_route ? rows.pair[r] : p.sorted[rbeg + r];
    rows.pair[r] = pair;
    rows.tok[r] = pair / p.topk;
    if (DOWN) rows.weight[r] = p.topk_w[pair];
  }
  __syncthreads();
  trace_mark(p.trace, DOWN, 2);
  if (kb0 < kb1)
    dispatch_rate<CB, MT, DOWN, WORDS, COPY>(p, smem, rows, e, rcnt, mat, slice, pc.part, kb0, kb1, words, tr);
  trace_mark(p.trace, DOWN, 3);
  if constexpr (MT == 1 && !DOWN) finish_act(p, rows, item, e, rcnt, slice, pc.parts);
  if constexpr (DOWN) pdl_wait();  // (returns at once: gemm_body waited) before the arrival on gate/up's counters

  if constexpr (DOWN) {
    if (p.fuse_convert) {
      // Last block of this column slice (over all items) converts it: the block's atomics, then one
      // acquire-release arrival (common/arrive.cuh).
      __shared__ bool last;
      __syncthreads();
      if (threadIdx.x == 0) last = arrive_acq_rel(p.counters + slice) == nitems - 1;
      __syncthreads();
      if (last) {
        trace_mark(p.trace, 1, 5);
        convert_columns(p, slice * 128);
      }
    }
  }
  trace_mark(p.trace, DOWN, 4);
}

// 64-row items with prep_a: the A operands made once per pair instead of in every block that multiplies them.
// DOWN = false, before gate/up: x' [2][P][H] (x_values, fp16); DOWN = true, between gate/up and down: the
// activations [P][I] (act_values, fp16). One warp per (pair, [mat,] k-block) task, grid-stride; pairs of other ranks'
// experts are skipped (the GEMMs never read them). The same values, rounded the same way, as the in-block build.
template <bool DOWN>
__global__ void __launch_bounds__(kThreads) prep_a_kernel(GemmParams p) {
  const int lane = threadIdx.x & 31;
  const int kbs = (DOWN ? p.I : p.H) / 128, per_pair = (DOWN ? 1 : 2) * kbs;
  const long tasks = static_cast<long>(p.P) * per_pair, warps = static_cast<long>(gridDim.x) * (kThreads / 32);
  for (long t = static_cast<long>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); t < tasks; t += warps) {
    const int pair = static_cast<int>(t / per_pair), j = static_cast<int>(t - static_cast<long>(pair) * per_pair);
    const int e = p.ids[pair] - p.first_expert;
    if (e < 0 || e >= p.E) continue;  // warp-uniform
    float v[4];
    __half* dst;
    if constexpr (DOWN) {
      act_values(p, pair, e, j, p.splitk, v);
      dst = p.act + static_cast<size_t>(pair) * p.I + j * 128;
    } else {
      const int mat = j >= kbs, kb = j - mat * kbs;
      x_values(p, pair / p.topk, e, mat, kb, v);
      dst = p.xa + (static_cast<size_t>(mat) * p.P + pair) * p.H + kb * 128;
    }
    *reinterpret_cast<uint2*>(dst + lane * 4) = pack4_half(v);
  }
}

// Host side: launch one kernel of the family (defined per codebook in gemm_<codebook>.cu). rate_words: 0, or the
// words per tile of every matrix this kernel decodes (16-row items: a kernel compiled for that rate alone).
template <int CB>
cudaError_t launch_moe_gemm(const GemmParams& p, bool down, int mt, int max_items, int max_words, int rate_words,
                            cudaStream_t stream);

// The plan sizes the 16-row down grid for MINB = 2 blocks per SM where 3 lose (T=1: 240 blocks; at 3 per SM the
// SMs that gate/up frees first take 3 each and the grid ends on them). The kernel that dispatches on every rate
// needs ~101 registers, so 2 is all that fits; a kernel compiled for one rate needs 71-88, and 3 would fit. Then
// the dynamic shared memory grows until MINB + 1 blocks no longer fit an SM.
template <class Kernel>
cudaError_t cap_blocks_per_sm(Kernel kernel, int minb, size_t& smem) {
  int blocks = 0, dev = 0, per_sm = 0, reserved = 0, optin = 0;
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem);
  if (err != cudaSuccess || blocks <= minb) return err;
  cudaFuncAttributes attr{};
  if ((err = cudaGetDevice(&dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess)
    return err;
  const long pad = per_sm / (minb + 1) - reserved - static_cast<long>(attr.sharedSizeBytes) + 128;
  if (pad > static_cast<long>(smem) && pad <= optin) smem = static_cast<size_t>(pad);
  return cudaSuccess;
}

// The dynamic shared memory a kernel launches with on the current device, and (16-row items, `a_full` > 0) its A
// region: `ring` + the region (fit_a_bytes where `fit`, else a_full); the attribute raised; where `cap`, padded until
// no more than `minb` blocks fit an SM (cap_blocks_per_sm), and with `emu_per_sm` > 0 sized for a device of that much
// shared memory per SM and padded to the blocks per SM it would get there (registers permitting; the padding is
// this device's). Once per device and (size asked, emu_per_sm, fit), then remembered in `memo` (key << 36 | smem <<
// 18 | A region, per device): the occupancy query and the attribute calls are host work that otherwise ran on every
// launch, twice per decode layer. Devices past the memo's 64 prepare every launch.
// The attribute goes first: the occupancy query counts no block whose dynamic shared memory is above it (asked
// before, the first call's query found 0 blocks, left the size unpadded, and the memo kept the 2-per-SM down
// kernel at 3 per SM: T=1 +10%, cuda/exl3_moe/DESIGN.md "Launch plan").
template <class Kernel>
cudaError_t prepare_smem(std::atomic<uint64_t> (&memo)[64], Kernel kernel, int minb, bool cap, int a_full, size_t ring,
                         int emu_per_sm, bool fit, size_t& smem, int& a_bytes) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const size_t asked = static_cast<size_t>(a_full) + ring;
  if (asked >= (1u << 18) || emu_per_sm < 0 || emu_per_sm >= (1 << 19)) return cudaErrorInvalidValue;
  const uint64_t key = asked | static_cast<uint64_t>(emu_per_sm / 1024) << 18 | static_cast<uint64_t>(fit) << 27;
  if (dev >= 0 && dev < 64) {
    const uint64_t m = memo[dev].load(std::memory_order_acquire);
    if (m >> 36 == key) {
      smem = static_cast<size_t>(m >> 18 & 0x3ffffu);
      a_bytes = static_cast<int>(m & 0x3ffffu);
      return cudaSuccess;
    }
  }
  int per_sm = 0, reserved = 0;
  cudaFuncAttributes attr{};
  if ((err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess)
    return err;
  const size_t sized_for = emu_per_sm > 0 ? static_cast<size_t>(emu_per_sm) : static_cast<size_t>(per_sm);
  a_bytes = a_full > 0 && fit ? fit_a_bytes(a_full, ring, attr.sharedSizeBytes, reserved, sized_for, minb) : a_full;
  smem = static_cast<size_t>(a_bytes) + ring;
  // Set whatever the size: without it a kernel takes 48 KB less its static shared memory (a first launch at 48.9 KB
  // failed with "invalid argument" once the GB10 sizing made the down kernel's size that: DESIGN.md "Launch plan").
  const auto raise = [&](size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  };
  if ((err = raise(smem)) != cudaSuccess) return err;
  int limit = cap ? minb : 0;
  if (emu_per_sm > 0) {
    const int there = static_cast<int>(sized_for / (smem + attr.sharedSizeBytes + reserved));
    if (there < 1) return cudaErrorInvalidValue;  // would not launch there at all
    limit = limit > 0 && limit < there ? limit : there;
  }
  if (limit > 0) {
    const size_t unpadded = smem;
    if ((err = cap_blocks_per_sm(kernel, limit, smem)) != cudaSuccess) return err;
    if (smem != unpadded && (err = raise(smem)) != cudaSuccess) return err;
  }
  if (dev >= 0 && dev < 64)
    memo[dev].store(key << 36 | static_cast<uint64_t>(smem) << 18 | static_cast<uint64_t>(a_bytes),
                    std::memory_order_release);
  return cudaSuccess;
}

template <int CB, int MT, bool DOWN, int MINB = MT == 1 && !DOWN ? 3 : 2, int WORDS = 0, bool COPY = false>
cudaError_t launch_one(const GemmParams& params, int max_items, int max_words, cudaStream_t stream) {
  GemmParams p = params;
  const size_t all = gemm_smem_bytes(MT, DOWN, max_words);
  const int a_full = MT == 1 ? a_region_bytes(DOWN) : 0;  // 64-row items: both double buffers are fixed
  auto kernel = moe_gemm_kernel<CB, MT, DOWN, MINB, WORDS, COPY>;
  static std::atomic<uint64_t> memo[64];  // per device (prepare_smem), zero-initialized
  size_t smem = 0;
  const cudaError_t err = prepare_smem(memo, kernel, MINB, MT == 1 && DOWN && MINB == 2, a_full, all - a_full,
                                       p.smem_per_sm, p.fit_smem, smem, p.a_bytes);
  if (err != cudaSuccess) return err;
  p.a_kb = p.a_bytes / kAKbBytes;
  if (p.residency) {
    if (p.a_kb_out) *p.a_kb_out = p.a_kb;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(p.residency, kernel, kThreads, smem);
  }
  const int groups = max_items * (p.I / 128), ns = p.short_groups;
  const dim3 grid = DOWN     ? dim3(p.H / 128, max_items)
                    : ns > 0 ? dim3(2 * ns * (p.splitk - 1) + 2 * (groups - ns) * p.splitk)
                             : dim3(2 * (p.I / 128), p.splitk, max_items);
  if (DOWN || p.pdl_gate_up) return launch_pdl(kernel, grid, dim3(kThreads), smem, stream, p);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// 16-row items: the kernels (gate/up at 3 blocks per SM, or 4 for mul1's one-rate kernels; down at 2 or 3, or 4 for
// mul1's one-rate kernels) for rate WORDS (0: every rate). The 4-per-SM gate/up (64 registers: no spills on sm_90a up
// to K=7, 8 B at K=8, none on sm_121a; its K=3 loop 302 instructions per k-block against 298) won everywhere in decode
// on the H200 (DESIGN.md "Launch plan"); the 4-per-SM down (no spills at any rate on sm_90a, loops within 2
// instructions of the 3-per-SM kernel's) from two tokens on. The other codebooks and the dispatching kernels keep
// 3 (not measured at 4; fewer instantiations); a down_min_blocks of 4 for them runs the 3-per-SM kernel.
template <int CB, int WORDS>
cudaError_t launch_decode(const GemmParams& p, bool down, int max_items, int max_words, cudaStream_t stream) {
  if (!down) {
    if constexpr (CB == exl3::kCbMul1 && WORDS != 0) {
      if (p.gate_up_min_blocks == 4) return launch_one<CB, 1, false, 4, WORDS>(p, max_items, max_words, stream);
    }
    return launch_one<CB, 1, false, 3, WORDS>(p, max_items, max_words, stream);
  }
  if constexpr (CB == exl3::kCbMul1 && WORDS != 0) {
    if (p.down_min_blocks == 4) return launch_one<CB, 1, true, 4, WORDS>(p, max_items, max_words, stream);
  }
  return p.down_min_blocks == 2 ? launch_one<CB, 1, true, 2, WORDS>(p, max_items, max_words, stream)
                                : launch_one<CB, 1, true, 3, WORDS>(p, max_items, max_words, stream);
}

// 16-row items: the kernels compiled for rate_words alone (one of kExl3MoeRateWords, exl3_moe.h), or for 0 the ones
// that dispatch on every matrix's rate.
template <int CB, int I = 0>
cudaError_t launch_rate(const GemmParams& p, bool down, int max_items, int max_words, int rate_words,
                        cudaStream_t stream) {
  if constexpr (I == kExl3MoeRates) {
    return launch_decode<CB, 0>(p, down, max_items, max_words, stream);
  } else {
    if (rate_words == kExl3MoeRateWords[I])
      return launch_decode<CB, kExl3MoeRateWords[I]>(p, down, max_items, max_words, stream);
    return launch_rate<CB, I + 1>(p, down, max_items, max_words, rate_words, stream);
  }
}

template <int CB>
cudaError_t launch_moe_gemm(const GemmParams& p, bool down, int mt, int max_items, int max_words, int rate_words,
                            cudaStream_t stream) {
  if (mt == 1) return launch_rate<CB>(p, down, max_items, max_words, rate_words, stream);
  if (mt == 4) {
    if (p.prep_a) {
      return down ? launch_one<CB, 4, true, 2, 0, true>(p, max_items, max_words, stream)
                  : launch_one<CB, 4, false, 2, 0, true>(p, max_items, max_words, stream);
    }
    return down ? launch_one<CB, 4, true>(p, max_items, max_words, stream)
                : launch_one<CB, 4, false>(p, max_items, max_words, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe
}  // namespace twinspark
