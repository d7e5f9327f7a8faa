// exl3_moe: one routed-expert MoE layer over EXL3 experts (layout: python/twinspark/moe_layout.py).
//
//   out[t] = sum_j w[t, j] * down_e( SiLU(gate_e(x[t])) * up_e(x[t]) ),  e = ids[t, j] - first_expert in [0, E)
//
// Contract (checked in Python, re-checked here where cheap):
//   x        bf16|fp16 [T, H] contiguous          ids      int32 [T, topk] contiguous (global expert ids)
//   topk_w   fp32 [T, topk] contiguous            out      x's dtype [T, H] contiguous
//   trellis  int16 flat; offsets int64 [E, 3] (int16 units, multiples of 64); words int32 [E, 3] (16*K or
//            16*KA+8: K 1..8, 1.5/2.5/3.5); suh13 fp16 [E, 2, H]; svh13 fp16 [E, 2, I]; suh2 fp16 [E, I];
//            svh2 fp16 [E, H]. H, I multiples of 128; 1 <= topk <= 64; E <= 4000; max_words = max(words).
//   ws_int / ws_f32: per-call workspaces of exl3_moe_workspace() elements (never shared between calls or streams).
//   act_counters (mt = 1): max_items * (I/128 + 1) ints: the arrival counters of down's activations, then the
//   items' ready counters (early_down), zero before the call; the call leaves them zero (one buffer per stream may
//   serve every call on that stream).
//   mt (1 or 4): an item is up to 16*mt rows (pairs) of one expert; splitk >= 1 (1 at mt = 4) splits gate/up over k
//   (each part writes its own partial sums; the down kernel adds them); short_groups (mt = 1): the first
//   short_groups (item, 128 columns of I) groups take splitk - 1 parts (a grid that fills the SMs); max_items >= the
//   item count of any routing (<= 65535: a grid's y / z extent); fuse_convert: the down kernel's last block per 128
//   columns writes `out` (else one more small launch); small_route (T*topk <= 64, mt = 1): no routing launch;
//   early_down (mt = 1): each down block waits for its own item's activations (a ready counter per item after the
//   act_counters), not for the whole gate/up grid.
//   words13 / words2: 0, or the words per tile that EVERY gate and up (down) matrix of the layer has; mt = 1 then
//   launches kernels compiled for that rate alone (a wrong value leaves those matrices out of the result: the host
//   takes it from the layout that made `words`); e_stride / m_stride: 0, or with both rates set where offsets are
//   plan's packed layout, its strides (the rate kernels compute a matrix's start instead of loading it); pdl: the first
//   GEMM (gate/up) is launched with programmatic dependent launch (scheduled while the kernel before it drains; it
//   waits for that kernel before touching memory).
// Launches: decode (small_route + fuse_convert): gate/up, down. Otherwise: route (+ zeroing), gate/up, down, convert.
// No host sync: capturable in a CUDA graph.
// mt = 1: the last gate/up block of each (item, 128 columns of I) makes down's fp16 activations for them
// (sum of the k-split parts, Hadamards, SiLU(gate) * up, suh of down) once; the down blocks copy them.
// fp32 atomics sum the experts of one token, so results may differ in the last fp32 bit from run to run.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <utility>

namespace twinspark {

// The rates with decode kernels of their own, as words per tile (16 K for K = 1..8, 16 K + 8 for K = 1.5, 2.5, 3.5):
// words13 / words2 must be 0 or one of them (exl3_moe.cu), the launch has a kernel for each (moe_gemm.cuh
// launch_rate), and Python's ops.exl3_moe.RATE_WORDS is checked against them (the module's exl3_moe_rate_words).
inline constexpr int kExl3MoeRateWords[] = {16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128};
inline constexpr int kExl3MoeRates = sizeof(kExl3MoeRateWords) / sizeof(kExl3MoeRateWords[0]);

struct Exl3MoeArgs {
  const void* x;
  const int32_t* ids;
  const float* topk_w;
  const int16_t* trellis;
  const int64_t* offsets;
  const int32_t* words;
  const void* suh13;
  const void* svh13;
  const void* suh2;
  const void* svh2;
  int32_t* ws_int;
  float* ws_f32;
  int32_t* act_counters;  // mt == 1: >= max_items * (I/128 + 1) ints, zero on entry and on exit (per stream)
  void* out;
  int T, topk, E, H, I, first_expert, max_words, codebook;
  int words13, words2;  // 0, or the one words-per-tile value of every gate/up (down) matrix (rate kernels, mt = 1)
  int64_t e_stride, m_stride;  // 0, or (words13 and words2 set) offsets[e][mat] == e * e_stride + mat * m_stride for
                               // every expert (the packed layout moe_layout.plan makes): the rate kernels then
                               // compute a matrix's place instead of loading it
  float limit;                 // < 0: no clamp
  bool x_bf16;
  int mt, splitk, max_items;
  int short_groups;        // mt == 1: (item, 128 columns of I) groups split into splitk - 1 parts instead of splitk
  int down_min_blocks;     // mt == 1: the down kernel sized for 2 or 3 blocks per SM
  int gate_up_min_blocks;  // mt == 1: the gate/up kernel sized for 3 or 4 blocks per SM (4: mul1 one-rate kernels
                           // only; the others keep 3)
  bool bytesum;            // mt == 1, mul1: items of <= 4 rows use the byte-sum mma (moe_gemm.cuh); false: fp16 decode
  bool early_down;         // mt == 1: a down block starts once its item's activations are made (not all of gate/up)
  bool fuse_convert;
  bool small_route;  // T*topk <= 64 and mt == 1: the GEMM blocks route in shared memory (no routing launch)
  bool pdl;          // the call's first GEMM (gate/up) may be scheduled while the kernel before it on the stream
                     // drains (programmatic dependent launch); it waits for that kernel before touching memory
  uint64_t* trace;   // null, or a buffer of trace_shape for per-block timeline marks (common/trace.cuh; a
                     // TWINSPARK_TRACE=1 build writes it, any other ignores it)
  int* residency;    // null, or host memory for 2 ints: launch nothing, store the blocks per SM the gate/up and
                     // the down kernel of this call would get (their shared memory sized as a launch sizes it)
  int smem_per_sm;   // 0: the device's; else size the kernels' shared memory as on a device with this many bytes
                     // per SM (GB10: 102400) and hold them to the blocks per SM they would get there (benchmarks)
  bool fit_smem;     // mt == 1: shrink the A region where the full one would cost blocks per SM (moe_gemm.cuh)
  bool prep_a;       // mt == 4: gate/up's x' and down's activations made once per pair by launches of their own
                     // (before gate/up, between gate/up and down) and copied by the GEMM blocks, instead of built in
                     // every block that multiplies them
};

// Workspace sizes in elements. ws_int: sorted pairs [P], pair ranks [P], items [3 * max_items], item count [1],
// down-slice counters [H/128]. ws_f32: gate/up partial sums [splitk, P, 2I], the fp32 output [T, H], down's fp16
// activations [P, I] (P * I / 2 floats), then (mt = 4, for prep_a) gate/up's fp16 x' [2, P, H] (P * H floats).
inline void exl3_moe_workspace(int T, int topk, int H, int I, int max_items, int splitk, int mt, size_t* n_int,
                               size_t* n_f32) {
  const size_t P = static_cast<size_t>(T) * topk;
  *n_int = 2 * P + 3 * static_cast<size_t>(max_items) + 1 + H / 128;
  *n_f32 = static_cast<size_t>(splitk) * P * 2 * I + static_cast<size_t>(T) * H + P * I / 2 + (mt == 4 ? P * H : 0);
}

cudaError_t exl3_moe(const Exl3MoeArgs& args, cudaStream_t stream);

// The A region (bytes) a 16-row kernel (down or gate/up) of max_words per tile launches with where `blocks` of it
// per SM must fit in per_sm bytes of shared memory, beside static_bytes of static and `reserved` per block
// (moe_gemm.cuh fit_a_bytes); -1 for arguments out of range. Host only (tests, the GB10 sizing in DESIGN.md).
int exl3_moe_a_bytes(bool down, int max_words, int static_bytes, int reserved, int per_sm, int blocks);

// The mul1 16-row decode kernel (gate/up, or down) of rate `words` sized for 4 blocks per SM (64 registers) on the
// current device, its shared memory sized as a launch of a layer with max_words sizes it (the trellis ring holds
// max_words per tile; smem_per_sm / fit_smem as in Exl3MoeArgs): {blocks per SM it gets, k-blocks its A region holds
// (fit_a_bytes)}; nothing launches. The host plans for 4 blocks per SM where it gets 4 with a large enough region
// (ops/exl3_moe.py); {-1, -1} for a rate with no kernel or out of max_words.
std::pair<int, int> exl3_moe_four_per_sm(bool down, int words, int max_words, int smem_per_sm, bool fit_smem);

}  // namespace twinspark
