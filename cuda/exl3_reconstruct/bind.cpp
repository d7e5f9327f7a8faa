#ifdef TWINSPARK_WITH_CUDA
#include <pybind11/pybind11.h>

#include "common/bind_util.h"
#include "exl3_reconstruct/exl3_reconstruct.h"

namespace py = pybind11;

void bind_exl3_reconstruct(py::module_& m) {
  m.def(
      "exl3_reconstruct",
      [](std::uintptr_t trellis, int tiles_k, int tiles_n, int ka, bool half, int codebook, std::uintptr_t out,
         bool out_bf16, std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::exl3_reconstruct(twinspark::ptr<const int16_t>(trellis), tiles_k, tiles_n, ka, half, codebook,
                                        twinspark::ptr<void>(out), out_bf16, twinspark::stream(stream)),
            "exl3_reconstruct");
      },
      py::arg("trellis"), py::arg("tiles_k"), py::arg("tiles_n"), py::arg("ka"), py::arg("half"), py::arg("codebook"),
      py::arg("out"), py::arg("out_bf16"), py::arg("stream"));
}
#endif
