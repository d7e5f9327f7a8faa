// Launcher of the one-shot all-reduce: checks the plan, picks the grid, dispatches the dtype.
#include "allreduce/allreduce.cuh"

namespace twinspark::allreduce {

template <typename T>
static cudaError_t launch(const Plan& plan, const void* in, void* out, int64_t n, cudaStream_t stream) {
  const int grid = grid_for(plan, n, sizeof(T));
  oneshot_kernel<T><<<grid, kThreads, 0, stream>>>(plan, static_cast<const T*>(in), static_cast<T*>(out), n);
  return cudaGetLastError();
}

cudaError_t oneshot(const Plan& plan, const void* in, void* out, int64_t n, DType dtype, cudaStream_t stream) {
  if (plan.world < 1 || plan.world > kMaxRanks || plan.rank < 0 || plan.rank >= plan.world)
    return cudaErrorInvalidValue;
  if (n <= 0) return cudaSuccess;
  switch (dtype) {
    case kF32:
      return launch<float>(plan, in, out, n, stream);
    case kF16:
      return launch<__half>(plan, in, out, n, stream);
    case kBF16:
      return launch<__nv_bfloat16>(plan, in, out, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace twinspark::allreduce
