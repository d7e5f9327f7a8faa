// engram_store: Engram rows read from files on demand (torch-free C++; CUDA-only parts behind TWINSPARK_WITH_CUDA).
//
// A row is a 264-byte record: 256 fp8 e4m3 weight bytes then 8 E8M0 scale bytes. Where its bytes live is given by
// extents: the original shards need two (weight tensor: stride 256, scale tensor: stride 8, possibly in different
// files), a pack file one (stride 264). The store serves global row ids in [first_row, end_row) (this rank's whole
// hash heads); any other id, and the dead id -1, yields a zero row.
//
// Reads: O_DIRECT with 4096-byte aligned offsets/lengths/buffers where the filesystem allows (checked by a real
// read at open), buffered pread otherwise (tmpfs, some NFS mounts). A fixed thread pool serves batches; each
// worker claims chunks of a batch with one atomic add. With O_DIRECT each worker keeps up to queue_depth rows in
// flight through Linux asynchronous I/O (io_uring, else Linux AIO: read_queue.h), so T threads keep T x depth
// reads outstanding; where neither works (ENOSYS/EPERM in containers) or the files are read buffered, a worker
// does one blocking pread at a time (io_path() says which). An optional set-associative RAM cache (8 ways, LRU inside a
// set) holds hot rows. Errors (short file, EIO) never abort: the row is zeroed and the batch reports the first
// error as text, which Python raises as one sentence.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engram_store/read_queue.h"

namespace twinspark {
namespace engram {

constexpr uint32_t kWeightBytes = 256;
constexpr uint32_t kScaleBytes = 8;
constexpr uint32_t kRecordBytes = kWeightBytes + kScaleBytes;
constexpr uint32_t kDirectAlign = 4096;  // O_DIRECT offset/length/buffer alignment (safe for 512e and 4Kn disks)
constexpr size_t kIoBufBytes = 2 * kDirectAlign;  // a record <= 264 bytes spans at most two aligned blocks

struct Extent {
  std::string path;
  int64_t base = 0;         // file offset of global row 0 (negative for pack files, which start at first_row)
  uint32_t stride = 0;      // bytes between consecutive rows in the file
  uint32_t length = 0;      // bytes of the record this extent supplies (<= kRecordBytes)
  uint32_t record_off = 0;  // where they go in the record
};

// One lookup: ids[n] -> weight[n, 256] and scale[n, 8] (host memory, caller-owned until wait() returns).
struct Batch {
  const int64_t* ids64 = nullptr;
  const int32_t* ids32 = nullptr;
  int64_t n = 0;
  uint8_t* weight = nullptr;
  uint8_t* scale = nullptr;
  int64_t chunk = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::string error;  // first error, empty when all rows were read

  int64_t id(int64_t i) const { return ids64 ? ids64[i] : static_cast<int64_t>(ids32[i]); }
  // Row i of the output from one record (weight then scale bytes).
  void write_row(int64_t i, const uint8_t* record) {
    std::memcpy(weight + i * kWeightBytes, record, kWeightBytes);
    std::memcpy(scale + i * kScaleBytes, record + kWeightBytes, kScaleBytes);
  }
  void wait();  // blocks until every row is written
  bool ready();
};

class RowCache {
 public:
  static constexpr int kWays = 8;
  explicit RowCache(uint64_t bytes);
  bool get(int64_t id, uint8_t* record);
  void put(int64_t id, const uint8_t* record);
  uint64_t bytes() const { return bytes_; }
  uint64_t sets() const { return sets_; }

 private:
  static constexpr int kStripes = 4096;
  uint64_t set_of(int64_t id) const;
  uint64_t sets_ = 0, bytes_ = 0;
  std::unique_ptr<int64_t[]> tags_;
  std::unique_ptr<uint32_t[]> stamps_;
  std::unique_ptr<uint8_t[]> data_;
  std::unique_ptr<std::mutex[]> locks_;
  std::atomic<uint32_t> clock_{0};
};

class Store {
 public:
  // io_mode: "auto" (O_DIRECT where it works), "direct" (fail if it does not), "buffered".
  // io_engine: "auto" (io_uring, else aio, else pread), "io_uring" or "aio" (fail if unavailable or buffered),
  // "pread" (blocking). queue_depth: rows in flight per worker thread on the asynchronous paths (each row is one
  // read per extent: one for a pack file, two for the original shards).
  Store(std::vector<Extent> extents, int64_t first_row, int64_t end_row, int threads, uint64_t cache_bytes,
        const std::string& io_mode, int queue_depth = 32, const std::string& io_engine = "auto");
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  std::shared_ptr<Batch> submit(const int64_t* ids64, const int32_t* ids32, int64_t n, uint8_t* weight, uint8_t* scale);
  void drop_page_cache();  // POSIX_FADV_DONTNEED on every file (cold-cache benchmarks of buffered mode)

  bool direct() const { return direct_; }
  const std::string& io_path() const { return io_path_; }  // "io_uring", "aio" or "pread"
  int queue_depth() const { return queue_depth_; }         // rows in flight per thread (1 on the pread path)
  std::string io_note() const;                             // why the path was chosen (fallback reasons), or empty
  int threads() const { return static_cast<int>(workers_.size()); }
  int64_t first_row() const { return first_row_; }
  int64_t end_row() const { return end_row_; }
  uint64_t host_bytes() const;  // cache + per-thread I/O buffers (8 KiB, plus 8 KiB per read in flight)
  uint64_t cache_bytes() const { return cache_ ? cache_->bytes() : 0; }
  uint64_t cache_hits() const { return hits_.load(); }
  uint64_t cache_misses() const { return misses_.load(); }
  uint64_t reads() const { return reads_.load(); }

 private:
  struct File {
    std::string path;
    int fd = -1;
    int64_t size = 0;
  };
  struct Source {
    int file;  // index into files_
    Extent e;
  };
  struct WorkerIo {
    std::unique_ptr<ReadQueue> queue;  // null: blocking pread path
    uint8_t* buf = nullptr;            // kIoBufBytes, aligned: blocking reads
    uint8_t* ring = nullptr;           // queue_depth x sources x kIoBufBytes, aligned: asynchronous reads
    uint64_t bytes = 0;
    bool keep_ring = false;  // the queue failed with reads in flight: never free what they target
  };
  void open_files(const std::vector<Extent>& extents, const std::string& io_mode);
  void select_io(const std::string& io_engine, int queue_depth, int threads);
  void worker(int index);
  void async_worker(int index);
  std::shared_ptr<Batch> next_batch(bool block);
  void retire(const std::shared_ptr<Batch>& b);
  void rows_finished(Batch& b, int64_t k);
  void fail_row(Batch& b, const std::string& error);
  void run_rows(Batch& b, int64_t begin, int64_t end, uint8_t* iobuf);
  bool read_record(int64_t id, uint8_t* record, uint8_t* iobuf, std::string& error);
  std::string read_error(const File& f, int64_t id, int64_t off, int64_t got) const;

  std::vector<File> files_;
  std::vector<Source> sources_;
  int64_t first_row_, end_row_;
  bool direct_ = false;
  std::string io_path_ = "pread";
  int queue_depth_ = 1;
  mutable std::mutex note_m_;
  std::string io_note_;
  std::unique_ptr<RowCache> cache_;
  std::atomic<uint64_t> hits_{0}, misses_{0}, reads_{0};

  std::mutex qm_;
  std::condition_variable qcv_;
  std::deque<std::shared_ptr<Batch>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
  std::vector<WorkerIo> io_;  // one per worker
};

}  // namespace engram
}  // namespace twinspark
