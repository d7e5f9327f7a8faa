// engram_store, asynchronous path: one worker thread keeps up to queue_depth rows in flight through its
// ReadQueue (io_uring or Linux AIO, O_DIRECT). See engram_store.h and read_queue.h.
//
// Each row in flight owns a slot: one aligned 8 KiB buffer per extent (tag = slot * extents + extent). The worker
// claims rows of the front batch (chunks, one atomic add each) while slots are free, serves foreign ids and
// cache hits at once, stages the reads of the rest, then submits and waits for at least one completion in one
// system call. When a batch has no rows left to claim the worker moves on to the next one while the first's
// reads are still in flight, so the queue stays full across batch boundaries. A short or failed completion is
// retried once with a blocking pread (it reports the file's error if that fails too); if the queue itself fails,
// the worker finishes its rows with blocking reads and stays on that path.
#include <algorithm>
#include <cstring>

#include "engram_store/engram_store.h"

namespace twinspark {
namespace engram {
namespace {

struct RowSlot {
  std::shared_ptr<Batch> batch;  // null when the slot is free
  int64_t index = 0;
  int64_t id = 0;
  int pending = 0;  // reads not completed yet
  bool failed = false;
};

}  // namespace

void Store::async_worker(int index) {
  WorkerIo& io = io_[index];
  const int nsrc = static_cast<int>(sources_.size());
  const int depth = queue_depth_;
  std::vector<RowSlot> slots(depth);
  std::vector<int> free_slots;
  for (int s = depth - 1; s >= 0; --s) free_slots.push_back(s);
  std::vector<ReadOp> ops;
  ops.reserve(static_cast<size_t>(depth) * nsrc);
  std::vector<ReadDone> done(static_cast<size_t>(depth) * nsrc);
  alignas(16) uint8_t record[kRecordBytes];
  std::string error;
  bool queue_ok = true;

  auto buf = [&](int tag) { return io.ring + static_cast<size_t>(tag) * kIoBufBytes; };
  // File offset of extent k of row id, and the aligned read that covers it: returns the record's offset in it.
  auto span = [&](int64_t id, int k, int64_t& off, int64_t& aoff, uint32_t& alen) {
    const Source& s = sources_[k];
    off = s.e.base + id * static_cast<int64_t>(s.e.stride);
    aoff = off & ~static_cast<int64_t>(kDirectAlign - 1);
    const int64_t head = off - aoff;
    alen = static_cast<uint32_t>((head + s.e.length + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
    return head;
  };
  int inflight = 0;
  auto finish_slot = [&](int s) {
    RowSlot& r = slots[s];
    if (r.failed) {
      std::memset(record, 0, kRecordBytes);
    } else {
      for (int k = 0; k < nsrc; ++k) {
        int64_t off, aoff;
        uint32_t alen;
        const int64_t head = span(r.id, k, off, aoff, alen);
        std::memcpy(record + sources_[k].e.record_off, buf(s * nsrc + k) + head, sources_[k].e.length);
      }
      if (cache_) cache_->put(r.id, record);
    }
    r.batch->write_row(r.index, record);
    rows_finished(*r.batch, 1);
    r.batch.reset();
    free_slots.push_back(s);
    --inflight;
  };
  // Blocking read of a whole row into `record` (also the path after a queue failure).
  auto read_now = [&](Batch& b, int64_t i, int64_t id) {
    error.clear();
    if (read_record(id, record, io.buf, error)) {
      if (cache_) cache_->put(id, record);
    } else {
      std::memset(record, 0, kRecordBytes);
      fail_row(b, error);
    }
    b.write_row(i, record);
  };
  auto queue_failed = [&](const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(note_m_);
      io_note_ += (io_note_.empty() ? "" : "; ") + std::string("worker ") + std::to_string(index) + ": " +
                  io.queue->name() + " failed (" + why + "), continuing with blocking pread";
    }
    queue_ok = false;
    io.keep_ring = true;  // the kernel may still write into the ring buffers: never free them
    ops.clear();
    for (int s = 0; s < depth; ++s) {
      RowSlot& r = slots[s];
      if (!r.batch) continue;
      read_now(*r.batch, r.index, r.id);
      rows_finished(*r.batch, 1);
      r.batch.reset();
      free_slots.push_back(s);
      --inflight;
    }
  };

  std::shared_ptr<Batch> cur;  // the batch rows are claimed from
  int64_t claim = 0, claim_end = 0, cur_done = 0;
  bool drained = false;  // next_batch(block) came back empty: stopping and nothing queued
  auto flush_done = [&] {
    if (cur && cur_done) rows_finished(*cur, cur_done);
    cur_done = 0;
  };
  for (;;) {
    // 1. Claim rows while slots are free; block for a new batch only when nothing is in flight.
    while (!free_slots.empty()) {
      if (claim == claim_end) {
        if (!cur) {
          const bool block = inflight == 0;
          cur = next_batch(block);
          if (!cur) {
            drained = block;
            break;
          }
        }
        const int64_t begin = cur->next.fetch_add(cur->chunk);
        if (begin >= cur->n) {
          flush_done();
          retire(cur);
          cur.reset();
          continue;
        }
        claim = begin;
        claim_end = std::min(cur->n, begin + cur->chunk);
      }
      Batch& b = *cur;
      const int64_t i = claim++;
      const int64_t id = b.id(i);
      if (id < first_row_ || id >= end_row_) {  // foreign id or -1: zero row
        std::memset(record, 0, kRecordBytes);
        b.write_row(i, record);
        ++cur_done;
        continue;
      }
      if (cache_ && cache_->get(id, record)) {
        hits_.fetch_add(1, std::memory_order_relaxed);
        b.write_row(i, record);
        ++cur_done;
        continue;
      }
      if (cache_) misses_.fetch_add(1, std::memory_order_relaxed);
      if (!queue_ok) {
        read_now(b, i, id);
        ++cur_done;
        continue;
      }
      const int s = free_slots.back();
      free_slots.pop_back();
      slots[s].batch = cur;
      slots[s].index = i;
      slots[s].id = id;
      slots[s].pending = nsrc;
      slots[s].failed = false;
      for (int k = 0; k < nsrc; ++k) {
        int64_t off, aoff;
        uint32_t alen;
        span(id, k, off, aoff, alen);
        ops.push_back(
            ReadOp{files_[sources_[k].file].fd, buf(s * nsrc + k), alen, aoff, static_cast<uint64_t>(s * nsrc + k)});
      }
      reads_.fetch_add(nsrc, std::memory_order_relaxed);
      ++inflight;
    }
    flush_done();
    if (!ops.empty()) {
      error.clear();
      if (io.queue->submit(ops.data(), static_cast<int>(ops.size()), error))
        ops.clear();
      else
        queue_failed(error);
    }
    if (inflight == 0) {
      if (drained) return;
      continue;
    }
    // 2. Submit what is staged and wait for at least one completion.
    error.clear();
    const int got = io.queue->reap(done.data(), static_cast<int>(done.size()), 1, error);
    if (got < 0) {
      queue_failed(error);
      continue;
    }
    for (int d = 0; d < got; ++d) {
      const int tag = static_cast<int>(done[d].tag);
      const int s = tag / nsrc, k = tag % nsrc;
      RowSlot& r = slots[s];
      if (!r.failed) {
        int64_t off, aoff;
        uint32_t alen;
        const int64_t need = span(r.id, k, off, aoff, alen) + sources_[k].e.length;
        const File& f = files_[sources_[k].file];
        int64_t res = done[d].result;
        if (res < need) res = pread_full(f.fd, buf(tag), alen, aoff);  // short read, EAGAIN, ...: once, blocking
        if (res < need) {
          r.failed = true;
          fail_row(*r.batch, read_error(f, r.id, off, res));
        }
      }
      if (--r.pending == 0) finish_slot(s);
    }
  }
}

}  // namespace engram
}  // namespace twinspark
