// Tensor-pipe probe for the decode kernels' two mma shapes (not part of the package; a device-session tool):
// cycles per warp-level mma.sync on one SM sub-partition, for the byte-sum path's m16n8k32 u8 x s8 -> s32 and the
// fp16 path's m16n8k16 f16 -> f32, as a dependent chain (latency) and with W warps x C independent chains per
// sub-partition (throughput). One block per SM, 4 * W warps; clock64 around the loop, median over the SMs.
//
//   nvcc -O3 -arch=sm_90a scripts/probe_mma_rate.cu -o /tmp/probe_mma_rate && /tmp/probe_mma_rate
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

constexpr int kIters = 4096;

template <bool INT8, int C>
__global__ void probe(long long* cycles, uint32_t* sink, uint32_t seed) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = seed * (threadIdx.x + 3 * i + 1);
  for (int i = 0; i < 2; ++i) b[i] = seed ^ (threadIdx.x * 7 + i);
  uint32_t acc[C][4] = {};
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if constexpr (INT8) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(acc[c][0]), "+r"(acc[c][1]), "+r"(acc[c][2]), "+r"(acc[c][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+r"(acc[c][0]), "+r"(acc[c][1]), "+r"(acc[c][2]), "+r"(acc[c][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      }
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t s = 0;
  for (int c = 0; c < C; ++c) s ^= acc[c][0] ^ acc[c][1] ^ acc[c][2] ^ acc[c][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <bool INT8, int C>
void run(int sms, int warps_per_sp) {
  const int threads = 4 * 32 * warps_per_sp;
  long long* d_cycles;
  uint32_t* sink;
  cudaMalloc(&d_cycles, sms * sizeof(long long));
  cudaMalloc(&sink, static_cast<size_t>(sms) * threads * sizeof(uint32_t));
  probe<INT8, C><<<sms, threads>>>(d_cycles, sink, 12345u);  // warm-up
  probe<INT8, C><<<sms, threads>>>(d_cycles, sink, 777u);
  cudaError_t err = cudaDeviceSynchronize();
  std::vector<long long> cyc(sms);
  cudaMemcpy(cyc.data(), d_cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  std::sort(cyc.begin(), cyc.end());
  const double med = static_cast<double>(cyc[sms / 2]);
  const double mmas_per_sp = static_cast<double>(kIters) * C * warps_per_sp;
  printf("%-22s warps/SP %2d chains %d: %7.2f cycles per mma per sub-partition (%s)\n",
         INT8 ? "m16n8k32 u8.s8->s32" : "m16n8k16 f16->f32", warps_per_sp, C, med / mmas_per_sp,
         err == cudaSuccess ? "ok" : cudaGetErrorString(err));
  cudaFree(d_cycles);
  cudaFree(sink);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  printf("SMs %d; latency = 1 warp x 1 chain; throughput = more warps / chains\n", sms);
  run<true, 1>(sms, 1);
  run<false, 1>(sms, 1);
  run<true, 2>(sms, 1);
  run<true, 4>(sms, 1);
  run<true, 4>(sms, 2);
  run<true, 4>(sms, 4);
  run<true, 2>(sms, 6);
  run<false, 4>(sms, 1);
  run<false, 4>(sms, 2);
  run<false, 4>(sms, 4);
  run<false, 2>(sms, 6);
  return 0;
}
