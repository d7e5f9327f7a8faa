// engram_gather: out[i] = dequant(table row ids[i] - first_row) for ids in [first_row, first_row + table_rows),
// a zero row otherwise (the dead id -1 and ids owned by the other rank).
// Contract: as engram_dequant.h for weight/scale/out (table of `table_rows` rows); ids int64 (ids_int32 = false)
// or int32 [n] contiguous on the device; first_row >= 0. Bit-exact with twinspark.reference.engram_gather.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {

cudaError_t engram_gather(const uint8_t* weight, int64_t weight_stride, const uint8_t* scale, int64_t scale_stride,
                          int64_t table_rows, const void* ids, bool ids_int32, int64_t first_row, int64_t n, void* out,
                          int64_t out_stride, cudaStream_t stream);

}  // namespace twinspark
