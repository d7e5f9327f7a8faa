// Shape of the per-block timeline buffer (common/trace.cuh), for host code and the bindings.
#pragma once

namespace twinspark {

constexpr int kTraceBlocks = 65536;  // blocks per kernel recorded (later ones are not)
constexpr int kTraceSlots = 8;       // slot 0: SM id + 1 (0: the block never ran); 1..7: marks in ns
#ifdef TWINSPARK_TRACE
constexpr bool kTraceBuilt = true;
#else
constexpr bool kTraceBuilt = false;  // build with TWINSPARK_TRACE=1 to compile the marks in
#endif

}  // namespace twinspark
