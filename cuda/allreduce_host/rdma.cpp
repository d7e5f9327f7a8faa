// ibverbs RDMA-write backend of the host-memory all-reduce (RoCE v2 between the two Sparks: GB10 has no
// GPUDirect RDMA, so the NIC reads and writes the pinned host buffers the GPU maps).
//
// Compiled when rdma-core headers exist; libibverbs is opened at run time (dlopen), so the module imports and
// the other backends work on machines without it. Per peer one RC queue pair; a send is one
// RDMA_WRITE_WITH_IMM of this rank's slot into the peer's recv slot for this rank, the immediate carrying the
// epoch. The receiving proxy sees the completion and raises the recv flag: the flag is never raised before the
// payload landed, with no assumption about the order in which the NIC places bytes.
// Connection data (QP number, PSN, GID, buffer address, rkey) is swapped over the TCP socket of each pair.
#include <stdexcept>
#include <string>

#include "allreduce_host/host_comm.h"

#if defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define TWINSPARK_HAVE_VERBS 1
#endif
#endif

#ifdef TWINSPARK_HAVE_VERBS
#include <arpa/inet.h>
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cstring>

namespace twinspark::allreduce_host {
namespace {

// The exported libibverbs entry points we need (ibv_post_send, ibv_poll_cq and ibv_post_recv are inline).
struct Verbs {
  void* lib = nullptr;
  decltype(&ibv_get_device_list) get_device_list = nullptr;
  decltype(&ibv_free_device_list) free_device_list = nullptr;
  decltype(&ibv_get_device_name) get_device_name = nullptr;
  decltype(&ibv_open_device) open_device = nullptr;
  decltype(&ibv_close_device) close_device = nullptr;
  decltype(&ibv_alloc_pd) alloc_pd = nullptr;
  decltype(&ibv_dealloc_pd) dealloc_pd = nullptr;
  decltype(&ibv_reg_mr) reg_mr = nullptr;
  decltype(&ibv_dereg_mr) dereg_mr = nullptr;
  decltype(&ibv_create_cq) create_cq = nullptr;
  decltype(&ibv_destroy_cq) destroy_cq = nullptr;
  decltype(&ibv_create_qp) create_qp = nullptr;
  decltype(&ibv_destroy_qp) destroy_qp = nullptr;
  decltype(&ibv_modify_qp) modify_qp = nullptr;
  decltype(&ibv_query_port) query_port = nullptr;  // the exported (compat) symbol
  decltype(&ibv_query_gid) query_gid = nullptr;
  std::string error;

  Verbs() {
    lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      error = "libibverbs.so.1 is not installed (install rdma-core: apt-get install libibverbs1 ibverbs-providers)";
      return;
    }
#define TS_SYM(field, name)                                                        \
  field = reinterpret_cast<decltype(field)>(dlsym(lib, name));                     \
  if (!field) {                                                                    \
    error = std::string("libibverbs.so.1 lacks ") + name + " (rdma-core too old)"; \
    return;                                                                        \
  }
    TS_SYM(get_device_list, "ibv_get_device_list")
    TS_SYM(free_device_list, "ibv_free_device_list")
    TS_SYM(get_device_name, "ibv_get_device_name")
    TS_SYM(open_device, "ibv_open_device")
    TS_SYM(close_device, "ibv_close_device")
    TS_SYM(alloc_pd, "ibv_alloc_pd")
    TS_SYM(dealloc_pd, "ibv_dealloc_pd")
    TS_SYM(reg_mr, "ibv_reg_mr")
    TS_SYM(dereg_mr, "ibv_dereg_mr")
    TS_SYM(create_cq, "ibv_create_cq")
    TS_SYM(destroy_cq, "ibv_destroy_cq")
    TS_SYM(create_qp, "ibv_create_qp")
    TS_SYM(destroy_qp, "ibv_destroy_qp")
    TS_SYM(modify_qp, "ibv_modify_qp")
    TS_SYM(query_port, "ibv_query_port")
    TS_SYM(query_gid, "ibv_query_gid")
#undef TS_SYM
  }
};

Verbs& verbs() {
  static Verbs v;
  return v;
}

struct Wire {  // swapped once per pair over TCP
  uint32_t qpn, psn;
  uint64_t addr;
  uint32_t rkey;
  uint16_t lid;
  uint8_t gid[16];
};

void write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t k = ::write(fd, c, n);
    if (k <= 0) throw std::runtime_error("allreduce rdma: lost the TCP connection while exchanging QP data");
    c += k, n -= static_cast<size_t>(k);
  }
}

void read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    ssize_t k = ::read(fd, c, n);
    if (k <= 0) throw std::runtime_error("allreduce rdma: lost the TCP connection while exchanging QP data");
    c += k, n -= static_cast<size_t>(k);
  }
}

constexpr int kRecvDepth = 64;

class Rdma final : public Backend {
 public:
  Rdma(HostComm* self, const std::vector<int>& fds, const std::string& device, int port, int gid_index)
      : self_(self), fds_(fds), port_(port), qps_(fds.size(), nullptr) {
    Verbs& V = verbs();
    int n = 0;
    ibv_device** list = V.get_device_list(&n);
    if (!list || n == 0) {
      if (list) V.free_device_list(list);
      throw std::runtime_error("allreduce rdma: no RDMA device found; use backend 'tcp' or check the NIC driver");
    }
    ibv_device* dev = nullptr;
    for (int i = 0; i < n; ++i)
      if (device.empty() || device == V.get_device_name(list[i])) dev = list[i];
    if (device.empty()) dev = list[0];
    if (!dev) {
      V.free_device_list(list);
      throw std::runtime_error("allreduce rdma: RDMA device '" + device + "' not found (see `ibv_devices`)");
    }
    ctx_ = V.open_device(dev);
    V.free_device_list(list);
    if (!ctx_) throw std::runtime_error("allreduce rdma: cannot open the RDMA device");
    ibv_port_attr pattr;
    std::memset(&pattr, 0, sizeof(pattr));
    if (V.query_port(ctx_, port_, reinterpret_cast<_compat_ibv_port_attr*>(&pattr)))
      throw std::runtime_error("allreduce rdma: cannot query port " + std::to_string(port_));
    mtu_ = pattr.active_mtu;
    lid_ = pattr.lid;
    ibv_gid gid;
    if (V.query_gid(ctx_, port_, gid_index, &gid))
      throw std::runtime_error("allreduce rdma: cannot read GID index " + std::to_string(gid_index));
    bool zero = true;
    for (uint8_t b : gid.raw) zero &= (b == 0);
    if (zero)
      throw std::runtime_error("allreduce rdma: GID index " + std::to_string(gid_index) +
                               " is all zeros; pick the RoCE v2 entry for this node's IP (show_gids)");
    gid_index_ = gid_index;
    pd_ = V.alloc_pd(ctx_);
    if (!pd_) throw std::runtime_error("allreduce rdma: ibv_alloc_pd failed");
    mr_ = V.reg_mr(pd_, self_->base(), self_->bytes(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr_)
      throw std::runtime_error("allreduce rdma: ibv_reg_mr failed (raise the memlock limit: ulimit -l unlimited)");
    cq_ = V.create_cq(ctx_, 4 * kRecvDepth * kMaxRanks, nullptr, nullptr, 0);
    if (!cq_) throw std::runtime_error("allreduce rdma: ibv_create_cq failed");
    for (int r = 0; r < static_cast<int>(fds_.size()); ++r) {
      if (fds_[r] < 0) continue;
      connect_peer(r, gid);
    }
  }

  ~Rdma() override {
    Verbs& V = verbs();
    for (auto* qp : qps_)
      if (qp) V.destroy_qp(qp);
    if (cq_) V.destroy_cq(cq_);
    if (mr_) V.dereg_mr(mr_);
    if (pd_) V.dealloc_pd(pd_);
    if (ctx_) V.close_device(ctx_);
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }

  const char* name() const override { return "rdma"; }

  void send(uint32_t epoch, uint32_t nbytes) override {
    const int slot = epoch & 1;
    for (int r = 0; r < static_cast<int>(qps_.size()); ++r) {
      if (!qps_[r]) continue;
      ibv_sge sge{};
      sge.addr = reinterpret_cast<uint64_t>(self_->send_slot(slot));
      sge.length = nbytes;
      sge.lkey = mr_->lkey;
      ibv_send_wr wr{}, *bad = nullptr;
      wr.wr_id = static_cast<uint64_t>(r);
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.sg_list = nbytes ? &sge : nullptr;
      wr.num_sge = nbytes ? 1 : 0;
      wr.imm_data = htonl(epoch);
      // Same world and capacity on every rank: the peer's recv slot for us sits at the same offset as ours.
      const uint64_t off = static_cast<uint64_t>(self_->recv_slot(self_->rank(), slot) - self_->base());
      wr.wr.rdma.remote_addr = remote_[r].addr + off;
      wr.wr.rdma.rkey = remote_[r].rkey;
      if (ibv_post_send(qps_[r], &wr, &bad)) throw std::runtime_error("allreduce rdma: ibv_post_send failed");
      ++inflight_;
    }
  }

  bool progress() override {
    ibv_wc wc[16];
    const int n = ibv_poll_cq(cq_, 16, wc);
    if (n < 0) throw std::runtime_error("allreduce rdma: ibv_poll_cq failed");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS)
        throw std::runtime_error("allreduce rdma: work completion failed with status " +
                                 std::to_string(static_cast<int>(wc[i].status)) +
                                 " (peer gone, or RoCE GID/MTU mismatch between the nodes)");
      if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        const int src = static_cast<int>(wc[i].wr_id);
        self_->deliver(src, ntohl(wc[i].imm_data));
        post_recv(src);
      } else {
        --inflight_;
      }
    }
    return n > 0;
  }

  bool idle() const override { return inflight_ == 0; }

 private:
  void post_recv(int r) {
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = static_cast<uint64_t>(r);
    wr.num_sge = 0;  // write-with-imm consumes a receive but places no bytes through it
    if (ibv_post_recv(qps_[r], &wr, &bad)) throw std::runtime_error("allreduce rdma: ibv_post_recv failed");
  }

  void connect_peer(int r, const ibv_gid& gid) {
    Verbs& V = verbs();
    ibv_qp_init_attr ia{};
    ia.send_cq = cq_;
    ia.recv_cq = cq_;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = kRecvDepth;
    ia.cap.max_recv_wr = kRecvDepth;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ibv_qp* qp = V.create_qp(pd_, &ia);
    if (!qp) throw std::runtime_error("allreduce rdma: ibv_create_qp failed");
    qps_[r] = qp;

    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(port_);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
    if (V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      throw std::runtime_error("allreduce rdma: QP to INIT failed");
    for (int i = 0; i < kRecvDepth; ++i) post_recv(r);

    Wire mine{}, theirs{};
    mine.qpn = qp->qp_num;
    mine.psn = 0x1000u + static_cast<uint32_t>(self_->rank());
    mine.addr = reinterpret_cast<uint64_t>(self_->base());
    mine.rkey = mr_->rkey;
    mine.lid = lid_;
    std::memcpy(mine.gid, gid.raw, 16);
    write_all(fds_[r], &mine, sizeof(mine));
    read_all(fds_[r], &theirs, sizeof(theirs));
    remote_.resize(fds_.size());
    remote_[r] = theirs;

    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = mtu_;
    a.dest_qp_num = theirs.qpn;
    a.rq_psn = theirs.psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.dlid = theirs.lid;
    a.ah_attr.port_num = static_cast<uint8_t>(port_);
    std::memcpy(a.ah_attr.grh.dgid.raw, theirs.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
    a.ah_attr.grh.hop_limit = 64;
    if (V.modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      throw std::runtime_error("allreduce rdma: QP to RTR failed (check the GID index on both nodes)");
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = mine.psn;
    a.max_rd_atomic = 1;
    if (V.modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
      throw std::runtime_error("allreduce rdma: QP to RTS failed");
  }

  HostComm* self_;
  std::vector<int> fds_;
  int port_;
  int gid_index_ = 0;
  ibv_mtu mtu_ = IBV_MTU_1024;
  uint16_t lid_ = 0;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_qp*> qps_;
  std::vector<Wire> remote_;
  int inflight_ = 0;
};

}  // namespace

std::string rdma_unavailable_reason() {
  Verbs& V = verbs();
  if (!V.error.empty()) return V.error;
  int n = 0;
  ibv_device** list = V.get_device_list(&n);
  if (list) V.free_device_list(list);
  if (!list || n == 0) return "no RDMA device found (ibv_get_device_list lists none)";
  return "";
}

std::unique_ptr<Backend> make_rdma(HostComm* self, const std::vector<int>& fds, const std::string& device, int port,
                                   int gid_index) {
  const std::string why = rdma_unavailable_reason();
  if (!why.empty()) throw std::runtime_error("allreduce rdma: " + why + "; use backend 'tcp' on this machine");
  if (static_cast<int>(fds.size()) != self->world())
    throw std::invalid_argument("allreduce rdma: expected one socket per rank (-1 for this rank)");
  return std::make_unique<Rdma>(self, fds, device, port, gid_index);
}

}  // namespace twinspark::allreduce_host

#else  // no rdma-core headers at build time

namespace twinspark::allreduce_host {

std::string rdma_unavailable_reason() {
  return "twinspark was built without rdma-core headers (install libibverbs-dev and rebuild)";
}

std::unique_ptr<Backend> make_rdma(HostComm*, const std::vector<int>&, const std::string&, int, int) {
  throw std::runtime_error("allreduce rdma: " + rdma_unavailable_reason() + "; use backend 'tcp' meanwhile");
}

}  // namespace twinspark::allreduce_host
#endif
