// engram staging slot: see staging.h.
#ifdef TWINSPARK_WITH_CUDA
#include "engram_store/staging.h"

#include <stdexcept>

namespace twinspark {
namespace engram {

Slot::Slot(std::shared_ptr<Store> store, int64_t capacity) : store_(std::move(store)), capacity_(capacity) {
  if (capacity < 1) throw std::invalid_argument("engram slot: capacity must be >= 1, got " + std::to_string(capacity));
  const unsigned flags = cudaHostAllocPortable;
  cudaError_t e1 = cudaHostAlloc(&ids_, capacity * sizeof(int64_t), flags);
  cudaError_t e2 = cudaHostAlloc(reinterpret_cast<void**>(&weight_), capacity * kWeightBytes, flags);
  cudaError_t e3 = cudaHostAlloc(reinterpret_cast<void**>(&scale_), capacity * kScaleBytes, flags);
  if (e1 != cudaSuccess || e2 != cudaSuccess || e3 != cudaSuccess) {
    cudaError_t e = e1 != cudaSuccess ? e1 : (e2 != cudaSuccess ? e2 : e3);
    if (ids_) cudaFreeHost(ids_);
    if (weight_) cudaFreeHost(weight_);
    if (scale_) cudaFreeHost(scale_);
    throw std::runtime_error(std::string("engram slot: cudaHostAlloc of ") + std::to_string(pinned_bytes()) +
                             " pinned bytes failed: " + cudaGetErrorString(e));
  }
}

Slot::~Slot() {
  cudaFreeHost(ids_);
  cudaFreeHost(weight_);
  cudaFreeHost(scale_);
}

uint64_t Slot::pinned_bytes() const {
  return static_cast<uint64_t>(capacity_) * (sizeof(int64_t) + kWeightBytes + kScaleBytes);
}

void CUDART_CB Slot::host_fetch(void* p) {
  // Runs on CUDA's host-callback thread: no CUDA calls allowed here, only the (CUDA-free) store.
  auto* call = static_cast<Call*>(p);
  Slot* s = call->slot;
  auto b = s->store_->submit(call->ids_int32 ? nullptr : static_cast<const int64_t*>(s->ids_),
                             call->ids_int32 ? static_cast<const int32_t*>(s->ids_) : nullptr, call->n, s->weight_,
                             s->scale_);
  b->wait();
  if (!b->error.empty()) {
    std::lock_guard<std::mutex> lk(s->m_);
    if (s->error_.empty()) s->error_ = b->error;
  }
}

cudaError_t Slot::enqueue(const void* ids_dev, bool ids_int32, int64_t n, void* weight_dev, void* scale_dev,
                          cudaStream_t stream) {
  if (n < 0 || n > capacity_) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  Call* call;
  {
    std::lock_guard<std::mutex> lk(m_);
    auto& c = calls_[{n, ids_int32}];
    if (!c) c.reset(new Call{this, n, ids_int32});
    call = c.get();
  }
  const size_t id_bytes = static_cast<size_t>(n) * (ids_int32 ? 4 : 8);
  cudaError_t err = cudaMemcpyAsync(ids_, ids_dev, id_bytes, cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  err = cudaLaunchHostFunc(stream, &Slot::host_fetch, call);
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(weight_dev, weight_, static_cast<size_t>(n) * kWeightBytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return err;
  return cudaMemcpyAsync(scale_dev, scale_, static_cast<size_t>(n) * kScaleBytes, cudaMemcpyHostToDevice, stream);
}

std::string Slot::take_error() {
  std::lock_guard<std::mutex> lk(m_);
  std::string e;
  e.swap(error_);
  return e;
}

}  // namespace engram
}  // namespace twinspark
#endif
