// exl3_reconstruct: one 256-thread block decodes kTilesPerBlock tiles. Whole rates: warp w decodes tile w with the
// lane decoder the GEMM and MoE kernels use (exl3/decode_tile.cuh), so this op's bit-exact test covers it. Half
// rates: thread t owns trellis position t of every tile (exl3/trellis.cuh + decode_state).
// This is the toolchain proof and the dequantize-then-matmul fallback; the GEMM decodes in registers instead.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3/codebook.cuh"
#include "exl3/decode_tile.cuh"
#include "exl3/trellis.cuh"
#include "exl3_reconstruct/exl3_reconstruct.h"

namespace twinspark {
namespace {

constexpr int kTilesPerBlock = 8;  // one per warp
constexpr int kMaxWords32 = 64;    // K=8: 128 int16 = 64 u32

template <typename T>
__device__ __forceinline__ T from_half(half h);
template <>
__device__ __forceinline__ half from_half<half>(half h) {
  return h;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_half<__nv_bfloat16>(half h) {
  return __float2bfloat16_rn(__half2float(h));
}

// Warp-wide: decode one whole-rate tile (its 8K words in `words`) into out[tk*16.., tn*16..] (row stride n).
template <int K, int CB, typename OutT>
__device__ __forceinline__ void decode_tile_lanes(const uint32_t* words, long tk, long tn, long n, OutT* out) {
  const int lane = threadIdx.x & 31;
  const exl3::LaneWindow<K> lw(lane);
  uint32_t pair[4];
  exl3::decode_lane<K, CB>(words, lw, pair);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const __half2 h2 = *reinterpret_cast<const __half2*>(&pair[j >> 1]);
    const int t = 8 * lane + j;
    out[(tk * 16 + exl3::tile_row(t)) * n + tn * 16 + exl3::tile_col(t)] =
        from_half<OutT>((j & 1) ? __high2half(h2) : __low2half(h2));
  }
}

template <int CB, typename OutT>
__global__ void __launch_bounds__(256) reconstruct_kernel(const int16_t* __restrict__ trellis, int tiles_k, int tiles_n,
                                                          int ka, bool half_rate, OutT* __restrict__ out) {
  __shared__ uint32_t words[kTilesPerBlock][kMaxWords32];
  const int words16 = exl3::tile_words16(ka, half_rate);
  const int words32 = words16 / 2;
  const int ring_bits = words16 * 16;
  const long total_tiles = static_cast<long>(tiles_k) * tiles_n;
  const long first_tile = static_cast<long>(blockIdx.x) * kTilesPerBlock;

  // Stage the block's tiles: consecutive tiles are contiguous in memory.
  const uint32_t* src = reinterpret_cast<const uint32_t*>(trellis) + first_tile * words32;
  const long avail = (total_tiles - first_tile) < kTilesPerBlock ? (total_tiles - first_tile) : kTilesPerBlock;
  for (int i = threadIdx.x; i < avail * words32; i += blockDim.x) {
    words[i / words32][i % words32] = src[i];
  }
  __syncthreads();

  const long n = static_cast<long>(tiles_n) * 16;
  if (!half_rate) {
    const int w = threadIdx.x >> 5;
    if (w >= avail) return;
    const long tile = first_tile + w;
    const long tk = tile / tiles_n, tn = tile % tiles_n;
    switch (ka) {
#define TWINSPARK_RECON_K(KK) \
  case KK:                    \
    return decode_tile_lanes<KK, CB>(words[w], tk, tn, n, out);
      TWINSPARK_RECON_K(1)
      TWINSPARK_RECON_K(2)
      TWINSPARK_RECON_K(3)
      TWINSPARK_RECON_K(4)
      TWINSPARK_RECON_K(5)
      TWINSPARK_RECON_K(6)
      TWINSPARK_RECON_K(7)
      TWINSPARK_RECON_K(8)
#undef TWINSPARK_RECON_K
      default:
        return;
    }
  }
  const int t = threadIdx.x;
  const int r = exl3::tile_row(t), c = exl3::tile_col(t);
  const int end = exl3::end_bit(t, ka, half_rate);
  for (int i = 0; i < avail; ++i) {
    const long tile = first_tile + i;
    const long tk = tile / tiles_n, tn = tile % tiles_n;
    const uint32_t s = exl3::state_at(words[i], ring_bits, end);
    out[(tk * 16 + r) * n + tn * 16 + c] = from_half<OutT>(exl3::decode_state<CB>(s));
  }
}

template <typename OutT>
cudaError_t launch(const int16_t* trellis, int tiles_k, int tiles_n, int ka, bool half, int codebook, OutT* out,
                   cudaStream_t stream) {
  const long tiles = static_cast<long>(tiles_k) * tiles_n;
  const dim3 grid(static_cast<unsigned>((tiles + kTilesPerBlock - 1) / kTilesPerBlock));
  return exl3::with_codebook(codebook, [&](auto cb) {
    reconstruct_kernel<decltype(cb)::value, OutT><<<grid, 256, 0, stream>>>(trellis, tiles_k, tiles_n, ka, half, out);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t exl3_reconstruct(const int16_t* trellis, int tiles_k, int tiles_n, int ka, bool half, int codebook,
                             void* out, bool out_bf16, cudaStream_t stream) {
  if (ka < 1 || ka > 8 || (half && ka > 3) || tiles_k <= 0 || tiles_n <= 0) return cudaErrorInvalidValue;
  if (out_bf16) {
    return launch(trellis, tiles_k, tiles_n, ka, half, codebook, static_cast<__nv_bfloat16*>(out), stream);
  }
  return launch(trellis, tiles_k, tiles_n, ka, half, codebook, static_cast<__half*>(out), stream);
}

}  // namespace twinspark
