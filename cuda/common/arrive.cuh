// "Last block to arrive" counting for split reductions (the pattern of CUTLASS's semaphore): every thread's
// global writes, then __syncthreads(), then ONE thread adds to the counter with acquire-release semantics at GPU
// scope. The release is cumulative over what the barrier ordered before it, so the block needs no full
// __threadfence() (a MEMBAR.SC.GPU that waits for every outstanding write of the thread); the acquire side makes
// the other blocks' writes visible to the block that arrives last once it passes its next __syncthreads().
#pragma once
#include <cuda_runtime.h>

namespace twinspark {

// Returns the counter's old value. Call from one thread, between two __syncthreads() of the block.
__device__ __forceinline__ int arrive_acq_rel(int* counter) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

}  // namespace twinspark
