// exl3_gemm: y = ((((x ⊙ suh) · Hk) · W_hat) · Hn) ⊙ svh + bias for one EXL3 linear layer (exl3-format.md §4).
//
// Contract (checked in Python, re-checked cheaply here):
//   x     fp16 or bf16 [m, k], row stride x_stride (elements, multiple of 4), 8-byte aligned rows
//   trellis int16 [k/16, n/16, 16*K] contiguous, 16-byte aligned; whole rates K = 1..8
//   suh fp16 [k], svh fp16 [n], bias fp16 [n] or null
//   out   same dtype as x, [m, n], row stride out_stride (elements, multiple of 4)
//   k, n multiples of 128; codebook 0=3inst 1=mcg 2=mul1
//   ws    fp32 [64 * n] and counters int32 [n / 128]: per (device, stream), all zero on entry; the kernel leaves
//         them zero again (the last block of each 128-column strip reads and clears its strip).
// Grouped small-m launch (exl3_gemm_grouped): mats matrices of one shape and rate, each as above, in one launch.
// Launchers return cudaError_t; they never synchronize or allocate.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace twinspark {

struct Exl3GemmSmallArgs {
  const void* x;
  long x_stride;
  void* xh;  // null, or an fp16 [m, k] workspace: the launcher first writes x' = fp16(Hk(x ⊙ suh)) there (prep
             // kernel) and the GEMM reads x' once instead of every 128-column strip redoing the Hadamard
  const int16_t* trellis;
  const void* suh;
  const void* svh;
  const void* bias;  // may be null
  void* out;
  long out_stride;
  float* ws;
  int* counters;
  int m, k, n;
  int chunks_per_split;  // 128-row chunks of k per block
  int splits;            // blocks along k (gridDim.y)
  bool bf16;             // x and out are bf16 (else fp16)
};

// Small-m path: decode in registers + mma.sync, split-k with an fp32 reduction in ws. m <= 64 per launch
// (the caller slices larger m). groups = tokens / 8 rounded up to 1, 2, 4 or 8.
cudaError_t exl3_gemm_small(const Exl3GemmSmallArgs& a, int K, int codebook, int groups, cudaStream_t stream);

// Grouped small-m path: `mats` GEMMs of one shape, rate and codebook in one launch of the small kernel (grid.z =
// mats). Matrix i reads x + i * x_gstride and writes out + i * out_gstride (elements, multiples of 4; a.x and
// a.out are matrix 0's); trellis [mats, k/16, n/16, 16*K], suh [mats, k], svh and bias [mats, n], xh (the x'
// prep buffer, when set) [mats, m, k], ws [mats, 64, n] and counters [mats, n / 128] are stacked.
struct Exl3GemmGroupedArgs {
  Exl3GemmSmallArgs a;
  int mats;
  long x_gstride;
  long out_gstride;
};
cudaError_t exl3_gemm_grouped(const Exl3GemmGroupedArgs& g, int K, int codebook, int groups, cudaStream_t stream);

// Fused large-m path (sm_90a only; the launcher returns cudaErrorInvalidDeviceFunction on other GPUs):
// y' = x' · W_hat with the trellis decoded into wgmma operands (fused_sm90.cuh). xb = x' in the blocked layout of
// exl3_gemm_prep_x_blocked. block 0 = 128 columns x 256 tokens per tile, block 2 = 128 x 128. With part set
// (block 0 only) the launch runs stream-K over `splits` blocks (1 .. the launch's tile x 64-row-chunk
// iterations; at most the SMs it can have resident is best), y fp16 [m, n], part fp32 [splits][256 * 128] scratch,
// flags int32 [splits] zero on entry (left zero). Without: one tile per block and k split in `splits` parts of
// chunks_per_split 64-row chunks, y fp16 [m, n] when splits == 1, else fp32 partials [splits, m, n]. Finish with
// exl3_gemm_epilogue (which sums the partials).
struct Exl3GemmFusedArgs {
  const void* xb;
  const int16_t* trellis;
  void* y;
  float* part;  // stream-K (block 0), else null
  int* flags;   // stream-K
  int m, k, n;
  int chunks_per_split;  // k split
  int splits;
};
cudaError_t exl3_gemm_fused(const Exl3GemmFusedArgs& a, int K, int codebook, int block, cudaStream_t stream);
// Fused prefill through mma.sync (any arch, fused_mma.cuh): the same y' = x' · W_hat with xb = x' ROW-MAJOR fp16
// [m, k] (exl3_gemm_prep_x), 128 columns x `tokens` (64, 128 or 256) tokens per block, k split in `splits` parts of
// chunks_per_split 64-row chunks; y fp16 [m, n] when splits == 1, else fp32 partials [splits, m, n] (part, flags
// unused). Finish with exl3_gemm_epilogue.
cudaError_t exl3_gemm_fused_mma(const Exl3GemmFusedArgs& a, int K, int codebook, int tokens, cudaStream_t stream);
// xb = fp16(Hk(x ⊙ suh)) as [k/64][ceil(m/8)*8 rows][64], 128-byte swizzled (rows m.. of the last group zero).
cudaError_t exl3_gemm_prep_x_blocked(const void* x, long x_stride, bool bf16, const void* suh, int m, int k, void* xb,
                                     cudaStream_t stream);

// Large-m path, folded (the GEMM itself is one dense matmul y = x @ W): w[k, n] row-major in x's dtype (bf16 or
// fp16) = diag(suh) Hk W_hat Hn diag(svh); trellis as above (k, n multiples of 128), suh [k] and svh [n] fp16.
cudaError_t exl3_gemm_dequant_w(const int16_t* trellis, const void* suh, const void* svh, int k, int n, int K,
                                int codebook, bool bf16, void* w, cudaStream_t stream);
// xh[m, k] fp16 = fp16(Hk(x ⊙ suh)); x as above, xh contiguous.
cudaError_t exl3_gemm_prep_x(const void* x, long x_stride, bool bf16, const void* suh, int m, int k, void* xh,
                             cudaStream_t stream);
// out[m, n] = Hn(y) ⊙ svh + bias; y fp16 [m, n] contiguous (splits == 0) or the sum of fp32 partials
// [splits, m, n] (splits >= 1); out in x's dtype with row stride out_stride.
cudaError_t exl3_gemm_epilogue(const void* y, int splits, const void* svh, const void* bias, int m, int n, void* out,
                               long out_stride, bool bf16, cudaStream_t stream);

// Capture sequence id of the stream's current graph capture (0 when not capturing): lets the Python side emit
// one workspace memset per captured graph when the workspace itself was allocated inside a capture.
cudaError_t exl3_gemm_capture_id(cudaStream_t stream, unsigned long long* id);

// One launcher per whole rate, each in its own translation unit (exl3_gemm_k<K>.cu).
#define TWINSPARK_EXL3_GEMM_DECLARE(K)                                                                             \
  cudaError_t exl3_gemm_small_k##K(const Exl3GemmSmallArgs& a, int codebook, int groups, cudaStream_t stream);     \
  cudaError_t exl3_gemm_grouped_k##K(const Exl3GemmGroupedArgs& g, int codebook, int groups, cudaStream_t stream); \
  cudaError_t exl3_gemm_dequant_w_k##K(const int16_t* trellis, const void* suh, const void* svh, int tiles_k,      \
                                       int tiles_n, int codebook, bool bf16, void* w, cudaStream_t stream);        \
  cudaError_t exl3_gemm_fused_k##K(const Exl3GemmFusedArgs& a, int codebook, int block, cudaStream_t stream);      \
  cudaError_t exl3_gemm_fused_mma_k##K(const Exl3GemmFusedArgs& a, int codebook, int tokens, cudaStream_t stream);
TWINSPARK_EXL3_GEMM_DECLARE(1)
TWINSPARK_EXL3_GEMM_DECLARE(2)
TWINSPARK_EXL3_GEMM_DECLARE(3)
TWINSPARK_EXL3_GEMM_DECLARE(4)
TWINSPARK_EXL3_GEMM_DECLARE(5)
TWINSPARK_EXL3_GEMM_DECLARE(6)
TWINSPARK_EXL3_GEMM_DECLARE(7)
TWINSPARK_EXL3_GEMM_DECLARE(8)
#undef TWINSPARK_EXL3_GEMM_DECLARE

}  // namespace twinspark
