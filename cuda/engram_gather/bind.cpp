#ifdef TWINSPARK_WITH_CUDA
#include <pybind11/pybind11.h>

#include "common/bind_util.h"
#include "engram_gather/engram_gather.h"

namespace py = pybind11;

void bind_engram_gather(py::module_& m) {
  m.def(
      "engram_gather",
      [](std::uintptr_t weight, int64_t weight_stride, std::uintptr_t scale, int64_t scale_stride, int64_t table_rows,
         std::uintptr_t ids, bool ids_int32, int64_t first_row, int64_t n, std::uintptr_t out, int64_t out_stride,
         std::uintptr_t stream) {
        twinspark::check_launch(
            twinspark::engram_gather(twinspark::ptr<const uint8_t>(weight), weight_stride,
                                     twinspark::ptr<const uint8_t>(scale), scale_stride, table_rows,
                                     twinspark::ptr<const void>(ids), ids_int32, first_row, n,
                                     twinspark::ptr<void>(out), out_stride, twinspark::stream(stream)),
            "engram_gather");
      },
      py::arg("weight"), py::arg("weight_stride"), py::arg("scale"), py::arg("scale_stride"), py::arg("table_rows"),
      py::arg("ids"), py::arg("ids_int32"), py::arg("first_row"), py::arg("n"), py::arg("out"), py::arg("out_stride"),
      py::arg("stream"),
      "gather table rows by id (zero rows outside [first_row, first_row + table_rows)) and dequantize to bf16");
}
#endif
