// EXL3 codebooks: a 16-bit trellis state -> one fp16 weight (docs: exl3-format.md section 3).
// Bit-exact with twinspark.exl3.reference.decode; all integer math mod 2^32.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace twinspark {
namespace exl3 {

enum Codebook : int { kCb3inst = 0, kCbMcg = 1, kCbMul1 = 2 };

template <int CB>
using CodebookTag = std::integral_constant<int, CB>;

// Run-time codebook id -> compile-time tag: returns f(CodebookTag<CB>{}) (read the id with decltype(tag)::value),
// cudaErrorInvalidValue for an unknown id. One dispatch for every launcher that templates on the codebook.
template <class F>
cudaError_t with_codebook(int codebook, F&& f) {
  switch (codebook) {
    case kCb3inst:
      return f(CodebookTag<kCb3inst>{});
    case kCbMcg:
      return f(CodebookTag<kCbMcg>{});
    case kCbMul1:
      return f(CodebookTag<kCbMul1>{});
    default:
      return cudaErrorInvalidValue;
  }
}

// mul1 as an affine map of the byte sum B of s * kMul1Mult: w = fp16_round(h * kMul1Scale + kMul1Shift), h = 1024 + B.
constexpr uint32_t kMul1Mult = 0x83DCD12Du;
constexpr float kMul1Scale = 0.00676727294921875f;  // f16 0x1EEE
constexpr float kMul1Shift = -10.3828125f;          // f16 0xC931

template <int CB>
__device__ __forceinline__ half decode_state(uint32_t s) {
  if constexpr (CB == kCbMul1) {
    const uint32_t x = s * kMul1Mult;
    // Sum of the four bytes with one instruction: dot of the byte vector with (1,1,1,1).
    const uint32_t b = __dp4a(x, 0x01010101u, 0u);
    const half h = __ushort_as_half(static_cast<unsigned short>(0x6400u + b));  // 1024 + b, exact
    // One fp16 FMA: a single rounding, as the spec requires ((b - 510) * k is NOT bit-identical).
    return __hfma(h, __ushort_as_half(0x1EEE), __ushort_as_half(0xC931));
  } else {
    uint32_t x = (CB == kCbMcg) ? s * 0xCBAC1FEDu : s * 89226354u + 64248484u;
    x = (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
    // Sum of two fp16 values rounded once: __hadd rounds the exact sum.
    return __hadd(__ushort_as_half(static_cast<unsigned short>(x & 0xFFFFu)),
                  __ushort_as_half(static_cast<unsigned short>(x >> 16)));
  }
}

}  // namespace exl3
}  // namespace twinspark
