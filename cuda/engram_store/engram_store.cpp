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

constexpr size_t kIoBufBytes = 2 * kDirectAlign;  // a record <= 264 bytes spans at most two aligned blocks

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// pread until `len` bytes or EOF; returns bytes read or -errno.
int64_t pread_full(int fd, void* buf, size_t len, int64_t off) {
  size_t got = 0;
  while (got < len) {
    ssize_t r = ::pread(fd, static_cast<uint8_t*>(buf) + got, len - got, off + static_cast<int64_t>(got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<int64_t>(got);
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
  if (sets_ == 0) throw std::invalid_argument("engram cache: size below one set (" + std::to_string(per_set) + " bytes)");
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
             const std::string& io_mode)
    : first_row_(first_row), end_row_(end_row) {
  if (first_row < 0 || end_row <= first_row)
    throw std::invalid_argument("engram store: expected 0 <= first_row < end_row, got [" + std::to_string(first_row) +
                                ", " + std::to_string(end_row) + ")");
  if (threads < 1 || threads > 1024)
    throw std::invalid_argument("engram store: expected 1..1024 threads, got " + std::to_string(threads));
  if (io_mode != "auto" && io_mode != "direct" && io_mode != "buffered")
    throw std::invalid_argument("engram store: io_mode must be auto, direct or buffered, got '" + io_mode + "'");
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
  for (int i = 0; i < threads; ++i) {
    void* p = nullptr;
    if (posix_memalign(&p, kDirectAlign, kIoBufBytes) != 0) throw std::bad_alloc();
    iobufs_.push_back(static_cast<uint8_t*>(p));
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
  for (auto* p : iobufs_) std::free(p);
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
                               ", " + std::to_string(end_row_) + ") (needs " + std::to_string(need) +
                               " bytes, has " + std::to_string(files_[idx].size) +
                               "); the file is truncated or belongs to another layout");
    }
    sources_.push_back(Source{idx, e});
  }
}

void Store::drop_page_cache() {
  for (auto& f : files_) ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
}

uint64_t Store::host_bytes() const { return cache_bytes() + iobufs_.size() * kIoBufBytes; }

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

void Store::worker(int index) {
  uint8_t* iobuf = iobufs_[index];
  for (;;) {
    std::shared_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lk(qm_);
      qcv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      b = queue_.front();
    }
    // Claim chunks of this batch with one atomic add each, without taking the queue lock again per chunk.
    for (;;) {
      const int64_t begin = b->next.fetch_add(b->chunk);
      if (begin >= b->n) break;
      const int64_t end = std::min(b->n, begin + b->chunk);
      run_rows(*b, begin, end, iobuf);
      if (b->finished.fetch_add(end - begin) + (end - begin) == b->n) {
        {
          std::lock_guard<std::mutex> lk(b->m);
          b->done = true;
        }
        b->cv.notify_all();
      }
    }
    std::lock_guard<std::mutex> lk(qm_);
    if (!queue_.empty() && queue_.front() == b) queue_.pop_front();
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
    std::memcpy(b.weight + i * kWeightBytes, record, kWeightBytes);
    std::memcpy(b.scale + i * kScaleBytes, record + kWeightBytes, kScaleBytes);
  }
  if (!error.empty()) {
    std::lock_guard<std::mutex> lk(b.m);
    if (b.error.empty()) b.error = error;
  }
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
        if (error.empty())
          error = f.path + ": cannot read row " + std::to_string(id) + " at byte " + std::to_string(off) +
                  (got < 0 ? " (" + errno_text(static_cast<int>(-got)) + ")" : " (file ends early)");
        return false;
      }
      std::memcpy(record + s.e.record_off, iobuf + head, s.e.length);
    } else {
      const int64_t got = pread_full(f.fd, record + s.e.record_off, s.e.length, off);
      if (got < static_cast<int64_t>(s.e.length)) {
        if (error.empty())
          error = f.path + ": cannot read row " + std::to_string(id) + " at byte " + std::to_string(off) +
                  (got < 0 ? " (" + errno_text(static_cast<int>(-got)) + ")" : " (file ends early)");
        return false;
      }
    }
  }
  return true;
}

}  // namespace engram
}  // namespace twinspark
