// HostComm: buffers, the proxy thread, the CPU side of a call, and the loopback and TCP backends.
#include "allreduce_host/host_comm.h"

#include <errno.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#ifdef TWINSPARK_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace twinspark::allreduce_host {

namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spin for spin_us after the last useful work, then yield the core: the proxy stays sub-microsecond while calls
// come back to back and does not starve a small machine (or the GPU's launch thread) when idle.
class Backoff {
 public:
  explicit Backoff(double spin_us) : spin_(std::chrono::duration<double, std::micro>(spin_us)) { reset(); }
  void reset() { last_ = Clock::now(); }
  void pause() {
    if (Clock::now() - last_ < spin_) {
      cpu_relax();
    } else {
      sched_yield();
    }
  }

 private:
  std::chrono::duration<double, std::micro> spin_;
  Clock::time_point last_;
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

HostComm::HostComm(int rank, int world, size_t capacity, bool pinned, double spin_us)
    : rank_(rank), world_(world), capacity_(round_up(capacity, 4096)), pinned_(pinned), spin_us_(spin_us) {
  if (world < 1 || world > kMaxRanks) throw std::invalid_argument("allreduce: world must be 1..8");
  if (rank < 0 || rank >= world) throw std::invalid_argument("allreduce: rank must be in [0, world)");
  bytes_ = kDataOffset + 2 * capacity_ * (1 + static_cast<size_t>(world));
  void* p = nullptr;
  if (pinned) {
#ifdef TWINSPARK_WITH_CUDA
    cudaError_t err = cudaHostAlloc(&p, bytes_, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("allreduce: cudaHostAlloc of ") + std::to_string(bytes_) +
                               " bytes failed: " + cudaGetErrorString(err));
    }
#else
    throw std::runtime_error("allreduce: pinned buffers need a CUDA build of twinspark");
#endif
  } else {
    p = std::aligned_alloc(4096, bytes_);
    if (!p) throw std::bad_alloc();
  }
  base_ = static_cast<uint8_t*>(p);
  std::memset(base_, 0, bytes_);
  if (!pinned_) wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

HostComm::~HostComm() {
  stop();
  backend_.reset();  // an RDMA backend deregisters the memory before it is freed
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (!base_) return;
#ifdef TWINSPARK_WITH_CUDA
  if (pinned_) {
    cudaFreeHost(base_);
    return;
  }
#endif
  std::free(base_);
}

void HostComm::connect_loopback(const std::vector<HostComm*>& comms) {
  if (backend_) throw std::runtime_error("allreduce: this communicator is already connected");
  backend_ = make_loopback(this, comms);
}

void HostComm::connect_tcp(const std::vector<int>& fds) {
  if (backend_) throw std::runtime_error("allreduce: this communicator is already connected");
  backend_ = make_tcp(this, fds);
}

void HostComm::connect_rdma(const std::vector<int>& fds, const std::string& device, int port, int gid_index) {
  if (backend_) throw std::runtime_error("allreduce: this communicator is already connected");
  backend_ = make_rdma(this, fds, device, port, gid_index);
}

std::string HostComm::backend_name() const { return backend_ ? backend_->name() : "none"; }

void HostComm::start() {
  if (!backend_) throw std::runtime_error("allreduce: connect a backend before start()");
  if (running_.exchange(true)) return;
  thread_ = std::thread([this] { run(); });
}

void HostComm::stop() {
  running_.store(false);
  // Join also when the proxy already stopped itself after a failure (fail() clears running_).
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void HostComm::run() {
  uint32_t sent = 0;  // last epoch handed to the backend
  Backoff backoff(spin_us_);
  const auto spin = std::chrono::duration<double, std::micro>(spin_us_);
  auto last_work = Clock::now();
  std::vector<pollfd> fds;
  try {
    while (running_.load(std::memory_order_relaxed)) {
      bool work = false;
      const uint32_t next = sent + 1;
      uint32_t* h = header(next & 1);
      // One send in flight per peer: the next epoch waits until the previous one left (its slot stays intact,
      // see the layout comment).
      if (backend_->idle() && load_acquire(h) == next) {
        backend_->send(next, __atomic_load_n(h + 1, __ATOMIC_RELAXED));
        sent = next;
        work = true;
      }
      work |= backend_->progress();
      if (work) {
        backoff.reset();
        last_work = Clock::now();
      } else if (wake_fd_ >= 0 && Clock::now() - last_work > spin) {
        // Sleep until post() or a socket wakes us (1 ms cap: a lost wake-up costs at most that).
        proxy_sleeping_.store(true);
        if (!(backend_->idle() && load_acquire(h) == next)) {
          fds.clear();
          fds.push_back({wake_fd_, POLLIN, 0});
          backend_->pollfds(fds);
          ::poll(fds.data(), fds.size(), 1);
          uint64_t drain;
          while (::read(wake_fd_, &drain, sizeof(drain)) > 0) {
          }
        }
        proxy_sleeping_.store(false);
      } else {
        backoff.pause();
      }
    }
  } catch (const std::exception& e) {
    fail(-1, e.what());
  }
}

void HostComm::deliver(int src, uint32_t epoch) {
  store_release(recv_flag(src), epoch);
  if (waiters_.load() > 0) {
    std::lock_guard<std::mutex> lock(cv_mu_);
    cv_.notify_all();
  }
}

void HostComm::post(uint32_t epoch, uint32_t nbytes) {
  uint32_t* h = header(epoch & 1);
  __atomic_store_n(h + 1, nbytes, __ATOMIC_RELAXED);
  store_release(h, epoch);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);  // pairs with the proxy's sleeping flag, then header re-check
  if (wake_fd_ >= 0 && proxy_sleeping_.load()) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
}

bool HostComm::wait(int peer, uint32_t epoch, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  Backoff backoff(spin_us_);
  const uint32_t* f = recv_flag(peer);
  const auto sleep_after = Clock::now() + std::chrono::duration<double, std::micro>(spin_us_);
  auto arrived = [&] { return static_cast<int32_t>(load_acquire(f) - epoch) >= 0; };
  for (;;) {
    if (arrived()) return true;
    if (load_acquire(status()) != 0) return false;  // the proxy failed: error() says why
    const auto now = Clock::now();
    if (now > deadline) return false;
    if (now < sleep_after) {
      backoff.pause();
      continue;
    }
    // Sleep until deliver() notifies (1 ms cap so status and the deadline are still checked).
    waiters_.fetch_add(1);
    {
      std::unique_lock<std::mutex> lock(cv_mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(1), arrived);
    }
    waiters_.fetch_sub(1);
  }
}

std::string HostComm::error() const {
  std::lock_guard<std::mutex> lock(err_mu_);
  return error_;
}

void HostComm::fail(int peer, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(err_mu_);
    if (error_.empty()) error_ = why;
  }
  uint32_t* st = status();
  if (load_acquire(st) == 0) {
    st[1] = static_cast<uint32_t>(peer);
    store_release(st, 2u);  // kPeerFailed
  }
  running_.store(false);
}

// ---------------------------------------------------------------- loopback: the proxy copies host to host
namespace {

class Loopback final : public Backend {
 public:
  Loopback(HostComm* self, std::vector<HostComm*> comms) : self_(self), comms_(std::move(comms)) {}
  const char* name() const override { return "loopback"; }
  void send(uint32_t epoch, uint32_t nbytes) override {
    const int slot = epoch & 1;
    for (int r = 0; r < static_cast<int>(comms_.size()); ++r) {
      if (r == self_->rank()) continue;
      std::memcpy(comms_[r]->recv_slot(self_->rank(), slot), self_->send_slot(slot), nbytes);
      comms_[r]->deliver(self_->rank(), epoch);
    }
  }
  bool progress() override { return false; }

 private:
  HostComm* self_;
  std::vector<HostComm*> comms_;
};

// ---------------------------------------------------------------- TCP: non-blocking, both directions at once
// Frame: {u32 epoch, u32 nbytes} then nbytes of payload. Sends and receives advance together so two ranks that
// send large messages to each other at the same moment never block on full socket buffers.
class Tcp final : public Backend {
 public:
  Tcp(HostComm* self, const std::vector<int>& fds) : self_(self), peers_(fds.size()) {
    for (size_t r = 0; r < fds.size(); ++r) peers_[r].fd = fds[r];
  }
  ~Tcp() override {
    for (auto& p : peers_)
      if (p.fd >= 0) ::close(p.fd);
  }
  const char* name() const override { return "tcp"; }

  void send(uint32_t epoch, uint32_t nbytes) override {
    for (auto& p : peers_) {
      if (p.fd < 0) continue;
      if (p.out_pending) throw std::runtime_error("allreduce tcp: internal error, send overlaps the previous one");
      p.out_hdr[0] = epoch, p.out_hdr[1] = nbytes;
      p.out_data = self_->send_slot(epoch & 1);
      p.out_len = nbytes;
      p.out_done = 0;
      p.out_pending = true;
    }
    progress();
  }

  bool progress() override {
    bool work = false;
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
      Peer& p = peers_[r];
      if (p.fd < 0) continue;
      work |= push(r, p);
      work |= pull(r, p);
    }
    return work;
  }

  bool idle() const override {
    for (auto& p : peers_)
      if (p.out_pending) return false;
    return true;
  }

  void pollfds(std::vector<pollfd>& out) const override {
    for (auto& p : peers_)
      if (p.fd >= 0) out.push_back({p.fd, static_cast<short>(POLLIN | (p.out_pending ? POLLOUT : 0)), 0});
  }

 private:
  struct Peer {
    int fd = -1;
    bool out_pending = false;
    uint32_t out_hdr[2] = {0, 0};
    const uint8_t* out_data = nullptr;
    size_t out_len = 0, out_done = 0;  // out_done counts header bytes too
    uint32_t in_hdr[2] = {0, 0};
    size_t in_done = 0;  // header + payload bytes received of the current frame
  };

  [[noreturn]] void broken(int r, const char* what, int err) {
    throw std::runtime_error(std::string("allreduce tcp: connection to rank ") + std::to_string(r) + " " + what +
                             (err ? std::string(": ") + std::strerror(err) : std::string()) +
                             "; the peer process stopped or the network dropped: restart both ranks");
  }

  bool push(int r, Peer& p) {
    if (!p.out_pending) return false;
    bool work = false;
    while (p.out_done < 8 + p.out_len) {
      iovec iov[2];
      int n = 0;
      if (p.out_done < 8) {
        iov[n++] = {reinterpret_cast<uint8_t*>(p.out_hdr) + p.out_done, 8 - p.out_done};
        if (p.out_len) iov[n++] = {const_cast<uint8_t*>(p.out_data), p.out_len};
      } else {
        iov[n++] = {const_cast<uint8_t*>(p.out_data) + (p.out_done - 8), p.out_len - (p.out_done - 8)};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t k = ::sendmsg(p.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return work;
        if (errno == EINTR) continue;
        broken(r, "failed while sending", errno);
      }
      p.out_done += static_cast<size_t>(k);
      work = true;
    }
    p.out_pending = false;
    return true;
  }

  bool pull(int r, Peer& p) {
    bool work = false;
    for (;;) {
      ssize_t k;
      if (p.in_done < 8) {
        k = ::recv(p.fd, reinterpret_cast<uint8_t*>(p.in_hdr) + p.in_done, 8 - p.in_done, MSG_DONTWAIT);
      } else {
        const size_t len = p.in_hdr[1];
        if (len > self_->capacity()) {
          throw std::runtime_error("allreduce tcp: rank " + std::to_string(r) + " sent " + std::to_string(len) +
                                   " bytes, more than this rank's capacity " + std::to_string(self_->capacity()) +
                                   "; create both ranks with the same capacity");
        }
        const size_t got = p.in_done - 8;
        if (got == len) {
          self_->deliver(r, p.in_hdr[0]);
          p.in_done = 0;
          work = true;
          continue;
        }
        k = ::recv(p.fd, self_->recv_slot(r, p.in_hdr[0] & 1) + got, len - got, MSG_DONTWAIT);
      }
      if (k == 0) broken(r, "was closed by the peer", 0);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return work;
        if (errno == EINTR) continue;
        broken(r, "failed while receiving", errno);
      }
      p.in_done += static_cast<size_t>(k);
      work = true;
      if (p.in_done == 8 && p.in_hdr[1] == 0) {  // an empty frame is complete with its header
        self_->deliver(r, p.in_hdr[0]);
        p.in_done = 0;
      }
    }
  }

  HostComm* self_;
  std::vector<Peer> peers_;
};

}  // namespace

std::unique_ptr<Backend> make_loopback(HostComm* self, const std::vector<HostComm*>& comms) {
  if (static_cast<int>(comms.size()) != self->world())
    throw std::invalid_argument("allreduce loopback: expected one communicator per rank");
  for (int r = 0; r < self->world(); ++r) {
    if (!comms[r] || comms[r]->rank() != r || comms[r]->world() != self->world() ||
        comms[r]->capacity() != self->capacity())
      throw std::invalid_argument("allreduce loopback: communicators must be ranks 0..world-1 of one capacity");
  }
  return std::make_unique<Loopback>(self, comms);
}

std::unique_ptr<Backend> make_tcp(HostComm* self, const std::vector<int>& fds) {
  if (static_cast<int>(fds.size()) != self->world())
    throw std::invalid_argument("allreduce tcp: expected one socket per rank (-1 for this rank)");
  for (int r = 0; r < self->world(); ++r) {
    if ((r == self->rank()) != (fds[r] < 0))
      throw std::invalid_argument("allreduce tcp: need a socket for every peer and -1 for this rank");
  }
  return std::make_unique<Tcp>(self, fds);
}

}  // namespace twinspark::allreduce_host
