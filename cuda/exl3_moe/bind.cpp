#ifdef TWINSPARK_WITH_CUDA
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/bind_util.h"
#include "common/trace.h"
#include "exl3_moe/exl3_moe.h"

namespace py = pybind11;

void bind_exl3_moe(py::module_& m) {
  // exl3_moe's per-block timeline (common/trace.cuh): the buffer's shape, and whether this build writes it
  m.attr("trace_shape") = py::make_tuple(2, twinspark::kTraceBlocks, twinspark::kTraceSlots);
  m.attr("trace_built") = twinspark::kTraceBuilt;
  // the rates with decode kernels of their own, as words per tile (ops.exl3_moe.RATE_WORDS must match)
  py::tuple rates(twinspark::kExl3MoeRates);
  for (int i = 0; i < twinspark::kExl3MoeRates; ++i) rates[i] = twinspark::kExl3MoeRateWords[i];
  m.attr("exl3_moe_rate_words") = rates;
  m.def(
      "exl3_moe_workspace",
      [](int T, int topk, int H, int I, int max_items, int splitk, int mt) {
        size_t n_int = 0, n_f32 = 0;
        twinspark::exl3_moe_workspace(T, topk, H, I, max_items, splitk, mt, &n_int, &n_f32);
        return py::make_tuple(n_int, n_f32);
      },
      py::arg("T"), py::arg("topk"), py::arg("H"), py::arg("I"), py::arg("max_items"), py::arg("splitk"), py::arg("mt"),
      "(int32 elements, float32 elements) of exl3_moe's per-call workspaces");
  m.def(
      "exl3_moe",
      [](std::uintptr_t x, std::uintptr_t ids, std::uintptr_t topk_w, std::uintptr_t trellis, std::uintptr_t offsets,
         std::uintptr_t words, std::uintptr_t suh13, std::uintptr_t svh13, std::uintptr_t suh2, std::uintptr_t svh2,
         std::uintptr_t ws_int, std::uintptr_t ws_f32, std::uintptr_t act_counters, std::uintptr_t out, int T, int topk,
         int E, int H, int I, int first_expert, int max_words, int words13, int words2, int codebook, float limit,
         bool x_bf16, int mt, int splitk, int short_groups, int max_items, int down_min_blocks, bool fuse_convert,
         bool small_route, bool bytesum, bool early_down, bool pdl, std::uintptr_t stream, std::uintptr_t trace,
         std::uintptr_t residency, int smem_per_sm, bool fit_smem, int64_t e_stride, int64_t m_stride,
         int gate_up_min_blocks, bool prep_a) {
        using twinspark::ptr;
        twinspark::Exl3MoeArgs a{};
        a.x = ptr<const void>(x);
        a.ids = ptr<const int32_t>(ids);
        a.topk_w = ptr<const float>(topk_w);
        a.trellis = ptr<const int16_t>(trellis);
        a.offsets = ptr<const int64_t>(offsets);
        a.words = ptr<const int32_t>(words);
        a.suh13 = ptr<const void>(suh13);
        a.svh13 = ptr<const void>(svh13);
        a.suh2 = ptr<const void>(suh2);
        a.svh2 = ptr<const void>(svh2);
        a.ws_int = ptr<int32_t>(ws_int);
        a.ws_f32 = ptr<float>(ws_f32);
        a.act_counters = ptr<int32_t>(act_counters);
        a.out = ptr<void>(out);
        a.T = T;
        a.topk = topk;
        a.E = E;
        a.H = H;
        a.I = I;
        a.first_expert = first_expert;
        a.max_words = max_words;
        a.words13 = words13;
        a.words2 = words2;
        a.e_stride = e_stride;
        a.m_stride = m_stride;
        a.gate_up_min_blocks = gate_up_min_blocks;
        a.codebook = codebook;
        a.limit = limit;
        a.x_bf16 = x_bf16;
        a.mt = mt;
        a.splitk = splitk;
        a.short_groups = short_groups;
        a.max_items = max_items;
        a.down_min_blocks = down_min_blocks;
        a.fuse_convert = fuse_convert;
        a.small_route = small_route;
        a.bytesum = bytesum;
        a.early_down = early_down;
        a.pdl = pdl;
        a.trace = ptr<uint64_t>(trace);
        a.residency = ptr<int>(residency);
        a.smem_per_sm = smem_per_sm;
        a.fit_smem = fit_smem;
        a.prep_a = prep_a;
        twinspark::check_launch(twinspark::exl3_moe(a, twinspark::stream(stream)), "exl3_moe");
      },
      py::arg("x"), py::arg("ids"), py::arg("topk_w"), py::arg("trellis"), py::arg("offsets"), py::arg("words"),
      py::arg("suh13"), py::arg("svh13"), py::arg("suh2"), py::arg("svh2"), py::arg("ws_int"), py::arg("ws_f32"),
      py::arg("act_counters"), py::arg("out"), py::arg("T"), py::arg("topk"), py::arg("E"), py::arg("H"), py::arg("I"),
      py::arg("first_expert"), py::arg("max_words"), py::arg("words13"), py::arg("words2"), py::arg("codebook"),
      py::arg("limit"), py::arg("x_bf16"), py::arg("mt"), py::arg("splitk"), py::arg("short_groups"),
      py::arg("max_items"), py::arg("down_min_blocks"), py::arg("fuse_convert"), py::arg("small_route"),
      py::arg("bytesum"), py::arg("early_down"), py::arg("pdl"), py::arg("stream"), py::arg("trace") = 0,
      py::arg("residency") = 0, py::arg("smem_per_sm") = 0, py::arg("fit_smem") = true, py::arg("e_stride") = 0,
      py::arg("m_stride") = 0, py::arg("gate_up_min_blocks") = 3, py::arg("prep_a") = false);
  m.def("exl3_moe_four_per_sm", &twinspark::exl3_moe_four_per_sm, py::arg("down"), py::arg("words"),
        py::arg("max_words"), py::arg("smem_per_sm"), py::arg("fit_smem"),
        "(blocks per SM, k-blocks of its A region) of the 4-per-SM mul1 decode kernel (gate/up or down) of that rate "
        "on the current device ((-1, -1): no such kernel)");
  m.def("exl3_moe_a_bytes", &twinspark::exl3_moe_a_bytes, py::arg("down"), py::arg("max_words"),
        py::arg("static_bytes"), py::arg("reserved"), py::arg("per_sm"), py::arg("blocks"),
        "bytes of the A region a 16-row exl3_moe kernel launches with where `blocks` of it must fit per SM (-1: "
        "arguments out of range)");
}
#endif
