// Python binding of the one-shot all-reduce kernel and the CUDA memory it needs (device buffers shared by
// CUDA IPC, mapped pinned status words). Pointers cross as integers; Python owns the protocol set-up.
#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "allreduce/allreduce.h"
#include "common/bind_util.h"

namespace py = pybind11;
namespace ar = twinspark::allreduce;
using twinspark::check_launch;

namespace {

template <typename T>
T* as(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

ar::Plan make_plan(int rank, int world, int mode, int max_blocks, double timeout_s, std::uintptr_t status,
                   std::uintptr_t counters, std::vector<std::uintptr_t> publish,
                   std::vector<std::vector<std::uintptr_t>> src, std::vector<std::uintptr_t> post,
                   std::vector<std::uintptr_t> wait, size_t capacity) {
  const char* op = "allreduce";
  if (world < 1 || world > ar::kMaxRanks) throw std::invalid_argument(std::string(op) + ": world must be 1..8");
  if (rank < 0 || rank >= world) throw std::invalid_argument(std::string(op) + ": rank must be in [0, world)");
  if (mode != ar::kPeerFlags && mode != ar::kHostProxy) throw std::invalid_argument("allreduce: unknown mode");
  // post has one entry per rank (kPeerFlags) or one per slot (kHostProxy, also when world == 1).
  if (publish.size() != 2 || src.size() != static_cast<size_t>(world) || post.size() < static_cast<size_t>(world) ||
      post.size() > static_cast<size_t>(ar::kMaxRanks) || wait.size() != static_cast<size_t>(world))
    throw std::invalid_argument("allreduce: publish needs 2 slots and src/post/wait one entry per rank");
  ar::Plan p;
  p.rank = rank, p.world = world, p.mode = mode, p.max_blocks = max_blocks;
  p.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  p.status = as<ar::Status>(status);
  p.counters = as<uint32_t>(counters);
  p.capacity = capacity;
  for (int s = 0; s < 2; ++s) p.publish[s] = as<void>(publish[s]);
  for (int r = 0; r < world; ++r) {
    if (src[r].size() != 2) throw std::invalid_argument("allreduce: src[r] needs 2 slots");
    for (int s = 0; s < 2; ++s) p.src[r][s] = as<const void>(src[r][s]);
    p.wait[r] = as<const uint32_t>(wait[r]);
  }
  for (size_t k = 0; k < post.size(); ++k) p.post[k] = as<uint32_t>(post[k]);
  return p;
}

}  // namespace

void bind_allreduce(py::module_& m) {
  py::class_<ar::Plan>(m, "AllreducePlan", "Pointers and sizes of one rank's one-shot all-reduce")
      .def(py::init(&make_plan), py::arg("rank"), py::arg("world"), py::arg("mode"), py::arg("max_blocks"),
           py::arg("timeout_s"), py::arg("status"), py::arg("counters"), py::arg("publish"), py::arg("src"),
           py::arg("post"), py::arg("wait"), py::arg("capacity"))
      .def("grid", [](const ar::Plan& p, int64_t n, int elem_size) { return ar::grid_for(p, n, elem_size); })
      .def(
          "launch",
          [](const ar::Plan& p, std::uintptr_t in, std::uintptr_t out, int64_t n, int dtype, std::uintptr_t stream) {
            check_launch(ar::oneshot(p, as<const void>(in), as<void>(out), n, static_cast<ar::DType>(dtype),
                                     twinspark::stream(stream)),
                         "allreduce");
          },
          py::arg("inp"), py::arg("out"), py::arg("n"), py::arg("dtype"), py::arg("stream"));
  m.attr("allreduce_max_ranks") = ar::kMaxRanks;
  m.attr("allreduce_max_blocks") = ar::kMaxBlocks;
  m.attr("allreduce_header_bytes") = ar::kHeaderBytes;
  m.attr("allreduce_counters_offset") = ar::kCountersOffset;

  // Device memory of this rank's buffer (header zeroed); cudaMalloc so the whole allocation is one IPC handle.
  m.def("allreduce_device_alloc", [](size_t bytes) {
    void* p = nullptr;
    check_launch(cudaMalloc(&p, bytes), "allreduce_device_alloc");
    check_launch(cudaMemset(p, 0, bytes < ar::kHeaderBytes ? bytes : ar::kHeaderBytes), "allreduce_device_alloc");
    check_launch(cudaDeviceSynchronize(), "allreduce_device_alloc");
    return reinterpret_cast<std::uintptr_t>(p);
  });
  m.def("allreduce_device_free",
        [](std::uintptr_t p) { check_launch(cudaFree(as<void>(p)), "allreduce_device_free"); });
  m.def("allreduce_ipc_handle", [](std::uintptr_t p) {
    cudaIpcMemHandle_t h;
    check_launch(cudaIpcGetMemHandle(&h, as<void>(p)), "allreduce_ipc_handle");
    return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
  });
  m.def("allreduce_ipc_open", [](py::bytes handle) {
    std::string s = handle;
    if (s.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("allreduce_ipc_open: bad handle size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, s.data(), sizeof(h));
    void* p = nullptr;
    check_launch(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "allreduce_ipc_open");
    return reinterpret_cast<std::uintptr_t>(p);
  });
  m.def("allreduce_ipc_close",
        [](std::uintptr_t p) { check_launch(cudaIpcCloseMemHandle(as<void>(p)), "allreduce_ipc_close"); });
  // Mapped pinned host memory (zeroed), for the Status words the kernel writes and the host reads without a sync.
  m.def("allreduce_pinned_alloc", [](size_t bytes) {
    void* p = nullptr;
    check_launch(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "allreduce_pinned_alloc");
    std::memset(p, 0, bytes);
    return reinterpret_cast<std::uintptr_t>(p);
  });
  m.def("allreduce_pinned_free",
        [](std::uintptr_t p) { check_launch(cudaFreeHost(as<void>(p)), "allreduce_pinned_free"); });
  m.def("allreduce_status", [](std::uintptr_t p) {
    const volatile uint32_t* s = as<const volatile uint32_t>(p);
    return py::make_tuple(s[0], s[1], s[2], s[3]);
  });
}
#endif
