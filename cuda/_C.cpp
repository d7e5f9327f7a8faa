// twinspark._C: the one pybind11 module. Each op folder provides `void bind_<op>(pybind11::module_&)` in its
// bind.cpp; this file only calls them. Pointers cross as integers (tensor.data_ptr()), streams as integers
// (torch.cuda.current_stream().cuda_stream): no torch headers anywhere in cuda/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/bind_util.h"

namespace py = pybind11;

#ifdef TWINSPARK_WITH_CUDA
void bind_cuda_info(py::module_& m);
void bind_exl3_reconstruct(py::module_& m);
void bind_exl3_gemm(py::module_& m);
void bind_engram_dequant(py::module_& m);
void bind_engram_gather(py::module_& m);
void bind_allreduce(py::module_& m);
void bind_exl3_moe(py::module_& m);
// (ops add their bind_<op> declarations here)
#endif
void bind_allreduce_host(py::module_& m);
// CPU-side C++ (always built) add their bind_<name> declarations here.
void bind_engram_store(py::module_& m);

static std::vector<std::string> built_archs() {
  std::vector<std::string> out;
  std::string s = TWINSPARK_CUDA_ARCHS;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "twinspark kernels (device code is torch-free: pointers, shapes and a stream in)";
  m.def("built_archs", &built_archs,
        "CUDA targets compiled into this module, e.g. ['90a', '121a']; empty when CPU-only");
#ifdef TWINSPARK_WITH_CUDA
  m.attr("with_cuda") = true;
  bind_cuda_info(m);
  bind_exl3_reconstruct(m);
  bind_exl3_gemm(m);
  bind_engram_dequant(m);
  bind_engram_gather(m);
  bind_allreduce(m);
  bind_exl3_moe(m);
  // (ops add their bind_<op>(m) calls here)
#else
  m.attr("with_cuda") = false;
#endif
  bind_allreduce_host(m);
  // CPU-side bind calls go here.
  bind_engram_store(m);
}
