// One-shot all-reduce, host side of the device code (torch-free: pointers, sizes and a stream in,
// cudaError_t out).
//
// Every rank publishes its input, raises flags carrying an epoch, waits for every peer's flag, then reads all
// ranks' inputs and sums them in fp32 in rank order 0..world-1, so every rank computes the same bits.
//
// Two flag modes share the kernel:
//   kPeerFlags  (CUDA IPC, or virtual ranks in one process): block b publishes its slice into this rank's
//               device buffer and stores the epoch into flag[b][rank] of every peer's buffer; it waits on
//               flag[b][r] of its own buffer. No grid-wide barrier.
//   kHostProxy  (host-memory path across nodes): every block writes its slice into the mapped pinned send
//               buffer; the last block to finish writes {epoch, nbytes} into the send header, which the proxy
//               thread polls and forwards (RDMA write, TCP or loopback copy). The proxy raises this rank's
//               recv flag for a peer once that peer's data sits in the pinned recv buffer.
//
// Epochs live in device memory (counters[0]), so a captured CUDA graph replays with fresh epochs; slots
// alternate by epoch parity (2 slots suffice: a rank can only start call e+2 after every peer started e+1,
// i.e. finished reading call e). Spins are bounded by timeout_ns (globaltimer); on expiry the kernel writes
// Status (mapped pinned memory) and returns without touching `out`; the host turns that into an error.
//
// Limits: world <= kMaxRanks; n * elem_size <= capacity; in/out/buffers 16-byte aligned; in may equal out.
#pragma once
#include <cstddef>
#include <cstdint>

namespace twinspark::allreduce {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
// Device buffer layout for kPeerFlags: [flags kMaxBlocks x kMaxRanks u32][counters][pad] then 2 data slots.
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kFlagsBytes = sizeof(uint32_t) * kMaxBlocks * kMaxRanks;
constexpr size_t kCountersOffset = kFlagsBytes;  // 3 x u32, local to the rank (peers never touch them)

enum Mode : int { kPeerFlags = 0, kHostProxy = 1 };
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum StatusCode : uint32_t { kOk = 0, kTimeout = 1, kPeerFailed = 2 };

// Lives in mapped pinned host memory: the kernel writes it on failure, the host reads it without a sync.
struct Status {
  uint32_t code;   // StatusCode
  uint32_t peer;   // the rank that never arrived
  uint32_t epoch;  // the call (1-based count) that failed
  uint32_t block;
};

struct Plan {
  int rank = 0;
  int world = 1;
  int mode = kPeerFlags;
  int max_blocks = 24;
  uint64_t timeout_ns = 0;
  Status* status = nullptr;              // mapped pinned
  uint32_t* counters = nullptr;          // device: [0] last epoch, [1] blocks done, [2] blocks published
  void* publish[2] = {};                 // where this rank's input is written, per slot
  const void* src[kMaxRanks][2] = {};    // where rank r's input is read, per slot (r == rank reads `in`)
  uint32_t* post[kMaxRanks] = {};        // kPeerFlags: &peer_r.flags[0][rank]; kHostProxy: post[s] = header of slot s
  const uint32_t* wait[kMaxRanks] = {};  // kPeerFlags: &own.flags[0][r]; kHostProxy: recv flag of r
  size_t capacity = 0;                   // bytes per slot
};

// Blocks the kernel uses for n elements of elem_size bytes (both sides of a call must agree: it is a pure
// function of the size and plan.max_blocks).
inline int grid_for(const Plan& plan, int64_t n, int elem_size) {
  const int64_t nvec = (n * elem_size) / 16;
  int64_t g = (nvec + kThreads - 1) / kThreads;  // one 16-byte vector per thread, then cap
  const int cap = plan.max_blocks < 1 ? 1 : (plan.max_blocks > kMaxBlocks ? kMaxBlocks : plan.max_blocks);
  if (g < 1) g = 1;
  return static_cast<int>(g > cap ? cap : g);
}

}  // namespace twinspark::allreduce

#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>
namespace twinspark::allreduce {
cudaError_t oneshot(const Plan& plan, const void* in, void* out, int64_t n, DType dtype, cudaStream_t stream);
}  // namespace twinspark::allreduce
#endif
