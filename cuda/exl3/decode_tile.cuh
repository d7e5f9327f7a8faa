// Decode one lane's 8 trellis positions of a 16x16 tile straight into mma fragment registers (whole rates).
//
// Lane L of a warp owns positions 8L..8L+7 (trellis.cuh). Their states are the ring bits
// [8LK + K - 16, 8LK + 8K) (mod the ring): a window of 16 + 7K <= 72 bits that never spans more than three u32
// words. A lane reads those three words once per tile (LaneWindow gives their indices, the same for every tile
// of one rate), shifts them so position 8L starts at bit 0 of the window, and cuts each 16-bit state with
// compile-time shifts: 1-2 integer ops per state instead of a run-time word/offset computation.
//
// Output: four half2 registers, pair p = positions (8L+2p, 8L+2p+1), low half = the even position.
//   As the B operand of mma.m16n8k16 (A = activations [m, k], B = W_hat tile [k, n]):
//     n columns 0-7: {pair0, pair1};  n columns 8-15: {pair2, pair3}.
//   As the A operand (A = W_hat^T tile [n, k], B = activations^T [k, tokens]): {pair0, pair2, pair1, pair3}.
// Bit-exact with decode_state<CB> (codebook.cuh) and twinspark.exl3.reference.decode.
// Whole rates K = 1..8 only (half rates have lane-dependent bit counts).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "exl3/codebook.cuh"

namespace twinspark {
namespace exl3 {

template <int K>
struct LaneWindow {
  static_assert(K >= 1 && K <= 8, "whole rates 1..8");
  static constexpr int kWords = 8 * K;  // u32 words per tile
  static constexpr int kRing = 256 * K;
  // K = 4 and 8: 8K*L is a multiple of 32, so every lane's window starts at the same bit of its first word and
  // the states can be cut straight out of the three words (no re-alignment).
  static constexpr bool kStatic = (8 * K) % 32 == 0;
  static constexpr int kStaticOff = ((K - 16) % 32 + 32) % 32;
  static constexpr int kBase = kStatic ? kStaticOff : 0;  // bit of a0 where the window starts after align()
  // Every lane's 16 + 7K window bits end inside its first two words (K = 1, 2, 3 and static K = 4): the third word
  // is never read. K = 3: starts at bits 3, 11, 19, 27 of w0, 37 bits, so at most bit 64 (one LDS per tile less).
  static constexpr bool kTwoWords = [] {
    for (int lane = 0; lane < 32; ++lane) {
      const int start = ((8 * K * lane + K - 16) % kRing + kRing) % kRing;
      if ((kStatic ? kStaticOff : start % 32) + 16 + 7 * K > 64) return false;
    }
    return true;
  }();
  int w0, w1, w2, off;

  __device__ __forceinline__ explicit LaneWindow(int lane) {
    int start = 8 * K * lane + K - 16;
    if (start < 0) start += kRing;
    w0 = start >> 5;
    w1 = (w0 + 1) % kWords;
    w2 = (w0 + 2) % kWords;
    off = start & 31;
  }

  // tile[w2], or 0 where no state reaches it (kTwoWords: no load).
  __device__ __forceinline__ uint32_t word2(const uint32_t* tile) const { return kTwoWords ? 0u : tile[w2]; }

  // The lane's three window words (tile[w0], tile[w1], tile[w2]) shifted so the window starts at bit kBase of a0.
  __device__ __forceinline__ void align(uint32_t t0, uint32_t t1, uint32_t t2, uint32_t& a0, uint32_t& a1,
                                        uint32_t& a2) const {
    if constexpr (kStatic) {
      a0 = t0, a1 = t1, a2 = t2;
    } else {
      a0 = __funnelshift_l(t1, t0, off);
      a1 = kTwoWords ? t1 << off : __funnelshift_l(t2, t1, off);  // kTwoWords: the bits t2 would fill are unused
      a2 = t2 << off;
    }
  }
};

// Cutting a lane's 8 states out of its aligned window a0:a1:a2 (MSB first; state i starts at window bit
// kBase + i*K). A state 0, 8 or 16 bits into a 32-bit "view" of the window is cut with ONE integer op: view >> 16,
// a byte permute, or view & 0xFFFF. Views at word boundaries are the words themselves; a shifted view costs one op
// and pays only where it serves two or three states (K = 2: 4 views serve all 8). A state no view serves takes a
// shift and a mask (or a funnel shift and a shift), both on the integer pipe.
// Ops per 8 states: 11 at K=2 (15 with a two-op cut per state), 11 at K=4 (14), 10 at K=8 (12); 15 at odd K and
// K=6, where no two states are 8 or 16 bits apart. cuda/exl3_moe/DESIGN.md, rejected ideas: the single-state views on
// the FMA pipe (IMAD.SHL) instead was slower, since IMAD and IDP4A already half-fill that pipe.
struct CutPlan {
  int view[8];  // window bit where state i's view starts
  int cut[8];   // state i's offset inside its view: 0, 8 or 16; -1: no view, a shift and a mask
  int span[8];  // bits state i's view must hold (the largest cut served + 16)
};

template <int K>
constexpr CutPlan make_cut_plan() {
  CutPlan p{};
  constexpr int base = LaneWindow<K>::kBase;
  bool done[8] = {};
  for (int i = 0; i < 8; ++i) {  // the words themselves first: no op for the view
    const int b = base + i * K;
    if (b % 32 == 0 || b % 32 == 8 || b % 32 == 16) {
      p.view[i] = b - b % 32, p.cut[i] = b % 32, done[i] = true;
    }
  }
  for (int i = 0; i < 8; ++i) {  // then shifted views that serve two or three states
    if (done[i]) continue;
    const int v = base + i * K;
    int served = 0;
    for (int j = i; j < 8; ++j) {
      const int e = base + j * K - v;
      served += !done[j] && (e == 0 || e == 8 || e == 16);
    }
    for (int j = i; j < 8 && served > 1; ++j) {
      const int e = base + j * K - v;
      if (!done[j] && (e == 0 || e == 8 || e == 16)) p.view[j] = v, p.cut[j] = e, done[j] = true;
    }
    if (!done[i]) p.view[i] = v, p.cut[i] = -1, done[i] = true;  // alone: cut straight from the words
  }
  for (int i = 0; i < 8; ++i) {
    p.span[i] = 0;
    for (int j = 0; j < 8; ++j) {
      if (p.view[j] == p.view[i] && p.cut[j] + 16 > p.span[i]) p.span[i] = p.cut[j] + 16;
    }
  }
  return p;
}

template <int K>
struct CutPlanFor {
  static constexpr CutPlan kPlan = make_cut_plan<K>();
};

// 32 window bits from bit P (only the first SPAN of them are used).
template <int P, int SPAN>
__device__ __forceinline__ uint32_t window_view(uint32_t a0, uint32_t a1, uint32_t a2) {
  constexpr int q = P >> 5, r = P & 31;
  static_assert(q <= 2 && (q <= 1 || r + SPAN <= 32), "window is three words");
  const uint32_t w = q == 0 ? a0 : (q == 1 ? a1 : a2);
  if constexpr (r == 0) {
    return w;
  } else if constexpr (r + SPAN <= 32) {
    // = w << r; as a funnel shift it stays on the integer ALU pipe (ptxas makes w << r an IMAD.SHL on the FMA pipe,
    // which IMAD and IDP4A already fill more: 1-2% slower at K=2, cuda/exl3_moe/DESIGN.md, rejected ideas)
    return __funnelshift_l(0u, w, r);
  } else {
    return __funnelshift_l(q == 0 ? a1 : a2, w, r);
  }
}

// The 16 window bits from bit BIT with two integer ops (a state no shared view serves).
template <int BIT>
__device__ __forceinline__ uint32_t take16(uint32_t a0, uint32_t a1, uint32_t a2) {
  constexpr int q = BIT >> 5, r = BIT & 31;
  static_assert(q <= 2 && (r <= 16 || q <= 1), "window is three words");
  const uint32_t hi = q == 0 ? a0 : (q == 1 ? a1 : a2);
  if constexpr (r <= 16) {
    return (hi >> (16 - r)) & 0xFFFFu;
  } else {
    return __funnelshift_l(q == 0 ? a1 : a2, hi, r) >> 16;
  }
}

// The state E bits into view v (E = 0, 8 or 16): one integer op. WORD: v is a window word itself.
template <int E, bool WORD>
__device__ __forceinline__ uint32_t cut_view(uint32_t v) {
  if constexpr (E == 0 && WORD) {
    return v >> 16;
  } else if constexpr (E == 0) {
    // bytes 2, 3 of the view: as v >> 16, but the compiler cannot fold it with the view's shift back into a shift
    // and a mask (two integer-pipe ops) as it does with (x << r) >> 16
    return __byte_perm(v, 0u, 0x4432);
  } else if constexpr (E == 8) {
    return __byte_perm(v, 0u, 0x4421);  // bytes 1, 2 of the view, zeros above
  } else {
    return v & 0xFFFFu;
  }
}

// State i of the lane (a clean 0..65535 value).
template <int K, int I>
__device__ __forceinline__ uint32_t lane_state(uint32_t a0, uint32_t a1, uint32_t a2) {
  constexpr CutPlan pl = CutPlanFor<K>::kPlan;
  if constexpr (pl.cut[I] < 0) {
    return take16<pl.view[I]>(a0, a1, a2);
  } else {
    return cut_view<pl.cut[I], pl.view[I] % 32 == 0>(window_view<pl.view[I], pl.span[I]>(a0, a1, a2));
  }
}

// Two states -> one half2 register (low = s0), bit-exact with decode_state<CB> applied to each.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == kCbMul1) {
    const uint32_t x0 = s0 * kMul1Mult, x1 = s1 * kMul1Mult;
    // byte sum + 0x6400 in one dp4a each: the fp16 bits of 1024 + B
    const uint32_t h0 = __dp4a(x0, 0x01010101u, 0x6400u);
    const uint32_t h1 = __dp4a(x1, 0x01010101u, 0x6400u);
    const uint32_t hh = __byte_perm(h0, h1, 0x5410);
    const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&hh), __half2half2(__ushort_as_half(0x1EEE)),
                              __half2half2(__ushort_as_half(0xC931)));
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    uint32_t x0 = (CB == kCbMcg) ? s0 * 0xCBAC1FEDu : s0 * 89226354u + 64248484u;
    uint32_t x1 = (CB == kCbMcg) ? s1 * 0xCBAC1FEDu : s1 * 89226354u + 64248484u;
    x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    const uint32_t lo = __byte_perm(x0, x1, 0x5410), hi = __byte_perm(x0, x1, 0x7632);
    const __half2 r = __hadd2(*reinterpret_cast<const __half2*>(&lo), *reinterpret_cast<const __half2*>(&hi));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

template <int K, int CB, int P>
__device__ __forceinline__ uint32_t decode_pair_at(uint32_t a0, uint32_t a1, uint32_t a2) {
  return decode_pair<CB>(lane_state<K, 2 * P>(a0, a1, a2), lane_state<K, 2 * P + 1>(a0, a1, a2));
}

// Decode this lane's 8 positions of one tile from its three window words (tile[lw.w0], tile[lw.w1], tile[lw.w2]).
template <int K, int CB>
__device__ __forceinline__ void decode_lane_words(uint32_t w0, uint32_t w1, uint32_t w2, const LaneWindow<K>& lw,
                                                  uint32_t (&pair)[4]) {
  uint32_t a0, a1, a2;
  lw.align(w0, w1, w2, a0, a1, a2);
  pair[0] = decode_pair_at<K, CB, 0>(a0, a1, a2);
  pair[1] = decode_pair_at<K, CB, 1>(a0, a1, a2);
  pair[2] = decode_pair_at<K, CB, 2>(a0, a1, a2);
  pair[3] = decode_pair_at<K, CB, 3>(a0, a1, a2);
}

// "Raw" decode (3inst and mcg) for an mma that sums over both fp16 halves of a register: register j holds
// position 8L+j as the codebook's two fp16 halves, not yet added (weight = lo + hi), so there is no pack and no
// fp16 add per pair of weights; the 8 registers feed two mma.m16n8k16 against x' values duplicated in both halves
// of the B registers (store_x4_dup below). The mma adds the halves exactly instead of rounding their sum to fp16:
// within one fp16 rounding of decode_state<CB> (the GEMM tolerance), not bit-exact (reconstruct keeps
// decode_lane). mul1 has no raw form worth having: its byte sum needs the dp4a either way, and dropping the
// fp16 FMA measured no gain (cuda/exl3_gemm/DESIGN.md, rejected ideas).
template <int CB>
__device__ __forceinline__ uint32_t decode_raw(uint32_t s) {
  static_assert(CB != kCbMul1, "raw decode is for 3inst and mcg");
  const uint32_t x = (CB == kCbMcg) ? s * 0xCBAC1FEDu : s * 89226354u + 64248484u;
  return (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
}

template <int K, int CB>
__device__ __forceinline__ void decode_lane_raw(const uint32_t* tile, const LaneWindow<K>& lw, uint32_t (&r)[8]) {
  uint32_t a0, a1, a2;
  lw.align(tile[lw.w0], tile[lw.w1], lw.word2(tile), a0, a1, a2);
  r[0] = decode_raw<CB>(lane_state<K, 0>(a0, a1, a2));
  r[1] = decode_raw<CB>(lane_state<K, 1>(a0, a1, a2));
  r[2] = decode_raw<CB>(lane_state<K, 2>(a0, a1, a2));
  r[3] = decode_raw<CB>(lane_state<K, 3>(a0, a1, a2));
  r[4] = decode_raw<CB>(lane_state<K, 4>(a0, a1, a2));
  r[5] = decode_raw<CB>(lane_state<K, 5>(a0, a1, a2));
  r[6] = decode_raw<CB>(lane_state<K, 6>(a0, a1, a2));
  r[7] = decode_raw<CB>(lane_state<K, 7>(a0, a1, a2));
}

// x' for the raw mma, one 128-deep k-block of one row (token) = 128 u32 words: x'[16 kt + kk] with kk = 8h + 2j + e
// sits, as (v, v), at word 16 kt + 8e + 4h + j. ldmatrix.x4 at word 16 kt + 4 i (matrix i = 2e + h, rows = tokens)
// then gives lane (g, j) the B registers of both raw mmas of k-tile kt: e = 0 takes matrices 0, 1 with positions
// r[0], r[4], r[2], r[6] as A; e = 1 takes matrices 2, 3 with r[1], r[5], r[3], r[7].
// Writes this lane's 4 values v = fp16 x'[4 lane .. 4 lane + 3] (as from a warp's 128-point Hadamard) into `row`.
__device__ __forceinline__ void store_x4_dup(uint32_t* row, int lane, uint2 v) {
  const int w = 16 * (lane >> 2) + 4 * ((lane & 3) >> 1) + 2 * (lane & 1);
  *reinterpret_cast<uint2*>(row + w) = make_uint2(__byte_perm(v.x, 0, 0x1010), __byte_perm(v.y, 0, 0x1010));
  *reinterpret_cast<uint2*>(row + w + 8) = make_uint2(__byte_perm(v.x, 0, 0x3232), __byte_perm(v.y, 0, 0x3232));
}

// Constants the byte-sum decoder takes from kernel parameters, where ptxas cannot see their values: powers of two as
// multipliers (a shift ptxas cannot see runs on the FMA pipe as an IMAD and is not folded into the cuts) and a zero
// for the byte permutes' padding (a permute with a known zero becomes a shift and a mask). The host fills them with
// opaque_consts().
struct OpaqueConsts {
  uint32_t pow2[32];  // 1 << i
  uint32_t zero;      // 0
  uint32_t sel_hi;    // byte-permute selector 0x4432: bytes 2, 3 of the first operand, then zero padding
  uint32_t sel_mid;   // 0x4421: bytes 1, 2
};

inline OpaqueConsts opaque_consts() {
  OpaqueConsts c{};
  for (int i = 0; i < 32; ++i) c.pow2[i] = 1u << i;
  c.zero = 0;
  c.sel_hi = 0x4432;
  c.sel_mid = 0x4421;
  return c;
}

// The 16 bits E = 0 or 8 bits into view v (bytes 2, 3 or 1, 2), or E = 16 (a mask), with run-time permute selectors
// and zero: ptxas cannot turn the permute into a shift and a mask, nor fold the shift that made v into it.
template <int E>
__device__ __forceinline__ uint32_t cut_opaque(uint32_t v, const OpaqueConsts& oc) {
  static_assert(E == 0 || E == 8 || E == 16, "a view's cuts are 0, 8 or 16 bits in");
  if constexpr (E == 0) {
    return __byte_perm(v, oc.zero, oc.sel_hi);
  } else if constexpr (E == 8) {
    return __byte_perm(v, oc.zero, oc.sel_mid);
  } else {
    return v & 0xFFFFu;
  }
}

// The state I of the lane with its view on the FMA pipe (mul1_state, odd K): its 16 bits start r = bit % 32 into
// window word w. r = 0, 8, 16: one op on w (>> 16, a byte permute, a mask). Otherwise, where the state ends inside
// w: w << (r & 7) as an IMAD by a run-time power of two, then a byte permute (bytes 2, 3 or 1, 2) with a run-time
// selector and zero. ptxas sees neither the shift nor what the permute keeps, so it leaves one IMAD (FMA pipe) and
// one PRMT (ALU pipe) instead of rewriting them into a shift and a mask (two ALU ops). A state that crosses a word
// boundary takes two ALU ops.
template <int K, int I>
__device__ __forceinline__ uint32_t lane_state_fma(uint32_t a0, uint32_t a1, uint32_t a2, const OpaqueConsts& oc) {
  constexpr int b = LaneWindow<K>::kBase + I * K, q = b >> 5, r = b & 31, r0 = r & 7;
  static_assert(q <= 2, "window is three words");
  const uint32_t w = q == 0 ? a0 : (q == 1 ? a1 : a2);
  if constexpr (r == 0) {
    return w >> 16;
  } else if constexpr (r == 8 || r == 16) {
    return cut_opaque<r>(w, oc);
  } else if constexpr (r + 16 <= 32) {
    return cut_opaque<r - r0>(w * oc.pow2[r0], oc);  // w << r0, then the state's 16 bits of it
  } else {
    return take16<b>(a0, a1, a2);
  }
}

// lane_state with its shifted views on the FMA pipe (mul1_state, even K): a view r = 1..31 bits into a window word
// that holds all it serves is w * 2^r as an IMAD by a run-time power of two, and its cuts take run-time permute
// selectors, so ptxas neither folds the shift into them (a shift and a mask) nor moves the view back to the ALU pipe.
// The byte-sum loop has only its products on the FMA pipe (8 IMADs per tile against ~12 ALU ops at K=2).
template <int K, int I>
__device__ __forceinline__ uint32_t lane_state_views_fma(uint32_t a0, uint32_t a1, uint32_t a2,
                                                         const OpaqueConsts& oc) {
  constexpr CutPlan pl = CutPlanFor<K>::kPlan;
  constexpr int P = pl.view[I], q = P >> 5, r = P & 31, E = pl.cut[I];
  if constexpr (E >= 0 && r != 0 && r + pl.span[I] <= 32) {
    return cut_opaque<E>((q == 0 ? a0 : (q == 1 ? a1 : a2)) * oc.pow2[r], oc);
  } else {
    return lane_state<K, I>(a0, a1, a2);
  }
}

// The byte-sum path's cut of state I. Odd K: lane_state_fma (no two states are 8 or 16 bits apart, so each state
// has its own view; with the views on the FMA pipe the ALU and FMA pipes balance: SASS of the 8-tile loop per tile,
// sm_90a, K=3 32.3 issue slots with 17.6 ALU ops -> 32.0 with 12.2). Even K: the shared views of lane_state, made on
// the FMA pipe where they sit inside one word (lane_state_views_fma; K=2 ALU 12.6 -> 10.1, FMA 9.9 -> 12.4 per tile,
// -0.7..1.3% per layer on the H200, cuda/exl3_moe/DESIGN.md "The state cut"; K=4's views cross words and stay
// funnel shifts).
template <int K, int I>
__device__ __forceinline__ uint32_t mul1_state(uint32_t a0, uint32_t a1, uint32_t a2, const OpaqueConsts& oc) {
  if constexpr (K % 2 == 1) {
    return lane_state_fma<K, I>(a0, a1, a2, oc);
  } else {
    return lane_state_views_fma<K, I>(a0, a1, a2, oc);
  }
}

// mul1 without its byte sum (the byte-sum mma of cuda/exl3_moe/moe_gemm.cuh): x[j] = state of position 8L + j times
// kMul1Mult. The weight is the affine map of 1024 + (sum of x[j]'s four bytes); an integer mma against activations
// repeated in four bytes adds those bytes, so the lane pays only the state cut and one IMAD per weight.
template <int K>
__device__ __forceinline__ void mul1_products(const uint32_t* tile, const LaneWindow<K>& lw, const OpaqueConsts& oc,
                                              uint32_t (&x)[8]) {
  uint32_t a0, a1, a2;
  lw.align(tile[lw.w0], tile[lw.w1], lw.word2(tile), a0, a1, a2);
  x[0] = mul1_state<K, 0>(a0, a1, a2, oc) * kMul1Mult;
  x[1] = mul1_state<K, 1>(a0, a1, a2, oc) * kMul1Mult;
  x[2] = mul1_state<K, 2>(a0, a1, a2, oc) * kMul1Mult;
  x[3] = mul1_state<K, 3>(a0, a1, a2, oc) * kMul1Mult;
  x[4] = mul1_state<K, 4>(a0, a1, a2, oc) * kMul1Mult;
  x[5] = mul1_state<K, 5>(a0, a1, a2, oc) * kMul1Mult;
  x[6] = mul1_state<K, 6>(a0, a1, a2, oc) * kMul1Mult;
  x[7] = mul1_state<K, 7>(a0, a1, a2, oc) * kMul1Mult;
}

// Decode this lane's 8 positions of one tile. `tile` = the tile's 8K u32 words (shared or global memory).
template <int K, int CB>
__device__ __forceinline__ void decode_lane(const uint32_t* tile, const LaneWindow<K>& lw, uint32_t (&pair)[4]) {
  decode_lane_words<K, CB>(tile[lw.w0], tile[lw.w1], lw.word2(tile), lw, pair);
}

}  // namespace exl3
}  // namespace twinspark
