// TMA tensor maps (sm_90+, sm_120+) for the kernels' bulk tensor copies, made on the host through the driver entry
// point the runtime hands out (no link against libcuda).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {

// A 2D map over a row-major [rows, cols] array of 2-byte elements at base (16-byte aligned, cols * 2 a multiple of
// 16), one box = box_rows x box_cols with box_cols * 2 == 128 bytes, shared memory side in the 128-byte swizzle
// (16-byte chunk c of box row r at chunk c ^ (r & 7); the box's shared memory 1024-byte aligned).
cudaError_t tensor_map_b16_swizzle128(CUtensorMap* map, void* base, uint64_t rows, uint64_t cols, uint32_t box_rows);

}  // namespace twinspark
