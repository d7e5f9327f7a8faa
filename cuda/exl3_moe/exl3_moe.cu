// exl3_moe launcher and the routing kernel (contract: exl3_moe.h).
//
// Decode (small_route: at most 64 pairs): no routing launch; every GEMM block routes the pairs itself in shared
// memory (route_small in moe_gemm.cuh), so a layer is two launches: gate/up, then down + weighted sum + convert.
// Otherwise routing on the device, one block of 1024 threads (the other blocks of the launch zero the fp32 workspace):
// count the pairs of each local expert in shared memory (a pair's rank = its atomicAdd ticket), scan the counts
// into row starts and item starts (an expert with c pairs has ceil(c / rows) items), scatter the pairs into
// expert order and write the items (expert, first row, row count). The GEMM grids cover max_items (a bound
// from shapes); blocks past the device-side item count return at once. No host sync anywhere.
// Prefill (mt = 4 with prep_a): prep_a_kernel makes gate/up's x' after routing and down's activations after gate/up,
// once per pair, where every block of an item and 128 columns rebuilt them (18 gate/up, H/128 down blocks per item).
#include <cuda_runtime.h>

#include "exl3_moe/exl3_moe.h"
#include "exl3_moe/moe_gemm.cuh"

namespace twinspark {

namespace moe {
extern template cudaError_t launch_moe_gemm<exl3::kCb3inst>(const GemmParams&, bool, int, int, int, int, cudaStream_t);
extern template cudaError_t launch_moe_gemm<exl3::kCbMcg>(const GemmParams&, bool, int, int, int, int, cudaStream_t);
extern template cudaError_t launch_moe_gemm<exl3::kCbMul1>(const GemmParams&, bool, int, int, int, int, cudaStream_t);
}  // namespace moe

namespace {

constexpr int kRouteThreads = 1024;
constexpr int kMaxExperts = 4000;  // shared counters: 3 ints per expert, within the 48 KB default

struct RouteParams {
  const int32_t* ids;
  int P, E, first_expert, rows_per_item;
  int32_t* sorted;
  int32_t* rank;
  int32_t* items;
  int32_t* num_items;
  int32_t* counters;
  int n_counters;
  float4* zero;  // fp32 workspace to clear (16-byte units), may be null
  size_t n_zero4;
};

// Inclusive block scan of one int per thread (1024 threads).
__device__ __forceinline__ int block_scan(int v, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += o;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int s = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += o;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int r = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is reused by the next scan
  return r;
}

__global__ void __launch_bounds__(kRouteThreads) route_kernel(RouteParams p) {
  if (blockIdx.x > 0) {
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (size_t i = (blockIdx.x - 1) * static_cast<size_t>(blockDim.x) + threadIdx.x; i < p.n_zero4;
         i += static_cast<size_t>(gridDim.x - 1) * blockDim.x)
      p.zero[i] = z;
    return;
  }
  extern __shared__ int32_t sm[];
  int32_t* count = sm;                 // [E]
  int32_t* row_begin = sm + p.E;       // [E]
  int32_t* item_begin = sm + 2 * p.E;  // [E]
  __shared__ int warp_sums[32];
  const int tid = threadIdx.x, M = p.rows_per_item;

  for (int e = tid; e < p.E; e += kRouteThreads) count[e] = 0;
  for (int c = tid; c < p.n_counters; c += kRouteThreads) p.counters[c] = 0;
  __syncthreads();
  for (int i = tid; i < p.P; i += kRouteThreads) {
    const int e = p.ids[i] - p.first_expert;  // other ranks' experts and negative ids fall outside [0, E)
    p.rank[i] = (e >= 0 && e < p.E) ? atomicAdd(count + e, 1) : -1;
  }
  __syncthreads();

  // Each thread owns a run of consecutive experts; scan the runs' totals.
  const int per = (p.E + kRouteThreads - 1) / kRouteThreads;
  const int lo = min(p.E, tid * per), hi = min(p.E, lo + per);
  int rows = 0, items = 0;
  for (int e = lo; e < hi; ++e) {
    rows += count[e];
    items += (count[e] + M - 1) / M;
  }
  const int rows_incl = block_scan(rows, warp_sums);
  const int items_incl = block_scan(items, warp_sums);
  int rb = rows_incl - rows, ib = items_incl - items;
  for (int e = lo; e < hi; ++e) {
    row_begin[e] = rb;
    item_begin[e] = ib;
    rb += count[e];
    ib += (count[e] + M - 1) / M;
  }
  if (tid == kRouteThreads - 1) *p.num_items = items_incl;
  __syncthreads();

  for (int i = tid; i < p.P; i += kRouteThreads) {
    const int r = p.rank[i];
    if (r >= 0) p.sorted[row_begin[p.ids[i] - p.first_expert] + r] = i;
  }
  for (int e = tid; e < p.E; e += kRouteThreads) {
    const int c = count[e];
    for (int j = 0, it = item_begin[e]; j * M < c; ++j, ++it) {
      p.items[3 * it] = e;
      p.items[3 * it + 1] = row_begin[e] + j * M;
      p.items[3 * it + 2] = min(M, c - j * M);
    }
  }
}

__global__ void convert_kernel(const float4* __restrict__ src, void* dst, size_t n4, bool bf16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float4 v = src[i];
    if (bf16) {
      __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst) + 2 * i;
      d[0] = __floats2bfloat162_rn(v.x, v.y);
      d[1] = __floats2bfloat162_rn(v.z, v.w);
    } else {
      __half2* d = reinterpret_cast<__half2*>(dst) + 2 * i;
      d[0] = __floats2half2_rn(v.x, v.y);
      d[1] = __floats2half2_rn(v.z, v.w);
    }
  }
}

// kbs k-blocks cut into `parts` ceil-sized parts leave none empty (every part writes partial sums the down kernel
// reads; python: _whole_parts).
constexpr bool parts_nonempty(int kbs, int parts) {
  return parts >= 1 && (parts - 1) * ((kbs + parts - 1) / parts) < kbs;
}

// 0 (rates differ) or a rate's words per tile (kExl3MoeRateWords) within max_words.
constexpr bool rate_words_ok(int w, int max_words) {
  if (w == 0) return true;
  for (int r : kExl3MoeRateWords)
    if (w == r) return w <= max_words;
  return false;
}

bool valid_args(const Exl3MoeArgs& a) {
  return a.T > 0 && a.topk >= 1 && a.topk <= 64 && a.E >= 1 && a.E <= kMaxExperts && a.H > 0 && a.H % 128 == 0 &&
         a.I > 0 && a.I % 128 == 0 && (a.mt == 1 || a.mt == 4) && a.splitk >= 1 && a.splitk <= a.H / 128 &&
         a.max_items >= 1 && a.max_words >= 16 && a.max_words <= 128 && a.codebook >= 0 && a.codebook <= 2 &&
         (!a.small_route || (a.mt == 1 && static_cast<long>(a.T) * a.topk <= 64)) &&
         parts_nonempty(a.H / 128, a.splitk) && (a.mt != 1 || a.act_counters) && (a.mt == 1 || a.splitk == 1) &&
         a.short_groups >= 0 && a.short_groups <= a.max_items * (a.I / 128) &&
         (a.short_groups == 0 || (a.mt == 1 && parts_nonempty(a.H / 128, a.splitk - 1))) &&
         (a.mt != 1 || (a.down_min_blocks >= 2 && a.down_min_blocks <= 4)) &&
         (a.mt != 1 || a.gate_up_min_blocks == 3 || a.gate_up_min_blocks == 4) && a.max_items <= 65535 &&
         rate_words_ok(a.words13, a.max_words) && rate_words_ok(a.words2, a.max_words) &&
         (a.mt == 1 || !a.early_down) && (a.mt == 4 || !a.prep_a) &&
         ((a.e_stride == 0 && a.m_stride == 0) ||
          (a.words13 != 0 && a.words2 != 0 && a.m_stride > 0 && a.e_stride > 2 * a.m_stride));
}

}  // namespace

int exl3_moe_a_bytes(bool down, int max_words, int static_bytes, int reserved, int per_sm, int blocks) {
  if (max_words < 16 || max_words > 128 || static_bytes < 0 || reserved < 0 || per_sm <= 0 || blocks < 1) return -1;
  const size_t ring = moe::gemm_smem_bytes(1, down, max_words) - moe::a_region_bytes(down);
  return moe::fit_a_bytes(moe::a_region_bytes(down), ring, static_bytes, reserved, per_sm, blocks);
}

std::pair<int, int> exl3_moe_four_per_sm(bool down, int words, int max_words, int smem_per_sm, bool fit_smem) {
  if (words == 0 || !rate_words_ok(words, max_words) || max_words > 128 || smem_per_sm < 0) return {-1, -1};
  moe::GemmParams gp{};
  int blocks = 0, a_kb = 0;
  gp.residency = &blocks;
  gp.a_kb_out = &a_kb;
  gp.gate_up_min_blocks = 4;
  gp.down_min_blocks = 4;
  gp.smem_per_sm = smem_per_sm;
  gp.fit_smem = fit_smem;
  const cudaError_t err = moe::launch_moe_gemm<exl3::kCbMul1>(gp, down, 1, 1, max_words, words, nullptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return {-1, -1};
  }
  return {blocks, a_kb};
}

cudaError_t exl3_moe(const Exl3MoeArgs& a, cudaStream_t stream) {
  if (!valid_args(a)) return cudaErrorInvalidValue;
  const size_t P = static_cast<size_t>(a.T) * a.topk;
  int32_t* sorted = a.ws_int;
  int32_t* rank = sorted + P;
  int32_t* items = rank + P;
  int32_t* num_items = items + 3 * static_cast<size_t>(a.max_items);
  int32_t* counters = num_items + 1;
  float* gu32 = a.ws_f32;
  float* out32 = gu32 + static_cast<size_t>(a.splitk) * P * 2 * a.I;
  __half* act = reinterpret_cast<__half*>(out32 + static_cast<size_t>(a.T) * a.H);
  __half* xa = a.mt == 4 ? act + P * a.I : nullptr;
  cudaError_t err = cudaSuccess;

  if (!a.small_route && !a.residency) {
    // The routing launch also zeroes out32 (the down kernel's atomics land there).
    RouteParams rp{a.ids,
                   static_cast<int>(P),
                   a.E,
                   a.first_expert,
                   16 * a.mt,
                   sorted,
                   rank,
                   items,
                   num_items,
                   counters,
                   a.H / 128,
                   reinterpret_cast<float4*>(out32),
                   static_cast<size_t>(a.T) * a.H / 4};
    const size_t zero_blocks = (rp.n_zero4 + kRouteThreads * 8 - 1) / (kRouteThreads * 8);
    const unsigned grid = 1 + static_cast<unsigned>(zero_blocks < 256 ? zero_blocks : 256);
    route_kernel<<<grid, kRouteThreads, 3 * a.E * sizeof(int32_t), stream>>>(rp);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  moe::GemmParams gp{};
  gp.x = a.x;
  gp.topk_w = a.topk_w;
  gp.trellis = a.trellis;
  gp.offsets = a.offsets;
  gp.words = a.words;
  gp.e_stride = a.e_stride;
  gp.m_stride = a.m_stride;
  gp.suh13 = static_cast<const __half*>(a.suh13);
  gp.svh13 = static_cast<const __half*>(a.svh13);
  gp.suh2 = static_cast<const __half*>(a.suh2);
  gp.svh2 = static_cast<const __half*>(a.svh2);
  gp.ids = a.ids;
  gp.sorted = sorted;
  gp.items = items;
  gp.num_items = num_items;
  gp.counters = counters;
  gp.gu32 = gu32;
  gp.out32 = out32;
  gp.act = act;
  gp.xa = xa;
  gp.prep_a = a.prep_a;
  gp.act_counters = a.act_counters;
  gp.item_ready = a.mt == 1 ? a.act_counters + static_cast<size_t>(a.max_items) * (a.I / 128) : nullptr;
  gp.out = a.out;
  gp.T = a.T;
  gp.topk = a.topk;
  gp.H = a.H;
  gp.I = a.I;
  gp.P = static_cast<int>(P);
  gp.E = a.E;
  gp.first_expert = a.first_expert;
  gp.small_route = a.small_route;
  gp.limit = a.limit;
  gp.x_bf16 = a.x_bf16;
  gp.splitk = a.splitk;
  gp.short_groups = a.short_groups;
  gp.fuse_convert = a.fuse_convert;
  gp.down_min_blocks = a.down_min_blocks;
  gp.gate_up_min_blocks = a.gate_up_min_blocks;
  gp.bytesum = a.bytesum;
  gp.early_down = a.early_down;
  gp.pdl_gate_up = a.pdl;
  gp.smem_per_sm = a.smem_per_sm;
  gp.fit_smem = a.fit_smem;
  gp.opaque = exl3::opaque_consts();
  gp.trace = a.trace;

  auto gemm = [&](bool down) {
    return exl3::with_codebook(a.codebook, [&](auto cb) {
      return moe::launch_moe_gemm<decltype(cb)::value>(gp, down, a.mt, a.max_items, a.max_words,
                                                       down ? a.words2 : a.words13, stream);
    });
  };
  if (a.residency) {  // the two GEMM kernels' blocks per SM, nothing launched
    gp.residency = a.residency;
    if ((err = gemm(false)) != cudaSuccess) return err;
    gp.residency = a.residency + 1;
    return gemm(true);
  }
  // prep_a (64-row items): x' before gate/up, the activations between gate/up and down (plain launches: each waits
  // for the kernel before it; gate/up's and down's programmatic waits then wait for them).
  const auto prep = [&](bool down) {
    const long tasks = static_cast<long>(P) * (down ? a.I / 128 : 2 * (a.H / 128));
    const long blocks = (tasks + moe::kThreads / 32 - 1) / (moe::kThreads / 32);
    const unsigned grid = static_cast<unsigned>(blocks < 8192 ? blocks : 8192);
    if (down) {
      moe::prep_a_kernel<true><<<grid, moe::kThreads, 0, stream>>>(gp);
    } else {
      moe::prep_a_kernel<false><<<grid, moe::kThreads, 0, stream>>>(gp);
    }
    return cudaGetLastError();
  };
  if (a.prep_a && (err = prep(false)) != cudaSuccess) return err;
  if ((err = gemm(false)) != cudaSuccess) return err;
  if (a.prep_a && (err = prep(true)) != cudaSuccess) return err;
  if ((err = gemm(true)) != cudaSuccess) return err;
  if (!a.fuse_convert) {
    const size_t n4 = static_cast<size_t>(a.T) * a.H / 4;
    const size_t blocks = (n4 + 255) / 256;
    convert_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(
        reinterpret_cast<const float4*>(out32), a.out, n4, a.x_bf16);
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace twinspark
