// engram_store: see engram_store.h. Plain C++17 + POSIX; builds with and without CUDA.
#include "engram_store/engram_store.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace twinspark {
namespace engram {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

uint8_t* aligned_alloc_or_throw(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kDirectAlign, bytes) != 0) throw std::bad_alloc();
  return static_cast<uint8_t*>(p);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------- Batch
void Batch::wait() {
  std::unique_lock<std::mutex> lk(m);
  cv.wait(lk, [&] { return done; });
}

bool Batch::ready() {
  std::lock_guard<std::mutex> lk(m);
  return done;
}

// ------------------------------------------------------------------------------------------------- RowCache
RowCache::RowCache(uint64_t bytes) {
  const uint64_t per_set = static_cast<uint64_t>(kWays) * (kRecordBytes + sizeof(int64_t) + sizeof(uint32_t));
  sets_ = bytes / per_set;
  if (sets_ == 0)
    throw std::invalid_argument("engram cache: size below one set (" + std::to_string(per_set) + " bytes)");
  const uint64_t slots = sets_ * kWays;
  bytes_ = sets_ * per_set;
  tags_.reset(new int64_t[slots]);
  std::fill(tags_.get(), tags_.get() + slots, int64_t(-1));
  stamps_.reset(new uint32_t[slots]());
  data_.reset(new uint8_t[slots * kRecordBytes]);  // left uninitialised: pages are committed as rows arrive
  locks_.reset(new std::mutex[kStripes]);
}

uint64_t RowCache::set_of(int64_t id) const {
  // Fibonacci hashing spreads the consecutive ids of a hash head over all sets.
  const uint64_t h = static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull;
  return (h ^ (h >> 29)) % sets_;
}

bool RowCache::get(int64_t id, uint8_t* record) {
  const uint64_t s = set_of(id);
  std::lock_guard<std::mutex> lk(locks_[s % kStripes]);
  const uint64_t base = s * kWays;
  for (int w = 0; w < kWays; ++w) {
    if (tags_[base + w] == id) {
      std::memcpy(record, data_.get() + (base + w) * kRecordBytes, kRecordBytes);
      stamps_[base + w] = clock_.fetch_add(1, std::memory_order_relaxed) + 1;
      return true;
    }
  }
  return false;
}

void RowCache::put(int64_t id, const uint8_t* record) {
  const uint64_t s = set_of(id);
  std::lock_guard<std::mutex> lk(locks_[s % kStripes]);
  const uint64_t base = s * kWays;
  int victim = 0;
  uint32_t oldest = UINT32_MAX;
  for (int w = 0; w < kWays; ++w) {
    if (tags_[base + w] == id) return;  // another thread brought it in meanwhile
    if (tags_[base + w] < 0) {
      victim = w;
      oldest = 0;
      break;
    }
    if (stamps_[base + w] < oldest) {
      oldest = stamps_[base + w];
      victim = w;
    }
  }
  std::memcpy(data_.get() + (base + victim) * kRecordBytes, record, kRecordBytes);
  tags_[base + victim] = id;
  stamps_[base + victim] = clock_.fetch_add(1, std::memory_order_relaxed) + 1;
}

// ---------------------------------------------------------------------------------------------------- Store
Store::Store(std::vector<Extent> extents, int64_t first_row, int64_t end_row, int threads, uint64_t cache_bytes,
             const std::string& io_mode, int queue_depth, const std::string& io_engine)
    : first_row_(first_row), end_row_(end_row) {
  if (first_row < 0 || end_row <= first_row)
    throw std::invalid_argument("engram store: expected 0 <= first_row < end_row, got [" + std::to_string(first_row) +
                                ", " + std::to_string(end_row) + ")");
  if (threads < 1 || threads > 1024)
    throw std::invalid_argument("engram store: expected 1..1024 threads, got " + std::to_string(threads));
  if (io_mode != "auto" && io_mode != "direct" && io_mode != "buffered")
    throw std::invalid_argument("engram store: io_mode must be auto, direct or buffered, got '" + io_mode + "'");
  if (io_engine != "auto" && io_engine != "io_uring" && io_engine != "aio" && io_engine != "pread")
    throw std::invalid_argument("engram store: io_engine must be auto, io_uring, aio or pread, got '" + io_engine +
                                "'");
  if (queue_depth < 1 || queue_depth > 1024)
    throw std::invalid_argument("engram store: expected a queue_depth of 1..1024, got " + std::to_string(queue_depth));
  if (extents.empty()) throw std::invalid_argument("engram store: no extents");
  uint32_t covered = 0;
  for (const auto& e : extents) {
    if (e.length == 0 || e.record_off + e.length > kRecordBytes || e.stride < e.length)
      throw std::invalid_argument("engram store: bad extent for " + e.path);
    covered += e.length;
  }
  if (covered != kRecordBytes)
    throw std::invalid_argument("engram store: extents cover " + std::to_string(covered) + " of " +
                                std::to_string(kRecordBytes) + " record bytes");
  open_files(extents, io_mode);
  if (cache_bytes > 0) cache_ = std::make_unique<RowCache>(cache_bytes);
  try {
    select_io(io_engine, queue_depth, threads);
  } catch (...) {
    for (auto& io : io_) {
      std::free(io.buf);
      std::free(io.ring);
    }
    for (auto& f : files_) ::close(f.fd);
    throw;
  }
  for (int i = 0; i < threads; ++i) workers_.emplace_back(&Store::worker, this, i);
}

Store::~Store() {
  {
    std::lock_guard<std::mutex> lk(qm_);
    stop_ = true;
  }
  qcv_.notify_all();
  for (auto& t : workers_) t.join();  // workers drain the queue first: no batch is left half written
  for (auto& io : io_) {
    io.queue.reset();
    std::free(io.buf);
    if (!io.keep_ring) std::free(io.ring);
  }
  for (auto& f : files_) ::close(f.fd);
}

void Store::open_files(const std::vector<Extent>& extents, const std::string& io_mode) {
  bool want_direct = io_mode != "buffered";
  // Probe O_DIRECT on every file: open may fail (EINVAL on tmpfs) or succeed while aligned reads fail.
  std::vector<std::string> paths;
  for (const auto& e : extents)
    if (std::find(paths.begin(), paths.end(), e.path) == paths.end()) paths.push_back(e.path);
  void* probe = nullptr;
  if (posix_memalign(&probe, kDirectAlign, kDirectAlign) != 0) throw std::bad_alloc();
  std::unique_ptr<void, decltype(&std::free)> probe_guard(probe, &std::free);
  bool direct_ok = want_direct;
  for (const auto& p : paths) {
    if (!direct_ok) break;
    int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT || errno == EACCES) break;  // reported below by the buffered open
      direct_ok = false;
      break;
    }
    if (::pread(fd, probe, kDirectAlign, 0) < 0) direct_ok = false;
    ::close(fd);
  }
  if (io_mode == "direct" && !direct_ok)
    throw std::runtime_error("engram store: O_DIRECT reads do not work on " + paths.front() +
                             " (tmpfs/NFS?); use io_mode='auto' or 'buffered'");
  direct_ = direct_ok;
  for (const auto& p : paths) {
    File f;
    f.path = p;
    f.fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
    if (f.fd < 0) {
      const int err = errno;
      for (auto& g : files_) ::close(g.fd);
      files_.clear();
      throw std::runtime_error("engram store: cannot open " + p + ": " + errno_text(err));
    }
    struct stat st;
    ::fstat(f.fd, &st);
    f.size = static_cast<int64_t>(st.st_size);
    files_.push_back(f);
  }
  for (const auto& e : extents) {
    const int idx = static_cast<int>(std::find(paths.begin(), paths.end(), e.path) - paths.begin());
    const int64_t need = e.base + end_row_ * static_cast<int64_t>(e.stride);
    const int64_t start = e.base + first_row_ * static_cast<int64_t>(e.stride);
    if (start < 0 || need > files_[idx].size) {
      for (auto& g : files_) ::close(g.fd);
      files_.clear();
      throw std::runtime_error("engram store: " + e.path + " is too short for rows [" + std::to_string(first_row_) +
                               ", " + std::to_string(end_row_) + ") (needs " + std::to_string(need) + " bytes, has " +
                               std::to_string(files_[idx].size) +
                               "); the file is truncated or belongs to another layout");
    }
    sources_.push_back(Source{idx, e});
  }
}

void Store::drop_page_cache() {
  for (auto& f : files_) ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
}

uint64_t Store::host_bytes() const {
  uint64_t bytes = cache_bytes();
  for (const auto& io : io_) bytes += io.bytes;
  return bytes;
}

std::string Store::io_note() const {
  std::lock_guard<std::mutex> lk(note_m_);
  return io_note_;
}

// Picks the read path: an asynchronous engine only with O_DIRECT (buffered reads would block in the kernel or
// run on its worker threads), and only after a real read through it returned the bytes pread returns.
void Store::select_io(const std::string& io_engine, int queue_depth, int threads) {
  const bool explicit_engine = io_engine == "io_uring" || io_engine == "aio";
  std::vector<std::string> engines;
  if (io_engine == "auto") engines = {"io_uring", "aio"};
  if (explicit_engine) engines = {io_engine};
  if (!direct_ && !engines.empty()) {
    if (explicit_engine)
      throw std::runtime_error("engram store: io_engine='" + io_engine + "' needs O_DIRECT reads but " +
                               files_.front().path + " is read buffered; use io_engine='auto' or 'pread'");
    io_note_ = "buffered reads use blocking pread";
    engines.clear();
  }
  if (io_engine == "pread") io_note_ = "pread chosen by io_engine";
  const int sources = static_cast<int>(sources_.size());
  for (const auto& engine : engines) {
    std::unique_ptr<uint8_t, decltype(&std::free)> a(aligned_alloc_or_throw(kDirectAlign), &std::free);
    std::unique_ptr<uint8_t, decltype(&std::free)> b(aligned_alloc_or_throw(kDirectAlign), &std::free);
    std::string why;
    std::vector<std::unique_ptr<ReadQueue>> queues;
    if (probe_read_queue(engine, files_.front().fd, a.get(), b.get(), kDirectAlign, why)) {
      for (int i = 0; i < threads; ++i) {
        auto q = make_read_queue(engine, queue_depth * sources, why);
        if (!q) break;
        queues.push_back(std::move(q));
      }
    }
    if (static_cast<int>(queues.size()) == threads) {
      io_path_ = engine;
      queue_depth_ = queue_depth;
      for (int i = 0; i < threads; ++i) {
        WorkerIo io;
        io.queue = std::move(queues[i]);
        io_.push_back(std::move(io));
      }
      break;
    }
    if (explicit_engine)
      throw std::runtime_error("engram store: io_engine='" + engine + "' is unavailable here: " + why +
                               "; use io_engine='auto' or 'pread'");
    io_note_ += (io_note_.empty() ? "" : "; ") + why;
  }
  if (io_.empty()) io_.resize(threads);  // pread path
  const size_t ring_bytes = io_path_ == "pread" ? 0 : static_cast<size_t>(queue_depth_) * sources * kIoBufBytes;
  for (auto& io : io_) {
    io.buf = aligned_alloc_or_throw(kIoBufBytes);
    if (ring_bytes) io.ring = aligned_alloc_or_throw(ring_bytes);
    io.bytes = kIoBufBytes + ring_bytes;
  }
}

std::shared_ptr<Batch> Store::submit(const int64_t* ids64, const int32_t* ids32, int64_t n, uint8_t* weight,
                                     uint8_t* scale) {
  auto b = std::make_shared<Batch>();
  b->ids64 = ids64;
  b->ids32 = ids32;
  b->n = n;
  b->weight = weight;
  b->scale = scale;
  // Enough chunks for every worker to take several (load balance), few enough to keep the queue cheap.
  const int64_t per = (n + static_cast<int64_t>(workers_.size()) * 4 - 1) / (static_cast<int64_t>(workers_.size()) * 4);
  b->chunk = std::max<int64_t>(1, std::min<int64_t>(per, 64));
  if (n == 0) {
    b->done = true;
    return b;
  }
  {
    std::lock_guard<std::mutex> lk(qm_);
    queue_.push_back(b);
  }
  qcv_.notify_all();
  return b;
}

std::shared_ptr<Batch> Store::next_batch(bool block) {
  std::unique_lock<std::mutex> lk(qm_);
  if (block) qcv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
  return queue_.empty() ? nullptr : queue_.front();  // null when blocking: stop_ and drained
}

void Store::retire(const std::shared_ptr<Batch>& b) {
  std::lock_guard<std::mutex> lk(qm_);
  if (!queue_.empty() && queue_.front() == b) queue_.pop_front();
}

void Store::rows_finished(Batch& b, int64_t k) {
  if (k == 0 || b.finished.fetch_add(k) + k != b.n) return;
  {
    std::lock_guard<std::mutex> lk(b.m);
    b.done = true;
  }
  b.cv.notify_all();
}

void Store::fail_row(Batch& b, const std::string& error) {
  std::lock_guard<std::mutex> lk(b.m);
  if (b.error.empty()) b.error = error;
}

// Blocking path: one pread per extent of a row at a time.
void Store::worker(int index) {
  if (io_[index].queue) return async_worker(index);
  uint8_t* iobuf = io_[index].buf;
  for (;;) {
    std::shared_ptr<Batch> b = next_batch(true);
    if (!b) return;
    // Claim chunks of this batch with one atomic add each, without taking the queue lock again per chunk.
    for (;;) {
      const int64_t begin = b->next.fetch_add(b->chunk);
      if (begin >= b->n) break;
      const int64_t end = std::min(b->n, begin + b->chunk);
      run_rows(*b, begin, end, iobuf);
      rows_finished(*b, end - begin);
    }
    retire(b);
  }
}

void Store::run_rows(Batch& b, int64_t begin, int64_t end, uint8_t* iobuf) {
  alignas(16) uint8_t record[kRecordBytes];
  std::string error;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t id = b.id(i);
    bool ok = false;
    if (id >= first_row_ && id < end_row_) {
      if (cache_ && cache_->get(id, record)) {
        hits_.fetch_add(1, std::memory_order_relaxed);
        ok = true;
      } else {
        if (cache_) misses_.fetch_add(1, std::memory_order_relaxed);
        ok = read_record(id, record, iobuf, error);
        if (ok && cache_) cache_->put(id, record);
      }
    }
    if (!ok) std::memset(record, 0, kRecordBytes);  // foreign id, -1, or a failed read (reported below)
    b.write_row(i, record);
  }
  if (!error.empty()) fail_row(b, error);
}

std::string Store::read_error(const File& f, int64_t id, int64_t off, int64_t got) const {
  return f.path + ": cannot read row " + std::to_string(id) + " at byte " + std::to_string(off) +
         (got < 0 ? " (" + errno_text(static_cast<int>(-got)) + ")" : " (file ends early)");
}

bool Store::read_record(int64_t id, uint8_t* record, uint8_t* iobuf, std::string& error) {
  for (const auto& s : sources_) {
    const File& f = files_[s.file];
    const int64_t off = s.e.base + id * static_cast<int64_t>(s.e.stride);
    reads_.fetch_add(1, std::memory_order_relaxed);
    if (direct_) {
      const int64_t aoff = off & ~static_cast<int64_t>(kDirectAlign - 1);
      const int64_t head = off - aoff;
      const size_t alen = static_cast<size_t>((head + s.e.length + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
      const int64_t got = pread_full(f.fd, iobuf, alen, aoff);
      if (got < head + static_cast<int64_t>(s.e.length)) {
        if (error.empty()) error = read_error(f, id, off, got);
        return false;
      }
      std::memcpy(record + s.e.record_off, iobuf + head, s.e.length);
    } else {
      const int64_t got = pread_full(f.fd, record + s.e.record_off, s.e.length, off);
      if (got < static_cast<int64_t>(s.e.length)) {
        if (error.empty()) error = read_error(f, id, off, got);
        return false;
      }
    }
  }
  return true;
}

}  // namespace engram
}  // namespace twinspark
