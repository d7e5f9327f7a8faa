// engram staging slot: pinned host buffers (cudaHostAlloc) and the CUDA-graph-capturable lookup.
//
// enqueue() puts three steps on a stream: copy the ids device->pinned, a host function (cudaLaunchHostFunc) that
// fetches the rows through the Store's thread pool into pinned staging, and copies of the staging to the
// caller's device buffers. All three are legal inside stream capture, so a captured graph re-fetches the rows
// for whatever ids sit in the device buffer at replay. One slot per stream (a slot's staging is reused by every
// call on it); the slot must outlive every graph that captured it. A read error cannot be raised from inside a
// host function: the rows come back zero and take_error() returns the message afterwards.
#pragma once
#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engram_store/engram_store.h"

namespace twinspark {
namespace engram {

class Slot {
 public:
  Slot(std::shared_ptr<Store> store, int64_t capacity);
  ~Slot();
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

  // ids: int64 (or int32) [n] on the device; weight_dev [n, 256] and scale_dev [n, 8] on the device.
  cudaError_t enqueue(const void* ids_dev, bool ids_int32, int64_t n, void* weight_dev, void* scale_dev,
                      cudaStream_t stream);
  std::string take_error();
  int64_t capacity() const { return capacity_; }
  uint64_t pinned_bytes() const;
  uint8_t* weight_host() const { return weight_; }
  uint8_t* scale_host() const { return scale_; }

 private:
  struct Call {
    Slot* slot;
    int64_t n;
    bool ids_int32;
  };
  static void CUDART_CB host_fetch(void* call);

  std::shared_ptr<Store> store_;
  int64_t capacity_;
  void* ids_ = nullptr;  // pinned, 8 bytes per id
  uint8_t* weight_ = nullptr;
  uint8_t* scale_ = nullptr;
  std::mutex m_;
  std::map<std::pair<int64_t, bool>, std::unique_ptr<Call>> calls_;  // stable host-function arguments
  std::string error_;
};

}  // namespace engram
}  // namespace twinspark
#endif
