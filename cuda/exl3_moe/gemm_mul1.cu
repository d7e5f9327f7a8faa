// exl3_moe GEMM kernels for the mul1 codebook (one translation unit per codebook so builds run in parallel).
#include "exl3_moe/moe_gemm.cuh"

namespace twinspark {
namespace moe {
template cudaError_t launch_moe_gemm<exl3::kCbMul1>(const GemmParams&, bool, int, int, int, int, cudaStream_t);
}  // namespace moe
}  // namespace twinspark
