// read_queue engine "io_uring": raw io_uring_setup/io_uring_enter syscalls and the three mmap'd regions
// (submission ring, completion ring, submission entries). See read_queue.h.
#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engram_store/read_queue.h"

namespace twinspark {
namespace engram {

std::unique_ptr<ReadQueue> make_uring_queue(int capacity, std::string& why);

namespace {

template <typename T>
T* at(void* base, uint32_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

class UringQueue final : public ReadQueue {
 public:
  explicit UringQueue(int capacity) : ReadQueue(capacity) {}
  ~UringQueue() override {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_len_);
    if (cq_ptr_ != MAP_FAILED && cq_ptr_ != sq_ptr_) ::munmap(cq_ptr_, cq_len_);
    if (sq_ptr_ != MAP_FAILED) ::munmap(sq_ptr_, sq_len_);
    if (fd_ >= 0) ::close(fd_);
  }

  bool init(std::string& why) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    const long fd = ::syscall(__NR_io_uring_setup, static_cast<unsigned>(capacity_), &p);
    if (fd < 0) {
      const int err = errno;
      const char* hint =
          err == EPERM || err == ENOSYS ? ": io_uring is disabled here (kernel.io_uring_disabled, seccomp)" : "";
      why = std::string("io_uring_setup failed (") + std::strerror(err) + ")" + hint;
      return false;
    }
    fd_ = static_cast<int>(fd);
    sq_entries_ = p.sq_entries;
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ptr_ = ::mmap(nullptr, sq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) return fail_map("submission ring", why);
    cq_ptr_ =
        single ? sq_ptr_
               : ::mmap(nullptr, cq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_CQ_RING);
    if (cq_ptr_ == MAP_FAILED) return fail_map("completion ring", why);
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    void* s = ::mmap(nullptr, sqes_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
    if (s == MAP_FAILED) return fail_map("submission entries", why);
    sqes_ = static_cast<io_uring_sqe*>(s);
    sq_head_ = at<uint32_t>(sq_ptr_, p.sq_off.head);
    sq_tail_ = at<uint32_t>(sq_ptr_, p.sq_off.tail);
    sq_mask_ = *at<uint32_t>(sq_ptr_, p.sq_off.ring_mask);
    sq_array_ = at<uint32_t>(sq_ptr_, p.sq_off.array);
    cq_head_ = at<uint32_t>(cq_ptr_, p.cq_off.head);
    cq_tail_ = at<uint32_t>(cq_ptr_, p.cq_off.tail);
    cq_mask_ = *at<uint32_t>(cq_ptr_, p.cq_off.ring_mask);
    cqes_ = at<io_uring_cqe>(cq_ptr_, p.cq_off.cqes);
    return true;
  }

  const char* name() const override { return "io_uring"; }

  bool submit(const ReadOp* ops, int n, std::string& error) override {
    uint32_t tail = *sq_tail_;  // only this thread writes the tail
    const uint32_t head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    if (outstanding_ + n > capacity_ || tail - head + static_cast<uint32_t>(n) > sq_entries_) {
      error = "io_uring: submission queue full";
      return false;
    }
    for (int i = 0; i < n; ++i, ++tail) {
      const uint32_t idx = tail & sq_mask_;
      io_uring_sqe* sqe = &sqes_[idx];
      std::memset(sqe, 0, sizeof(*sqe));
      sqe->opcode = IORING_OP_READ;
      sqe->fd = ops[i].fd;
      sqe->addr = reinterpret_cast<uint64_t>(ops[i].buf);
      sqe->len = ops[i].len;
      sqe->off = static_cast<uint64_t>(ops[i].off);
      sqe->user_data = ops[i].tag;
      sq_array_[idx] = idx;
    }
    __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
    staged_ += static_cast<uint32_t>(n);
    outstanding_ += n;
    return true;
  }

  int reap(ReadDone* out, int max, int min, std::string& error) override {
    int got = 0;
    for (;;) {
      uint32_t head = *cq_head_;  // only this thread writes the head
      const uint32_t tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      while (head != tail && got < max) {
        const io_uring_cqe& c = cqes_[head & cq_mask_];
        out[got++] = ReadDone{c.user_data, static_cast<int64_t>(c.res)};
        ++head;
        --outstanding_;
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      if (staged_ == 0 && got >= std::min(min, max)) return got;
      const uint32_t want = got >= min ? 0 : static_cast<uint32_t>(min - got);
      const long r = ::syscall(__NR_io_uring_enter, fd_, staged_, want, want ? IORING_ENTER_GETEVENTS : 0u, nullptr, 0);
      if (r < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EBUSY) {  // kernel short of resources: let completions drain, then retry
          if (got > 0 && staged_ == 0) return got;
          ::sched_yield();
          continue;
        }
        error = std::string("io_uring_enter failed (") + std::strerror(err) + ")";
        return -1;
      }
      staged_ -= std::min<uint32_t>(staged_, static_cast<uint32_t>(r));
      if (r == 0 && want == 0 && staged_ > 0) ::sched_yield();
    }
  }

 private:
  bool fail_map(const char* what, std::string& why) {
    why = std::string("io_uring: cannot map the ") + what + " (" + std::strerror(errno) + ")";
    return false;
  }

  int fd_ = -1;
  void* sq_ptr_ = MAP_FAILED;
  void* cq_ptr_ = MAP_FAILED;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  uint32_t sq_entries_ = 0, sq_mask_ = 0, cq_mask_ = 0;
  uint32_t *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  uint32_t *cq_head_ = nullptr, *cq_tail_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
  uint32_t staged_ = 0;  // entries in the submission ring not yet handed to the kernel
};

}  // namespace

std::unique_ptr<ReadQueue> make_uring_queue(int capacity, std::string& why) {
  auto q = std::make_unique<UringQueue>(capacity);
  if (!q->init(why)) return nullptr;
  return q;
}

}  // namespace engram
}  // namespace twinspark
