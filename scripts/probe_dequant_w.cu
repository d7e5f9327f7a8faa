// dequant_w's parts as kernels of their own (not part of the package; a device-session tool): the package's kernel
// template with steps switched off at compile time (small_m.cuh, DwParts). Built and timed by
// scripts/probe_dequant_w.py through torch's extension loader; one rate (K = 5, the V4.1 attention and shared-expert
// rate), all three codebooks, fp16 or bf16.
#include <torch/extension.h>

#include "exl3_gemm/small_m.cuh"

namespace {

namespace ed = twinspark::exl3_gemm_detail;

void dequant_w_part(const std::string& part, int64_t trellis, int64_t suh, int64_t svh, int k, int n, int codebook,
                    bool bf16, int64_t w, int64_t stream) {
  TORCH_CHECK(k % 128 == 0 && n % 128 == 0, "probe_dequant_w: k and n must be multiples of 128, got ", k, "x", n);
  const auto* t = reinterpret_cast<const int16_t*>(trellis);
  const auto* h = reinterpret_cast<const void*>(suh);
  const auto* v = reinterpret_cast<const void*>(svh);
  auto* out = reinterpret_cast<void*>(w);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (part == "all")
    err = ed::launch_dequant_w_k<5, ed::DwParts::kAll>(t, h, v, k / 16, n / 16, codebook, bf16, out, s);
  else if (part == "k_side")
    err = ed::launch_dequant_w_k<5, ed::DwParts::kKSide>(t, h, v, k / 16, n / 16, codebook, bf16, out, s);
  else if (part == "decode")
    err = ed::launch_dequant_w_k<5, ed::DwParts::kDecode>(t, h, v, k / 16, n / 16, codebook, bf16, out, s);
  else
    TORCH_CHECK(false, "probe_dequant_w: part must be all, k_side or decode, got ", part);
  TORCH_CHECK(err == cudaSuccess, "probe_dequant_w: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dequant_w_part", &dequant_w_part); }
