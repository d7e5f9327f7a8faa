// Programmatic dependent launch (sm_90+): a kernel launched with launch_pdl may start while the kernel before it
// on the stream is still running. It must call pdl_wait() before it touches anything that kernel writes (the wait
// returns once that grid has completed and its memory is visible); work that depends only on the inputs (weight
// prefetch, routing of the ids) can go before. The kernel before it may call pdl_launch_dependents() once the rest
// of its blocks no longer need the SM resources the dependent kernel's waiting blocks would take. Without the
// launch attribute both are no-ops, so the same kernel runs under ordinary stream order too.
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace twinspark {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed.
template <class... Params, class... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace twinspark
