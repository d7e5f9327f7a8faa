// Per-block timeline marks for kernel developers: where a launch's time goes, block by block (which SM, when it
// started, when each phase ended), from the GPU's global nanosecond timer. A kernel takes a `uint64_t* trace`
// (null: off) laid out [kernel][kTraceBlocks][kTraceSlots]; slot 0 holds the SM id, slots 1.. the marks.
// Compiled in only when the package is built with TWINSPARK_TRACE=1 (elsewhere a mark is nothing: with the marks,
// exl3_moe's 80-register gate/up kernel spills 20 bytes on sm_90a, none without). Readers: bench/profile_exl3.py
// --trace.
#pragma once
#include <stdint.h>

#include "common/trace.h"

namespace twinspark {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Mark `slot` (1 .. kTraceSlots-1) of this block in kernel `kernel`'s rows; thread 0 only. Slot 1 also stores the SM.
__device__ __forceinline__ void trace_mark(uint64_t* trace, int kernel, int slot) {
#ifdef TWINSPARK_TRACE
  if (trace == nullptr || threadIdx.x != 0) return;
  const uint64_t b = (static_cast<uint64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (b >= static_cast<uint64_t>(kTraceBlocks)) return;
  uint64_t* row = trace + (static_cast<uint64_t>(kernel) * kTraceBlocks + b) * kTraceSlots;
  if (slot == 1) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    row[0] = sm + 1;  // 0: block never ran
  }
  row[slot] = global_ns();
#endif
}

}  // namespace twinspark
