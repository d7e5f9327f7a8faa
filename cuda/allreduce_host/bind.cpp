// Python binding of the host-memory all-reduce transport (always built; see host_comm.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "allreduce_host/host_comm.h"

namespace py = pybind11;
using twinspark::allreduce_host::HostComm;

void bind_allreduce_host(py::module_& m) {
  py::class_<HostComm>(m, "AllreduceHostComm",
                       "Pinned (or plain) host buffers plus a proxy thread that forwards this rank's partial")
      .def(py::init<int, int, size_t, bool, double>(), py::arg("rank"), py::arg("world"), py::arg("capacity"),
           py::arg("pinned"), py::arg("spin_us") = 50.0)
      .def_property_readonly("rank", &HostComm::rank)
      .def_property_readonly("world", &HostComm::world)
      .def_property_readonly("capacity", &HostComm::capacity)
      .def_property_readonly("pinned", &HostComm::pinned)
      .def_property_readonly("nbytes", &HostComm::bytes)
      .def_property_readonly("base", [](const HostComm& c) { return reinterpret_cast<std::uintptr_t>(c.base()); })
      .def("header", [](const HostComm& c, int slot) { return reinterpret_cast<std::uintptr_t>(c.header(slot)); })
      .def("status_addr", [](const HostComm& c) { return reinterpret_cast<std::uintptr_t>(c.status()); })
      .def("recv_flag", [](const HostComm& c, int r) { return reinterpret_cast<std::uintptr_t>(c.recv_flag(r)); })
      .def("send_slot", [](const HostComm& c, int s) { return reinterpret_cast<std::uintptr_t>(c.send_slot(s)); })
      .def("recv_slot",
           [](const HostComm& c, int r, int s) { return reinterpret_cast<std::uintptr_t>(c.recv_slot(r, s)); })
      .def(
          "status",
          [](const HostComm& c) {
            const uint32_t* s = c.status();
            return py::make_tuple(__atomic_load_n(s, __ATOMIC_ACQUIRE), s[1], s[2], s[3]);
          },
          "(code, peer, epoch, block): code 0 ok, 1 a peer never arrived, 2 the proxy failed")
      .def("connect_loopback", &HostComm::connect_loopback, py::arg("comms"))
      .def("connect_tcp", &HostComm::connect_tcp, py::arg("fds"))
      .def("connect_rdma", &HostComm::connect_rdma, py::arg("fds"), py::arg("device") = "", py::arg("port") = 1,
           py::arg("gid_index") = 3, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &HostComm::backend_name)
      .def("start", &HostComm::start)
      .def("stop", &HostComm::stop, py::call_guard<py::gil_scoped_release>())
      .def("post", &HostComm::post, py::arg("epoch"), py::arg("nbytes"))
      .def("wait", &HostComm::wait, py::arg("peer"), py::arg("epoch"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("error", &HostComm::error);
  m.def("allreduce_rdma_unavailable_reason", &twinspark::allreduce_host::rdma_unavailable_reason,
        "'' when the ibverbs backend can run here, else one sentence saying why not");
}
