// Which arch the running GPU is and whether this module carries a kernel image for it.
#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include "common/bind_util.h"

namespace py = pybind11;

// Defined in cuda/common/probe.cu: a trivial kernel; its attributes tell whether an image exists for a device.
cudaError_t twinspark_probe_kernel_image(int device);

void bind_cuda_info(py::module_& m) {
  m.def(
      "device_has_image",
      [](int device) {
        cudaError_t err = twinspark_probe_kernel_image(device);
        if (err == cudaSuccess) return true;
        if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
          cudaGetLastError();
          return false;
        }
        twinspark::check_launch(err, "device_has_image");
        return false;
      },
      py::arg("device"), "True when this module holds a cubin that runs on the given CUDA device");
}
#endif
