// Host-memory all-reduce transport: pinned buffers that the GPU maps, and one proxy thread per rank that moves
// this rank's partial to its peers and raises their flags. Always built (CPU-only builds run the same proxy
// with the PyTorch reference in place of the kernel); cudaHostAlloc only with TWINSPARK_WITH_CUDA.
//
// Buffer layout (one allocation, 4 KiB aligned, zeroed):
//   0, 64          send header per slot: {u32 epoch, u32 nbytes}; the kernel (or the CPU side) writes nbytes,
//                  then stores epoch with release; the proxy polls it with acquire.
//   128            Status {code, peer, epoch, block} (see cuda/allreduce/allreduce.h): the proxy writes
//                  kPeerFailed here so a spinning kernel stops early.
//   256 + 64 r     recv flag of rank r: the epoch whose data from r sits complete in recv slot (epoch & 1).
//   4096           send slots [2][capacity]
//   4096 + 2 capacity (1 + r)   recv slots of rank r [2][capacity]
// Each epoch is sent exactly once and in order; the proxy never skips one even when the sender is a call ahead.
#pragma once
#include <poll.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace twinspark::allreduce_host {

constexpr int kMaxRanks = 8;
constexpr size_t kDataOffset = 4096;

inline uint32_t load_acquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class HostComm;

// A way to move bytes to the peers. send() starts moving this rank's slot to every peer (it may finish later,
// inside progress()); progress() advances sends and receives and returns true when it did anything.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual void send(uint32_t epoch, uint32_t nbytes) = 0;
  virtual bool progress() = 0;
  virtual bool idle() const { return true; }  // no send in flight
  // Descriptors the proxy may sleep on when idle (CPU communicators only); none: it only yields.
  virtual void pollfds(std::vector<pollfd>& out) const { (void)out; }
};

class HostComm {
 public:
  HostComm(int rank, int world, size_t capacity, bool pinned, double spin_us);
  ~HostComm();
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t capacity() const { return capacity_; }
  bool pinned() const { return pinned_; }
  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  uint32_t* header(int slot) const { return reinterpret_cast<uint32_t*>(base_ + 64 * slot); }
  uint32_t* status() const { return reinterpret_cast<uint32_t*>(base_ + 128); }
  uint32_t* recv_flag(int r) const { return reinterpret_cast<uint32_t*>(base_ + 256 + 64 * r); }
  uint8_t* send_slot(int slot) const { return base_ + kDataOffset + capacity_ * slot; }
  uint8_t* recv_slot(int r, int slot) const { return base_ + kDataOffset + 2 * capacity_ * (1 + r) + capacity_ * slot; }

  // Backends (call one, once, before start()).
  void connect_loopback(const std::vector<HostComm*>& comms);  // every rank of this process, index = rank
  void connect_tcp(const std::vector<int>& fds);               // a connected socket per peer, -1 for self
  void connect_rdma(const std::vector<int>& fds, const std::string& device, int port, int gid_index);
  std::string backend_name() const;

  void start();
  void stop();

  // The CPU side of a call (stands in for the kernel): publish `nbytes` already copied into send_slot(epoch&1),
  // and wait until peer's data for `epoch` arrived (false on timeout). Both release the GIL in the binding.
  void post(uint32_t epoch, uint32_t nbytes);
  bool wait(int peer, uint32_t epoch, double timeout_s);

  // Non-empty once the proxy failed (peer closed, socket error); the comm is unusable afterwards.
  std::string error() const;
  void fail(int peer, const std::string& why);  // record an error and flag Status so kernels stop waiting

  // Raise the recv flag of `src` once its bytes sit in recv_slot(src, epoch & 1) (called by backends); wakes a
  // CPU-side wait() that went to sleep.
  void deliver(int src, uint32_t epoch);

 private:
  void run();

  int rank_, world_;
  size_t capacity_, bytes_ = 0;
  bool pinned_;
  double spin_us_;
  uint8_t* base_ = nullptr;
  std::unique_ptr<Backend> backend_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  // CPU communicators sleep instead of spinning once idle for spin_us: the proxy in poll() on an eventfd (post()
  // writes it) plus the sockets, wait() on a condition variable (deliver() notifies). A GPU kernel cannot write
  // an eventfd, so pinned communicators only yield.
  int wake_fd_ = -1;
  std::atomic<bool> proxy_sleeping_{false};
  std::atomic<int> waiters_{0};
  std::mutex cv_mu_;
  std::condition_variable cv_;
  mutable std::mutex err_mu_;
  std::string error_;
};

std::unique_ptr<Backend> make_loopback(HostComm* self, const std::vector<HostComm*>& comms);
std::unique_ptr<Backend> make_tcp(HostComm* self, const std::vector<int>& fds);
// Throws std::runtime_error with one clear sentence when rdma-core or an RDMA device is missing.
std::unique_ptr<Backend> make_rdma(HostComm* self, const std::vector<int>& fds, const std::string& device, int port,
                                   int gid_index);
// "" when the ibverbs backend can be used here, else why not (no headers at build time, no libibverbs, no device).
std::string rdma_unavailable_reason();

}  // namespace twinspark::allreduce_host
