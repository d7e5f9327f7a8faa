// engram_gather: the gathering form of the row kernel in engram_dequant/engram_rows.cuh (one kernel, ids read
// on the device, so a gather + dequant is one pass over the selected rows).
#include "engram_dequant/engram_rows.cuh"
#include "engram_gather/engram_gather.h"

namespace twinspark {

cudaError_t engram_gather(const uint8_t* weight, int64_t weight_stride, const uint8_t* scale, int64_t scale_stride,
                          int64_t table_rows, const void* ids, bool ids_int32, int64_t first_row, int64_t n, void* out,
                          int64_t out_stride, cudaStream_t stream) {
  if (ids == nullptr && n > 0) return cudaErrorInvalidValue;
  auto* o = static_cast<__nv_bfloat16*>(out);
  if (ids_int32) {
    return engram::launch_rows<int32_t>(weight, weight_stride, scale, scale_stride, static_cast<const int32_t*>(ids),
                                        first_row, table_rows, n, o, out_stride, stream);
  }
  return engram::launch_rows<int64_t>(weight, weight_stride, scale, scale_stride, static_cast<const int64_t*>(ids),
                                      first_row, table_rows, n, o, out_stride, stream);
}

}  // namespace twinspark
