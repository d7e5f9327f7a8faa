#ifdef TWINSPARK_WITH_CUDA
#include <pybind11/pybind11.h>

#include "common/bind_util.h"
#include "exl3_gemm/exl3_gemm.h"

namespace py = pybind11;

namespace {
twinspark::Exl3GemmSmallArgs small_args(std::uintptr_t x, long x_stride, std::uintptr_t trellis, std::uintptr_t suh,
                                        std::uintptr_t svh, std::uintptr_t bias, std::uintptr_t out, long out_stride,
                                        std::uintptr_t ws, std::uintptr_t counters, int m, int k, int n,
                                        int chunks_per_split, int splits, bool bf16, std::uintptr_t xh) {
  twinspark::Exl3GemmSmallArgs a{};
  a.x = twinspark::ptr<const void>(x);
  a.x_stride = x_stride;
  a.xh = twinspark::ptr<void>(xh);
  a.trellis = twinspark::ptr<const int16_t>(trellis);
  a.suh = twinspark::ptr<const void>(suh);
  a.svh = twinspark::ptr<const void>(svh);
  a.bias = twinspark::ptr<const void>(bias);
  a.out = twinspark::ptr<void>(out);
  a.out_stride = out_stride;
  a.ws = twinspark::ptr<float>(ws);
  a.counters = twinspark::ptr<int>(counters);
  a.m = m, a.k = k, a.n = n;
  a.chunks_per_split = chunks_per_split;
  a.splits = splits;
  a.bf16 = bf16;
  return a;
}
}  // namespace

void bind_exl3_gemm(py::module_& m) {
  m.def(
      "exl3_gemm_small",
      [](std::uintptr_t x, long x_stride, std::uintptr_t trellis, std::uintptr_t suh, std::uintptr_t svh,
         std::uintptr_t bias, std::uintptr_t out, long out_stride, std::uintptr_t ws, std::uintptr_t counters, int m,
         int k, int n, int K, int codebook, int groups, int chunks_per_split, int splits, bool bf16,
         std::uintptr_t stream, std::uintptr_t xh) {
        const auto a = small_args(x, x_stride, trellis, suh, svh, bias, out, out_stride, ws, counters, m, k, n,
                                  chunks_per_split, splits, bf16, xh);
        twinspark::check_launch(twinspark::exl3_gemm_small(a, K, codebook, groups, twinspark::stream(stream)),
                                "exl3_gemm");
      },
      py::arg("x"), py::arg("x_stride"), py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("bias"),
      py::arg("out"), py::arg("out_stride"), py::arg("ws"), py::arg("counters"), py::arg("m"), py::arg("k"),
      py::arg("n"), py::arg("K"), py::arg("codebook"), py::arg("groups"), py::arg("chunks_per_split"),
      py::arg("splits"), py::arg("bf16"), py::arg("stream"), py::arg("xh") = 0);
  m.def(
      "exl3_gemm_grouped",
      [](std::uintptr_t x, long x_stride, long x_gstride, std::uintptr_t trellis, std::uintptr_t suh,
         std::uintptr_t svh, std::uintptr_t bias, std::uintptr_t out, long out_stride, long out_gstride,
         std::uintptr_t ws, std::uintptr_t counters, int mats, int m, int k, int n, int K, int codebook, int groups,
         int chunks_per_split, int splits, bool bf16, std::uintptr_t stream, std::uintptr_t xh) {
        twinspark::Exl3GemmGroupedArgs g{};
        g.a = small_args(x, x_stride, trellis, suh, svh, bias, out, out_stride, ws, counters, m, k, n, chunks_per_split,
                         splits, bf16, xh);
        g.mats = mats;
        g.x_gstride = x_gstride;
        g.out_gstride = out_gstride;
        twinspark::check_launch(twinspark::exl3_gemm_grouped(g, K, codebook, groups, twinspark::stream(stream)),
                                "exl3_gemm_grouped");
      },
      py::arg("x"), py::arg("x_stride"), py::arg("x_gstride"), py::arg("trellis"), py::arg("suh"), py::arg("svh"),
      py::arg("bias"), py::arg("out"), py::arg("out_stride"), py::arg("out_gstride"), py::arg("ws"),
      py::arg("counters"), py::arg("mats"), py::arg("m"), py::arg("k"), py::arg("n"), py::arg("K"), py::arg("codebook"),
      py::arg("groups"), py::arg("chunks_per_split"), py::arg("splits"), py::arg("bf16"), py::arg("stream"),
      py::arg("xh") = 0, "mats small-m EXL3 GEMMs of one shape in one launch (exl3_gemm.h: Exl3GemmGroupedArgs)");
  m.def(
      "exl3_gemm_capture_id",
      [](std::uintptr_t stream) {
        unsigned long long id = 0;
        twinspark::check_launch(twinspark::exl3_gemm_capture_id(twinspark::stream(stream), &id),
                                "exl3_gemm (capture id)");
        return id;
      },
      py::arg("stream"), "id of the stream's active graph capture, 0 when it is not capturing");
  m.def(
      "exl3_gemm_dequant_w",
      [](std::uintptr_t trellis, std::uintptr_t suh, std::uintptr_t svh, int k, int n, int K, int codebook, bool bf16,
         std::uintptr_t w, std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::exl3_gemm_dequant_w(twinspark::ptr<const int16_t>(trellis), twinspark::ptr<const void>(suh),
                                           twinspark::ptr<const void>(svh), k, n, K, codebook, bf16,
                                           twinspark::ptr<void>(w), twinspark::stream(stream)),
            "exl3_gemm (dequant_w)");
      },
      py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("k"), py::arg("n"), py::arg("K"), py::arg("codebook"),
      py::arg("bf16"), py::arg("w"), py::arg("stream"));
  m.def(
      "exl3_gemm_prep_x_blocked",
      [](std::uintptr_t x, long x_stride, bool bf16, std::uintptr_t suh, int m, int k, std::uintptr_t xb,
         std::uintptr_t stream) {
        twinspark::check_launch(twinspark::exl3_gemm_prep_x_blocked(
                                    twinspark::ptr<const void>(x), x_stride, bf16, twinspark::ptr<const void>(suh), m,
                                    k, twinspark::ptr<void>(xb), twinspark::stream(stream)),
                                "exl3_gemm (prep_x_blocked)");
      },
      py::arg("x"), py::arg("x_stride"), py::arg("bf16"), py::arg("suh"), py::arg("m"), py::arg("k"), py::arg("xb"),
      py::arg("stream"));
  m.def(
      "exl3_gemm_fused",
      [](std::uintptr_t xb, std::uintptr_t trellis, std::uintptr_t y, std::uintptr_t part, std::uintptr_t flags, int m,
         int k, int n, int K, int codebook, int block, int chunks_per_split, int splits, std::uintptr_t stream) {
        twinspark::Exl3GemmFusedArgs a{};
        a.xb = twinspark::ptr<const void>(xb);
        a.trellis = twinspark::ptr<const int16_t>(trellis);
        a.y = twinspark::ptr<void>(y);
        a.part = twinspark::ptr<float>(part);
        a.flags = twinspark::ptr<int>(flags);
        a.m = m, a.k = k, a.n = n;
        a.chunks_per_split = chunks_per_split;
        a.splits = splits;
        twinspark::check_launch(twinspark::exl3_gemm_fused(a, K, codebook, block, twinspark::stream(stream)),
                                "exl3_gemm (fused)");
      },
      py::arg("xb"), py::arg("trellis"), py::arg("y"), py::arg("part"), py::arg("flags"), py::arg("m"), py::arg("k"),
      py::arg("n"), py::arg("K"), py::arg("codebook"), py::arg("block"), py::arg("chunks_per_split"), py::arg("splits"),
      py::arg("stream"));
  m.def(
      "exl3_gemm_prep_x",
      [](std::uintptr_t x, long x_stride, bool bf16, std::uintptr_t suh, int m, int k, std::uintptr_t xh,
         std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::exl3_gemm_prep_x(twinspark::ptr<const void>(x), x_stride, bf16, twinspark::ptr<const void>(suh),
                                        m, k, twinspark::ptr<void>(xh), twinspark::stream(stream)),
            "exl3_gemm (prep_x)");
      },
      py::arg("x"), py::arg("x_stride"), py::arg("bf16"), py::arg("suh"), py::arg("m"), py::arg("k"), py::arg("xh"),
      py::arg("stream"));
  m.def(
      "exl3_gemm_fused_mma",
      [](std::uintptr_t xh, std::uintptr_t trellis, std::uintptr_t y, int m, int k, int n, int K, int codebook,
         int tokens, int chunks_per_split, int splits, std::uintptr_t stream) {
        twinspark::Exl3GemmFusedArgs a{};
        a.xb = twinspark::ptr<const void>(xh);
        a.trellis = twinspark::ptr<const int16_t>(trellis);
        a.y = twinspark::ptr<void>(y);
        a.m = m, a.k = k, a.n = n;
        a.chunks_per_split = chunks_per_split;
        a.splits = splits;
        twinspark::check_launch(twinspark::exl3_gemm_fused_mma(a, K, codebook, tokens, twinspark::stream(stream)),
                                "exl3_gemm (fused_mma)");
      },
      py::arg("xh"), py::arg("trellis"), py::arg("y"), py::arg("m"), py::arg("k"), py::arg("n"), py::arg("K"),
      py::arg("codebook"), py::arg("tokens"), py::arg("chunks_per_split"), py::arg("splits"), py::arg("stream"));
  m.def(
      "exl3_gemm_epilogue",
      [](std::uintptr_t y, int splits, std::uintptr_t svh, std::uintptr_t bias, int m, int n, std::uintptr_t out,
         long out_stride, bool bf16, std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::exl3_gemm_epilogue(twinspark::ptr<const void>(y), splits, twinspark::ptr<const void>(svh),
                                          twinspark::ptr<const void>(bias), m, n, twinspark::ptr<void>(out), out_stride,
                                          bf16, twinspark::stream(stream)),
            "exl3_gemm (epilogue)");
      },
      py::arg("y"), py::arg("splits"), py::arg("svh"), py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("out"),
      py::arg("out_stride"), py::arg("bf16"), py::arg("stream"));
}
#endif
