// engram_dequant: the plain (no ids) form of the row kernel in engram_rows.cuh.
#include "engram_dequant/engram_dequant.h"
#include "engram_dequant/engram_rows.cuh"

namespace twinspark {

cudaError_t engram_dequant(const uint8_t* weight, int64_t weight_stride, const uint8_t* scale, int64_t scale_stride,
                           int64_t n, void* out, int64_t out_stride, cudaStream_t stream) {
  return engram::launch_rows<int64_t>(weight, weight_stride, scale, scale_stride, nullptr, 0, n, n,
                                      static_cast<__nv_bfloat16*>(out), out_stride, stream);
}

}  // namespace twinspark
