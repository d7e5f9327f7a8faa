// Helpers for bind.cpp files: turn a cudaError_t into a Python RuntimeError naming the op.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>

namespace twinspark {

inline void check_launch(cudaError_t err, const char* op) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
  }
}

template <typename T>
inline T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

inline cudaStream_t stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace twinspark
#endif
