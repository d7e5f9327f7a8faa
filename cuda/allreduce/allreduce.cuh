// One-shot all-reduce kernel (see allreduce.h for the protocol). Arch-neutral: ld.acquire/st.release at
// system scope, fence.sc.sys, 16-byte vector loads; builds for sm_90a and sm_121a alike.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "allreduce/allreduce.h"

namespace twinspark::allreduce {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Peer data changes between calls at the same address: bypass L1 (.cv) so a stale line is never reused.
__device__ __forceinline__ uint4 ld_fresh(const uint4* p) { return __ldcv(p); }

template <typename T>
struct Pack;

template <>
struct Pack<float> {
  static constexpr int N = 4;
  __device__ static void load(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 store(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ static float to_f(float x) { return x; }
  __device__ static float from_f(float x) { return x; }
};

template <typename T, typename T2, float2 (*ToF2)(T2), T2 (*FromF2)(float2)>
struct Pack16 {
  static constexpr int N = 8;
  __device__ static void load(const uint4& v, float* f) {
    const T2* h = reinterpret_cast<const T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 x = ToF2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
  __device__ static uint4 store(const float* f) {
    uint4 v;
    T2* h = reinterpret_cast<T2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = FromF2(make_float2(f[2 * i], f[2 * i + 1]));
    return v;
  }
};

__device__ __forceinline__ float2 h2_to_f2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ __half2 f2_to_h2(float2 x) { return __float22half2_rn(x); }
__device__ __forceinline__ float2 b2_to_f2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ __nv_bfloat162 f2_to_b2(float2 x) { return __float22bfloat162_rn(x); }

template <>
struct Pack<__half> : Pack16<__half, __half2, h2_to_f2, f2_to_h2> {
  __device__ static float to_f(__half x) { return __half2float(x); }
  __device__ static __half from_f(float x) { return __float2half_rn(x); }
};
template <>
struct Pack<__nv_bfloat16> : Pack16<__nv_bfloat16, __nv_bfloat162, b2_to_f2, f2_to_b2> {
  __device__ static float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) oneshot_kernel(Plan p, const T* __restrict__ in, T* out, int64_t n) {
  using P = Pack<T>;
  constexpr int N = P::N;
  __shared__ int abort_call;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  const int G = gridDim.x;
  // The previous launch on this stream wrote counters[0]; kernel boundaries make it visible.
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(p.counters) + 1;
  const int slot = epoch & 1;
  const int64_t nvec = n / N;
  const int64_t per = (nvec + G - 1) / G;
  const int64_t v0 = min(b * per, nvec), v1 = min(v0 + per, nvec);
  const bool tail_block = (b == G - 1);  // the < N trailing elements go to the last block
  if (tid == 0) abort_call = 0;

  // 1. Publish this rank's slice.
  const uint4* in4 = reinterpret_cast<const uint4*>(in);
  uint4* pub4 = reinterpret_cast<uint4*>(p.publish[slot]);
  for (int64_t i = v0 + tid; i < v1; i += blockDim.x) __stcg(pub4 + i, in4[i]);
  if (tail_block) {
    T* pub = reinterpret_cast<T*>(p.publish[slot]);
    for (int64_t e = nvec * N + tid; e < n; e += blockDim.x) pub[e] = in[e];
  }
  __syncthreads();
  if (p.mode == kPeerFlags) {
    if (tid < p.world && tid != p.rank) {
      __threadfence_system();
      st_release_sys(p.post[tid] + b * kMaxRanks, epoch);
    }
  } else if (tid == 0) {
    __threadfence_system();
    if (atomicAdd(p.counters + 2, 1u) == static_cast<unsigned>(G - 1)) {
      p.counters[2] = 0;
      __threadfence_system();
      // One header per slot: the proxy may still be forwarding the previous call when this one is posted.
      reinterpret_cast<volatile uint32_t*>(p.post[slot])[1] = static_cast<uint32_t>(n * sizeof(T));
      st_release_sys(p.post[slot], epoch);
    }
  }

  // 2. Wait for every peer (thread r watches rank r), bounded by timeout_ns.
  if (tid < p.world && tid != p.rank) {
    const uint32_t* f = p.wait[tid] + (p.mode == kPeerFlags ? b * kMaxRanks : 0);
    const uint64_t t0 = globaltimer_ns();
    uint32_t spins = 0;
    while (static_cast<int32_t>(ld_acquire_sys(f) - epoch) < 0) {
      if ((++spins & 255u) == 0) {
        volatile Status* st = p.status;
        const bool failed_elsewhere = st->code != kOk;
        if (failed_elsewhere || globaltimer_ns() - t0 > p.timeout_ns) {
          if (!failed_elsewhere) {
            st->peer = tid, st->epoch = epoch, st->block = b;
            __threadfence_system();
            st->code = kTimeout;
          }
          atomicExch(&abort_call, 1);
          break;
        }
      }
    }
  }
  __syncthreads();
  if (abort_call) return;  // the communicator is now unusable; the host reports Status

  // 3. Sum all ranks in order 0..world-1 in fp32 (same order everywhere: bit-identical results).
  uint4* out4 = reinterpret_cast<uint4*>(out);
  for (int64_t i = v0 + tid; i < v1; i += blockDim.x) {
    uint4 v[kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < p.world) v[r] = (r == p.rank) ? in4[i] : ld_fresh(reinterpret_cast<const uint4*>(p.src[r][slot]) + i);
    float acc[N], x[N];
    P::load(v[0], acc);
#pragma unroll
    for (int r = 1; r < kMaxRanks; ++r) {
      if (r < p.world) {
        P::load(v[r], x);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += x[k];
      }
    }
    out4[i] = P::store(acc);
  }
  if (tail_block) {
    for (int64_t e = nvec * N + tid; e < n; e += blockDim.x) {
      float acc = 0.f;
      for (int r = 0; r < p.world; ++r) {
        const T xr = (r == p.rank) ? in[e] : reinterpret_cast<const volatile T*>(p.src[r][slot])[e];
        acc = (r == 0) ? P::to_f(xr) : acc + P::to_f(xr);
      }
      out[e] = P::from_f(acc);
    }
  }

  // 4. Retire the epoch once every block is done (the next launch reads it).
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.counters + 1, 1u) == static_cast<unsigned>(G - 1)) {
      p.counters[1] = 0;
      p.counters[0] = epoch;
    }
  }
}

}  // namespace twinspark::allreduce
