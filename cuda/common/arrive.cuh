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

// A flag handed from one block to another at GPU scope: the writer's release covers what its block's barrier
// ordered before it (as above); the reader's acquire, then its block barrier, makes those writes visible to the
// reading block (stream-K hand-over in exl3_gemm/fused_sm90.cuh).
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// One more done, published: the release covers what the block's barrier ordered before it (the waiter polls with
// load_acquire).
__device__ __forceinline__ void red_add_release(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p) : "memory");
}
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace twinspark
