#ifdef TWINSPARK_WITH_CUDA
#include <pybind11/pybind11.h>

#include "common/bind_util.h"
#include "engram_dequant/engram_dequant.h"

namespace py = pybind11;

void bind_engram_dequant(py::module_& m) {
  m.def(
      "engram_dequant",
      [](std::uintptr_t weight, int64_t weight_stride, std::uintptr_t scale, int64_t scale_stride, int64_t n,
         std::uintptr_t out, int64_t out_stride, std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::engram_dequant(twinspark::ptr<const uint8_t>(weight), weight_stride,
                                      twinspark::ptr<const uint8_t>(scale), scale_stride, n, twinspark::ptr<void>(out),
                                      out_stride, twinspark::stream(stream)),
            "engram_dequant");
      },
      py::arg("weight"), py::arg("weight_stride"), py::arg("scale"), py::arg("scale_stride"), py::arg("n"),
      py::arg("out"), py::arg("out_stride"), py::arg("stream"),
      "fp8 e4m3 rows x E8M0 scales -> bf16 rows (strides: bytes for inputs, elements for out)");
}
#endif
