// EXL3 trellis tiles: where position t's 16-bit state sits in a tile's bit ring (exl3-format.md section 2).
// A tile is W int16 values = W/2 little-endian u32 words = a ring of R = 16*W bits, read MSB first per word.
#pragma once
#include <stdint.h>

namespace twinspark {
namespace exl3 {

// int16 values per 16x16 tile for a rate given as (KA, half): 16*KA (+8 for half rates).
__host__ __device__ constexpr int tile_words16(int ka, bool half) { return 16 * ka + (half ? 8 : 0); }

// End bit S(t) of position t (0..255).
__host__ __device__ __forceinline__ int end_bit(int t, int ka, bool half) {
  return (t + 1) * ka + (half ? ((t + 1) >> 1) : 0);
}

// State of position t from a tile's u32 words (ring of `ring_bits` bits). `words` may point to global or
// shared memory. The 16 bits [S-16, S) mod R span at most two words.
__device__ __forceinline__ uint32_t state_at(const uint32_t* words, int ring_bits, int end) {
  int start = end - 16;
  if (start < 0) start += ring_bits;
  const int nwords = ring_bits >> 5;
  const int w0 = start >> 5;
  const int w1 = (w0 + 1 == nwords) ? 0 : w0 + 1;
  const uint64_t pair = (static_cast<uint64_t>(words[w0]) << 32) | words[w1];
  return static_cast<uint32_t>(pair >> (48 - (start & 31))) & 0xFFFFu;
}

// Tile element of position t (mma.m16n8k16 B-fragment order: lane L = t/8 owns positions 8L..8L+7).
__host__ __device__ __forceinline__ int tile_row(int t) {
  const int lane = t >> 3, j = t & 7;
  return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
}
__host__ __device__ __forceinline__ int tile_col(int t) {
  const int lane = t >> 3, j = t & 7;
  return (lane >> 2) + 8 * ((j >> 2) & 1);
}

}  // namespace exl3
}  // namespace twinspark
