// read_queue: many file reads in flight from one thread, through Linux asynchronous I/O (torch- and CUDA-free).
//
// Two engines behind one small interface, both driven by raw syscalls (no liburing/libaio dependency):
//   io_uring  io_uring_setup/io_uring_enter and the mmap'd submission/completion rings (Linux >= 5.6 for
//             IORING_OP_READ);
//   aio       io_setup/io_submit/io_getevents (Linux AIO; truly asynchronous only with O_DIRECT).
// A queue is used by one thread at a time. submit() stages reads (at most capacity() outstanding); reap() hands
// the staged reads to the kernel and waits for at least `min` completions. Containers often forbid these
// syscalls (ENOSYS/EPERM from seccomp, io_uring_disabled): make_read_queue() then returns nullptr and says why,
// and the caller keeps its blocking pread path.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace twinspark {
namespace engram {

struct ReadOp {
  int fd;
  void* buf;
  uint32_t len;
  int64_t off;
  uint64_t tag;  // returned with the completion
};

struct ReadDone {
  uint64_t tag;
  int64_t result;  // bytes read (may be short at end of file) or -errno
};

class ReadQueue {
 public:
  virtual ~ReadQueue() = default;
  virtual const char* name() const = 0;
  int capacity() const { return capacity_; }
  int outstanding() const { return outstanding_; }
  // Stages n reads; the caller keeps outstanding() + n <= capacity(). Returns false (with `error`) on failure.
  virtual bool submit(const ReadOp* ops, int n, std::string& error) = 0;
  // Submits what is staged and waits for >= min completions (min <= outstanding()); writes up to max into out.
  // Returns the count, or -1 with `error` when the queue itself failed (its reads are then in an unknown state).
  virtual int reap(ReadDone* out, int max, int min, std::string& error) = 0;

 protected:
  explicit ReadQueue(int capacity) : capacity_(capacity) {}
  int capacity_;
  int outstanding_ = 0;
};

// pread until `len` bytes or end of file (retrying EINTR); returns the bytes read or -errno.
int64_t pread_full(int fd, void* buf, size_t len, int64_t off);

// engine: "io_uring" or "aio". Returns nullptr and sets `why` (one sentence) when the engine is unavailable.
std::unique_ptr<ReadQueue> make_read_queue(const std::string& engine, int capacity, std::string& why);

// Creates a queue of `engine` and reads `len` bytes at offset 0 of fd into the aligned buf through it, checking
// the bytes against a blocking pread: true when the engine really works for this file.
bool probe_read_queue(const std::string& engine, int fd, void* buf, void* check, uint32_t len, std::string& why);

}  // namespace engram
}  // namespace twinspark
