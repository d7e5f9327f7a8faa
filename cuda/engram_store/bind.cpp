// Python bindings of the Engram row store (always built) and its CUDA staging slot (CUDA builds only).
// Pointers cross as integers; blocking calls release the GIL so other Python threads keep running.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "engram_store/engram_store.h"
#ifdef TWINSPARK_WITH_CUDA
#include "common/bind_util.h"
#include "engram_store/staging.h"
#endif

namespace py = pybind11;
using twinspark::engram::Batch;
using twinspark::engram::Extent;
using twinspark::engram::Store;

void bind_engram_store(py::module_& m) {
  py::class_<Batch, std::shared_ptr<Batch>>(m, "EngramBatch", "one submitted lookup; wait() before using the rows")
      .def(
          "wait",
          [](Batch& b) {
            {
              py::gil_scoped_release nogil;
              b.wait();
            }
            if (!b.error.empty()) throw std::runtime_error(b.error);
          },
          "block until every row is written; raises RuntimeError naming the file when a read failed")
      .def("ready", &Batch::ready);

  py::class_<Store, std::shared_ptr<Store>>(m, "EngramStore", "file-backed Engram rows (see engram_store.h)")
      .def(py::init([](const std::vector<std::tuple<std::string, int64_t, uint32_t, uint32_t, uint32_t>>& extents,
                       int64_t first_row, int64_t end_row, int threads, uint64_t cache_bytes,
                       const std::string& io_mode, int queue_depth, const std::string& io_engine) {
             std::vector<Extent> ex;
             for (const auto& t : extents) {
               Extent e;
               std::tie(e.path, e.base, e.stride, e.length, e.record_off) = t;
               ex.push_back(e);
             }
             py::gil_scoped_release nogil;
             return std::make_shared<Store>(std::move(ex), first_row, end_row, threads, cache_bytes, io_mode,
                                            queue_depth, io_engine);
           }),
           py::arg("extents"), py::arg("first_row"), py::arg("end_row"), py::arg("threads"), py::arg("cache_bytes"),
           py::arg("io_mode"), py::arg("queue_depth") = 32, py::arg("io_engine") = "auto",
           "extents: [(path, base, stride, length, record_offset)]")
      .def(
          "submit",
          [](Store& s, std::uintptr_t ids, bool ids_int32, int64_t n, std::uintptr_t weight, std::uintptr_t scale) {
            return s.submit(ids_int32 ? nullptr : reinterpret_cast<const int64_t*>(ids),
                            ids_int32 ? reinterpret_cast<const int32_t*>(ids) : nullptr, n,
                            reinterpret_cast<uint8_t*>(weight), reinterpret_cast<uint8_t*>(scale));
          },
          py::arg("ids"), py::arg("ids_int32"), py::arg("n"), py::arg("weight"), py::arg("scale"),
          "start a lookup of host ids into host weight [n,256] / scale [n,8] buffers; returns an EngramBatch")
      .def("drop_page_cache", &Store::drop_page_cache)
      .def_property_readonly("direct", &Store::direct)
      .def_property_readonly("io_path", &Store::io_path)
      .def_property_readonly("queue_depth", &Store::queue_depth)
      .def_property_readonly("io_note", &Store::io_note)
      .def_property_readonly("threads", &Store::threads)
      .def_property_readonly("first_row", &Store::first_row)
      .def_property_readonly("end_row", &Store::end_row)
      .def_property_readonly("host_bytes", &Store::host_bytes)
      .def_property_readonly("cache_bytes", &Store::cache_bytes)
      .def_property_readonly("cache_hits", &Store::cache_hits)
      .def_property_readonly("cache_misses", &Store::cache_misses)
      .def_property_readonly("reads", &Store::reads);

#ifdef TWINSPARK_WITH_CUDA
  using twinspark::engram::Slot;
  py::class_<Slot, std::shared_ptr<Slot>>(m, "EngramSlot", "pinned staging + graph-capturable lookup (staging.h)")
      .def(py::init<std::shared_ptr<Store>, int64_t>(), py::arg("store"), py::arg("capacity"))
      .def(
          "enqueue",
          [](Slot& s, std::uintptr_t ids, bool ids_int32, int64_t n, std::uintptr_t weight, std::uintptr_t scale,
             std::uintptr_t stream) {
            twinspark::check_launch(
                s.enqueue(reinterpret_cast<const void*>(ids), ids_int32, n, reinterpret_cast<void*>(weight),
                          reinterpret_cast<void*>(scale), twinspark::stream(stream)),
                "engram lookup");
          },
          py::arg("ids"), py::arg("ids_int32"), py::arg("n"), py::arg("weight"), py::arg("scale"), py::arg("stream"))
      .def("take_error", &Slot::take_error)
      .def_property_readonly("capacity", &Slot::capacity)
      .def_property_readonly("pinned_bytes", &Slot::pinned_bytes);
#endif
}
