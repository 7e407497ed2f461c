#include "engine.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "crc32c.h"

namespace pcc {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void prefault(uint8_t* p, size_t n) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  if (n == 0) return;
  const uintptr_t page = 4096;
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  uintptr_t b = reinterpret_cast<uintptr_t>(p) + n;
  if (::madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE) == 0) return;
  // Older kernel, or a mapping madvise refuses: touch. Rewriting a byte keeps the contents.
  volatile uint8_t* v = p;
  for (size_t i = 0; i < n; i += page) v[i] = v[i];
  v[n - 1] = v[n - 1];
}

void ArraySource::prepare() {
  const size_t ndim = shape.size();
  uint64_t expected = itemsize;
  d0 = ndim;
  for (size_t j = ndim; j-- > 0;) {
    // A dim of extent 1 never moves the pointer, so its stride does not matter.
    if (shape[j] != 1 && strides[j] != static_cast<int64_t>(expected)) break;
    expected *= static_cast<uint64_t>(shape[j]);
    d0 = j;
  }
  run_bytes = expected;
}

void ArraySource::copy_range(uint64_t begin, uint64_t end, uint8_t* dst) const {
  if (begin >= end) return;
  if (d0 == 0) {  // contiguous: one memcpy
    std::memcpy(dst, ptr + begin, end - begin);
    return;
  }
  // Odometer over the outer dims [0, d0); each position is one run of run_bytes bytes.
  uint64_t run = begin / run_bytes;
  uint64_t off = begin % run_bytes;
  int64_t idx[64];
  for (size_t j = d0; j-- > 0;) {
    idx[j] = static_cast<int64_t>(run % static_cast<uint64_t>(shape[j]));
    run /= static_cast<uint64_t>(shape[j]);
  }
  while (begin < end) {
    const uint8_t* p = ptr;
    for (size_t j = 0; j < d0; j++) p += idx[j] * strides[j];
    uint64_t n = std::min(run_bytes - off, end - begin);
    std::memcpy(dst, p + off, n);
    dst += n;
    begin += n;
    off = 0;
    for (size_t j = d0; j-- > 0;) {
      if (++idx[j] < shape[j]) break;
      idx[j] = 0;
    }
  }
}

Engine::Engine(uint64_t chunk_size, uint32_t num_chunks, uint32_t writer_threads)
    : chunk_size_(chunk_size),
      num_chunks_(num_chunks),
      free_chunks_(num_chunks + 1),
      tasks_(num_chunks + kInPlaceTasks + 1),
      in_place_tasks_(kInPlaceTasks + 1) {
  for (uint32_t i = 0; i < kInPlaceTasks; i++) in_place_tasks_.push(i);
  if (chunk_size == 0 || chunk_size % kBlock || num_chunks == 0 || writer_threads == 0)
    throw std::invalid_argument("chunk size must be a positive multiple of 4096, with >= 1 chunk and >= 1 writer");
  pool_len_ = chunk_size * num_chunks;
  void* p = ::mmap(nullptr, pool_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw NativeError(errno, "cannot allocate the DRAM chunk pool");
  pool_ = static_cast<uint8_t*>(p);
  // No MADV_HUGEPAGE: on these KVM guests (THP "madvise", free page reporting on) the
  // first touch of a fresh 2 GiB pool took 7.6-8.0 s with it (0.25 GiB/s) against 1.1-1.5 s in
  // 4 KiB pages, and a memcpy into the faulted pool ran at 13-14.5 GiB/s either way
  // (bench/analysis/pool_first_touch_hugepages.py). A restarted
  // job's first checkpoint waited for that first touch.
  for (uint32_t i = 0; i < writer_threads; i++) writers_.emplace_back([this] { writer_loop(); });
  // First touch is slow on these machines (0.25-1.3 GB/s for fresh pages): pay it once, not per
  // checkpoint, and off the caller's thread (a Checkpointer is built, or reopened after a
  // preemption, without waiting for it). Invariant: a chunk enters free_chunks_ only once it is
  // faulted in, so a checkpoint taken early uses the chunks that are ready and waits (as
  // back-pressure) only for the ones it needs.
  //
  // Populating holds the process's mmap lock (for reading) for as long as one madvise call runs; a
  // thread that maps memory meanwhile (a thread stack, a large malloc in the training step) waits
  // for it. So a chunk is populated in 2 MiB pieces: the lock is free between them, and the training
  // thread never waits more than one piece's first touch (about 2-8 ms here) for the prefaulter.
  prefaulter_ = std::thread([this] {
    constexpr size_t kPiece = size_t(2) << 20;
    for (uint32_t i = 0; i < num_chunks_ && !stop_prefault_.load(std::memory_order_relaxed); i++) {
      for (size_t off = 0; off < chunk_size_; off += kPiece)
        prefault(chunk_ptr(i) + off, std::min(kPiece, chunk_size_ - off));
      free_chunks_.push(i);
      {
        std::lock_guard<std::mutex> g(prefault_mu_);
        prefaulted_.fetch_add(1, std::memory_order_release);
      }
      prefault_cv_.notify_all();
    }
  });
}

bool Engine::wait_prefaulted(double timeout_s) {
  std::unique_lock<std::mutex> g(prefault_mu_);
  auto done = [this] {
    return prefaulted_.load(std::memory_order_acquire) == num_chunks_ ||
           stop_prefault_.load(std::memory_order_relaxed);
  };
  if (timeout_s < 0) {
    prefault_cv_.wait(g, done);
  } else {
    prefault_cv_.wait_for(g, std::chrono::duration<double>(timeout_s), done);
  }
  return prefaulted_.load(std::memory_order_acquire) == num_chunks_;
}

Engine::~Engine() { close(); }

void Engine::close() {
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> g(prefault_mu_);  // a waiter sees the stop (wait_prefaulted)
    stop_prefault_.store(true, std::memory_order_relaxed);
  }
  prefault_cv_.notify_all();
  if (prefaulter_.joinable()) prefaulter_.join();  // before the pool can be unmapped
  tasks_.close();
  for (auto& t : writers_) t.join();
  writers_.clear();
  free_chunks_.close();
  in_place_tasks_.close();
  // Nothing reads or writes the pool any more (prefaulter and writers joined; the caller closes
  // only with no job in flight, and a copy engine detaches first): give the memory back now, not
  // when the Python object happens to be collected.
  if (pool_) ::munmap(pool_, pool_len_);
  pool_ = nullptr;
}

uint32_t Engine::free_chunks() {
  std::vector<uint32_t> ids;
  uint32_t id;
  while (free_chunks_.try_pop(id)) ids.push_back(id);
  for (uint32_t x : ids) free_chunks_.push(x);
  return static_cast<uint32_t>(ids.size());
}

std::shared_ptr<Job> Engine::begin(std::shared_ptr<Store> store, uint32_t slot,
                                   std::vector<ArraySource> sources, uint64_t stream_len, bool zero_meta,
                                   bool in_place, std::vector<Extent> extents) {
  if (closed_) throw std::invalid_argument("the engine is closed");
  const Header& h = store->header();
  if (slot >= h.num_slots) throw std::invalid_argument("slot out of range");
  if (stream_len % kBlock || stream_len > h.slot_capacity)
    throw std::invalid_argument("data region does not fit the slot");
  uint8_t* slot_map = nullptr;
  if (in_place && !(slot_map = store->mapped(h.slot_offset(slot), stream_len)))
    throw std::invalid_argument("in place needs an open mmap-mode store");
  if (!extents.empty()) {
    if (in_place) throw std::invalid_argument("extents and in place exclude each other");
    // Invariant: the extents tile the stream in order, block-aligned, each inside one slot's
    // region, so no write can reach a header, a meta record or another slot's bytes by accident.
    uint64_t at = 0;
    const uint64_t slots_end = h.slot_offset(h.num_slots);
    for (const Extent& x : extents) {
      if (x.stream_off != at || x.len == 0 || x.len % kBlock || x.file_off % kBlock)
        throw std::invalid_argument("extents must tile the stream in order, in whole blocks");
      if (x.file_off < h.slots_offset || x.file_off >= slots_end)
        throw std::invalid_argument("an extent lies outside the slots");
      const uint64_t s = (x.file_off - h.slots_offset) / h.slot_capacity;
      if (x.len > h.slot_offset(s) + h.slot_capacity - x.file_off)
        throw std::invalid_argument("an extent crosses the end of its slot");
      at += x.len;
    }
    if (at != stream_len) throw std::invalid_argument("extents must cover the stream exactly");
  }
  auto job = std::make_shared<Job>();
  job->extents_ = std::move(extents);
  job->slot_map_ = slot_map;
  job->engine_ = this;
  job->store_ = std::move(store);
  job->slot_ = slot;
  job->zero_meta_ = zero_meta;
  job->slot_off_ = h.slot_offset(slot);
  job->stream_len_ = stream_len;
  job->chunk_size_ = chunk_size_;
  job->nchunks_ = (stream_len + chunk_size_ - 1) / chunk_size_;
  // Invariant: regions in layout order. A zero-size array shares its offset with the array
  // after it (plan() aligns, then adds 0 bytes), so ties sort the empty one first; sorting by
  // offset alone could put it after the array it shares the offset with, and refuse a valid
  // layout (FSDP2 gives a rank empty shards of a small parameter). The sort is stable and
  // crcs() answers in the order given, whatever order the regions are in.
  std::vector<uint32_t> order(sources.size());
  for (uint32_t i = 0; i < order.size(); i++) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&sources](uint32_t a, uint32_t b) {
    const ArraySource& x = sources[a];
    const ArraySource& y = sources[b];
    return x.offset < y.offset || (x.offset == y.offset && x.nbytes < y.nbytes);
  });
  std::vector<ArraySource> sorted;
  sorted.reserve(sources.size());
  for (uint32_t i : order) sorted.push_back(std::move(sources[i]));
  sources = std::move(sorted);
  job->input_index_ = std::move(order);
  uint64_t prev_end = 0;
  for (auto& s : sources) {
    if (s.shape.size() != s.strides.size() || s.shape.size() > 64)
      throw std::invalid_argument("bad array shape/strides");
    if (s.offset < prev_end || s.nbytes > stream_len || s.offset > stream_len - s.nbytes)
      throw std::invalid_argument("array regions overlap or exceed the data region");
    prev_end = s.offset + s.nbytes;
    s.prepare();
  }
  job->srcs_ = std::move(sources);
  job->crcs_.assign(job->srcs_.size(), 0);
  job->pieces_.resize(job->nchunks_);
  for (uint32_t a = 0; a < job->srcs_.size(); a++) {
    const ArraySource& s = job->srcs_[a];
    for (uint64_t pos = s.offset, end = s.offset + s.nbytes; pos < end;) {
      uint64_t k = pos / chunk_size_;
      uint64_t stop = std::min(end, (k + 1) * chunk_size_);
      job->pieces_[k].push_back({a, pos - k * chunk_size_, stop - pos, 0});
      pos = stop;
    }
  }
  job->remaining_.store(job->nchunks_ + 1);
  if (job->nchunks_ == 0) {  // nothing to copy: the copy phase is over before it starts
    if (zero_meta) {  // no writer will: zero the meta record here, before the commit writes it
      if (int rc = job->store_->zero_meta(slot)) job->set_error(rc);
    }
    job->copied_ = true;
    job->remaining_.store(1);
    job->done(1);
  }
  return job;
}

void Job::fill_into(uint64_t k, uint8_t* chunk) const {
  const uint64_t base = k * chunk_size_;
  const uint64_t len = std::min(chunk_size_, stream_len_ - base);
  uint64_t filled = 0;  // bytes of the chunk written so far; gaps between arrays are zeroed
  for (const Piece& p : pieces_[k]) {
    if (p.chunk_off > filled) std::memset(chunk + filled, 0, p.chunk_off - filled);
    const ArraySource& s = srcs_[p.array];
    // Device engines describe their arrays by geometry only (null pointer) and fill chunks
    // themselves; reading such an array here is a bug, never a memcpy from address 0.
    if (s.ptr == nullptr && s.nbytes) throw std::logic_error("this job's arrays are on a device; its engine fills the chunks");
    uint64_t begin = base + p.chunk_off - s.offset;
    s.copy_range(begin, begin + p.len, chunk + p.chunk_off);
    filled = p.chunk_off + p.len;
  }
  if (len > filled) std::memset(chunk + filled, 0, len - filled);
}

int64_t Job::claim() {
  uint64_t k = next_.fetch_add(1);
  if (k >= nchunks_) {
    next_.store(nchunks_);  // keep it from creeping towards overflow
    return -1;
  }
  return static_cast<int64_t>(k);
}

int64_t Job::acquire_chunk(double timeout_s) {
  auto w0 = std::chrono::steady_clock::now();
  uint32_t id;
  bool ok = engine_->free_chunks_.pop(id, timeout_s);
  backpressure_ns_ += static_cast<int64_t>(seconds_since(w0) * 1e9);
  return ok ? static_cast<int64_t>(id) : -1;
}

void Job::fill(uint64_t k, uint32_t chunk) {
  auto t0 = std::chrono::steady_clock::now();
  fill_into(k, engine_->chunk_ptr(chunk));
  copy_ns_ += static_cast<int64_t>(seconds_since(t0) * 1e9);
}

uint64_t Job::chunk_len(uint64_t k) const {
  if (k >= nchunks_) throw std::out_of_range("chunk index out of range");
  return std::min(chunk_size_, stream_len_ - k * chunk_size_);
}

void Job::fill_to(uint64_t k, uint8_t* dst, uint64_t capacity) const {
  if (capacity < chunk_len(k)) throw std::length_error("fill_to: destination smaller than the chunk");
  fill_into(k, dst);
}

void Job::submit(uint64_t k, uint32_t chunk) {
  // Hand the chunk to the writers at once: persisting chunk k overlaps copying chunk k+1.
  engine_->tasks_.push(Engine::Task{shared_from_this(), k, chunk});
  filled();
}

void Job::release_chunk(uint32_t chunk) { engine_->free_chunks_.push(chunk); }

int Job::zero_meta_once() {
  if (!zero_meta_) return 0;
  std::call_once(meta_once_, [this] { meta_rc_ = store_->zero_meta(slot_); });
  return meta_rc_;
}

uint8_t* Job::in_place_chunk(uint64_t k) {
  if (!slot_map_) return nullptr;
  if (k >= nchunks_) throw std::out_of_range("chunk index out of range");
  if (int rc = zero_meta_once()) {
    skip(k, rc);
    throw NativeError(-rc, "cannot zero the slot's meta record before filling it in place");
  }
  auto w0 = std::chrono::steady_clock::now();
  uint32_t token;
  bool ok = engine_->in_place_tasks_.pop(token, -1.0);
  backpressure_ns_ += static_cast<int64_t>(seconds_since(w0) * 1e9);
  if (!ok) {  // the engine was closed under us
    skip(k, -ECANCELED);
    throw NativeError(ECANCELED, "the engine was closed during an in-place copy");
  }
  return slot_chunk(k);
}

void Job::submit_in_place(uint64_t k) {
  engine_->tasks_.push(Engine::Task{shared_from_this(), k, Engine::kInPlace});
  filled();
}

void Job::release_in_place() { engine_->in_place_tasks_.push(0); }

void Job::skip(uint64_t k, int err) {
  (void)k;
  set_error(err);
  filled();
  done(1);  // the chunk will never be written
}

void Job::filled() {
  if (filled_.fetch_add(1) + 1 != nchunks_) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    copied_ = true;
    cv_.notify_all();
  }
  done(1);  // the copy phase's reference
}

void Job::copy(uint64_t until) {
  const uint64_t last = until ? std::min(nchunks_, (until + chunk_size_ - 1) / chunk_size_) : nchunks_;
  while (next_.load() < last) {
    int64_t k = claim();
    if (k < 0) break;
    if (err_.load() != 0) {  // a write already failed: the checkpoint is lost, stop copying
      skip(static_cast<uint64_t>(k), err_.load());
      continue;
    }
    if (slot_map_) {  // in place: straight into the slot, the writers only checksum and sync
      uint8_t* dst;
      try {
        dst = in_place_chunk(static_cast<uint64_t>(k));  // skips k itself when it fails
      } catch (const NativeError&) {
        continue;
      }
      auto t0 = std::chrono::steady_clock::now();
      fill_into(static_cast<uint64_t>(k), dst);
      copy_ns_ += static_cast<int64_t>(seconds_since(t0) * 1e9);
      submit_in_place(static_cast<uint64_t>(k));
      continue;
    }
    int64_t id = acquire_chunk(-1.0);
    if (id < 0) {  // the engine was closed under us
      skip(static_cast<uint64_t>(k), -ECANCELED);
      continue;
    }
    fill(static_cast<uint64_t>(k), static_cast<uint32_t>(id));
    submit(static_cast<uint64_t>(k), static_cast<uint32_t>(id));
  }
}

bool Job::wait_copied(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [this] { return copied_; });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [this] { return copied_; });
}

void Job::write_chunk(uint64_t k, uint8_t* chunk) {
  if (err_.load() != 0) return;
  if (int rc = zero_meta_once()) {
    set_error(rc);
    return;
  }
  struct Ctx {
    std::vector<Piece>* pieces;
    const uint8_t* chunk;
  } ctx{&pieces_[k], chunk};
  // Checksums are computed while the device writes the chunk (both only read it).
  auto checksum = [](void* a) {
    auto* c = static_cast<Ctx*>(a);
    for (Piece& p : *c->pieces) p.crc = crc32c_update(0, c->chunk + p.chunk_off, p.len);
  };
  const uint64_t len = std::min(chunk_size_, stream_len_ - k * chunk_size_);
  if (extents_.empty()) {
    int rc = store_->write_data(chunk, len, slot_off_ + k * chunk_size_, checksum, &ctx);
    if (rc != 0) set_error(rc);
    return;
  }
  // Cut at the extents (block-aligned, so each piece is a valid O_DIRECT write); the checksums run
  // beside the first piece's write.
  const uint64_t base = k * chunk_size_;
  auto it = std::upper_bound(extents_.begin(), extents_.end(), base,
                             [](uint64_t v, const Extent& x) { return v < x.stream_off; });
  if (it != extents_.begin()) --it;
  bool first = true;
  for (; it != extents_.end() && it->stream_off < base + len; ++it) {
    const uint64_t lo = std::max(base, it->stream_off), hi = std::min(base + len, it->stream_off + it->len);
    if (lo >= hi) continue;
    int rc = store_->write_data(chunk + (lo - base), hi - lo, it->file_off + (lo - it->stream_off),
                                first ? +checksum : +[](void*) {}, &ctx);
    first = false;
    if (rc != 0) {
      set_error(rc);
      return;
    }
  }
}

void Job::done(uint64_t n) {
  if (remaining_.fetch_sub(n) != n) return;
  if (err_.load() == 0) {
    // Pieces of one array come in chunk order; combine their crcs in that order
    // (crc32c of the empty prefix is 0, so the first combine just takes the piece's crc).
    for (auto& chunk_pieces : pieces_)
      for (const Piece& p : chunk_pieces) crcs_[p.array] = crc32c_combine(crcs_[p.array], p.crc, p.len);
  }
  std::lock_guard<std::mutex> lk(mu_);
  finished_ = true;
  cv_.notify_all();
}

bool Job::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [this] { return finished_; });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [this] { return finished_; });
}

std::vector<uint32_t> Job::crcs() const {
  std::vector<uint32_t> out(crcs_.size());
  for (size_t i = 0; i < crcs_.size(); i++) out[input_index_[i]] = crcs_[i];
  return out;
}

void Engine::writer_loop() {
  Task t;
  while (tasks_.pop(t)) {
    if (t.chunk == kInPlace) {  // the bytes are in the slot already: checksum and sync them
      t.job->write_chunk(t.k, t.job->slot_chunk(t.k));
      in_place_tasks_.push(0);
    } else {
      t.job->write_chunk(t.k, chunk_ptr(t.chunk));
      free_chunks_.push(t.chunk);  // only after the write: the chunk was its source
    }
    t.job->done(1);
    t.job.reset();  // drop the reference before sleeping on the queue
  }
}

}  // namespace pcc
