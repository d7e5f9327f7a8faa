// read_queue engine "aio": Linux AIO through raw io_setup/io_submit/io_getevents/io_destroy syscalls.
// See read_queue.h. Only O_DIRECT reads are asynchronous with this interface; buffered ones block in io_submit.
#include <errno.h>
#include <linux/aio_abi.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "engram_store/read_queue.h"

namespace twinspark {
namespace engram {

std::unique_ptr<ReadQueue> make_aio_queue(int capacity, std::string& why);

namespace {

class AioQueue final : public ReadQueue {
 public:
  explicit AioQueue(int capacity) : ReadQueue(capacity) {
    staged_.reserve(capacity);
    ptrs_.reserve(capacity);
    events_.resize(capacity);
  }
  ~AioQueue() override {
    if (ctx_ != 0) ::syscall(__NR_io_destroy, ctx_);  // waits for reads still in flight
  }

  bool init(std::string& why) {
    if (::syscall(__NR_io_setup, static_cast<unsigned>(capacity_), &ctx_) < 0) {
      const int err = errno;
      ctx_ = 0;
      const char* hint = err == EAGAIN                   ? ": fs.aio-max-nr is exhausted"
                         : err == EPERM || err == ENOSYS ? ": Linux AIO is filtered here (seccomp)"
                                                         : "";
      why = std::string("io_setup failed (") + std::strerror(err) + ")" + hint;
      return false;
    }
    return true;
  }

  const char* name() const override { return "aio"; }

  bool submit(const ReadOp* ops, int n, std::string& error) override {
    if (outstanding_ + n > capacity_) {
      error = "aio: queue full";
      return false;
    }
    for (int i = 0; i < n; ++i) {
      iocb cb;
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = ops[i].tag;
      cb.aio_lio_opcode = IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<uint32_t>(ops[i].fd);
      cb.aio_buf = reinterpret_cast<uint64_t>(ops[i].buf);
      cb.aio_nbytes = ops[i].len;
      cb.aio_offset = ops[i].off;
      staged_.push_back(cb);
    }
    outstanding_ += n;
    return true;
  }

  int reap(ReadDone* out, int max, int min, std::string& error) override {
    if (!flush(error)) return -1;
    int got = 0;
    const int in_kernel = outstanding_ - static_cast<int>(staged_.size());
    const int want = std::min(min, in_kernel);
    const int cap = std::min(max, in_kernel);
    while (cap > 0) {
      const long r = ::syscall(__NR_io_getevents, ctx_, static_cast<long>(want - got > 0 ? want - got : 0),
                               static_cast<long>(cap - got), events_.data(), nullptr);
      if (r < 0) {
        if (errno == EINTR) continue;
        error = std::string("io_getevents failed (") + std::strerror(errno) + ")";
        return -1;
      }
      for (long i = 0; i < r; ++i) out[got++] = ReadDone{events_[i].data, static_cast<int64_t>(events_[i].res)};
      outstanding_ -= static_cast<int>(r);
      if (got >= want || got >= cap) break;
    }
    return got;
  }

 private:
  // Hands the staged control blocks to the kernel (io_submit may take only some; the rest wait for the next call).
  bool flush(std::string& error) {
    while (!staged_.empty()) {
      ptrs_.clear();
      for (auto& cb : staged_) ptrs_.push_back(&cb);
      const long r = ::syscall(__NR_io_submit, ctx_, static_cast<long>(ptrs_.size()), ptrs_.data());
      if (r < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN && outstanding_ > static_cast<int>(staged_.size())) return true;  // retry after reaping
        if (err == EAGAIN) {
          ::sched_yield();
          continue;
        }
        error = std::string("io_submit failed (") + std::strerror(err) + ")";
        return false;
      }
      staged_.erase(staged_.begin(), staged_.begin() + r);  // the kernel copied what it took
      if (r == 0) return true;
    }
    return true;
  }

  aio_context_t ctx_ = 0;
  std::vector<iocb> staged_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<ReadQueue> make_aio_queue(int capacity, std::string& why) {
  auto q = std::make_unique<AioQueue>(capacity);
  if (!q->init(why)) return nullptr;
  return q;
}

}  // namespace engram
}  // namespace twinspark
