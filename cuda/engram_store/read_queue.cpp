// read_queue: engine selection and the probe read. See read_queue.h.
#include "engram_store/read_queue.h"

#include <errno.h>
#include <unistd.h>

#include <cstring>

namespace twinspark {
namespace engram {

std::unique_ptr<ReadQueue> make_uring_queue(int capacity, std::string& why);
std::unique_ptr<ReadQueue> make_aio_queue(int capacity, std::string& why);

int64_t pread_full(int fd, void* buf, size_t len, int64_t off) {
  size_t got = 0;
  while (got < len) {
    const ssize_t r = ::pread(fd, static_cast<uint8_t*>(buf) + got, len - got, off + static_cast<int64_t>(got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<int64_t>(got);
}

std::unique_ptr<ReadQueue> make_read_queue(const std::string& engine, int capacity, std::string& why) {
  if (capacity < 1) {
    why = "read queue: capacity must be >= 1";
    return nullptr;
  }
  if (engine == "io_uring") return make_uring_queue(capacity, why);
  if (engine == "aio") return make_aio_queue(capacity, why);
  why = "read queue: unknown engine '" + engine + "'";
  return nullptr;
}

bool probe_read_queue(const std::string& engine, int fd, void* buf, void* check, uint32_t len, std::string& why) {
  auto q = make_read_queue(engine, 1, why);
  if (!q) return false;
  const ReadOp op{fd, buf, len, 0, 42};
  ReadDone done{0, 0};
  std::string error;
  if (!q->submit(&op, 1, error) || q->reap(&done, 1, 1, error) != 1) {
    why = engine + ": probe read failed (" + error + ")";
    return false;
  }
  if (done.tag != 42 || done.result < 0) {
    why = engine + ": probe read failed (" +
          (done.result < 0 ? std::string(std::strerror(static_cast<int>(-done.result))) : "wrong tag") + ")";
    return false;
  }
  const ssize_t want = ::pread(fd, check, len, 0);
  if (want < 0 || done.result != want || std::memcmp(buf, check, static_cast<size_t>(want)) != 0) {
    why = engine + ": probe read returned other bytes than pread";
    return false;
  }
  return true;
}

}  // namespace engram
}  // namespace twinspark
