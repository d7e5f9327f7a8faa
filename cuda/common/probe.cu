// A kernel that does nothing: cudaFuncGetAttributes on it fails with cudaErrorNoKernelImageForDevice when the
// module has no cubin for the current device, which lets Python say "not built for sm_XX" before any launch.
#include <cuda_runtime.h>

__global__ void twinspark_probe_kernel() {}

cudaError_t twinspark_probe_kernel_image(int device) {
  int prev = 0;
  cudaError_t err = cudaGetDevice(&prev);
  if (err != cudaSuccess) return err;
  err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, twinspark_probe_kernel);
  cudaSetDevice(prev);
  return err;
}
