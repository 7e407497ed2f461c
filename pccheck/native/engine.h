// The data path of a checkpoint: a fixed pool of pre-touched DRAM chunks, a CPU copy engine that
// fills them from (possibly strided) arrays, and a writer thread pool that persists each filled
// chunk at its offset in the slot and returns it to the pool. Runs without the GIL.
//
// Call order for one checkpoint (a Job):
//   job = engine.begin(store, slot, sources, stream_len)   // geometry only, no I/O
//   job->copy()        // fill chunks in order, hand each to the writers; waits for free
//                      // chunks when the pool is empty (back-pressure). Several threads may
//                      // call copy() at once: each claims the next unfilled chunk, so a thread
//                      // that needs the snapshot out of live memory *now* helps finish it.
//   job->wait(t)       // until every chunk is written (or the job failed)
//   job->crcs()        // per-array crc32c, then Store::commit
// Copy engines that fill chunks themselves (device -> pinned host memory) use the same
// claim protocol step by step: claim() -> acquire_chunk() -> (fill) -> submit().
//
// In place (begin(..., in_place=true), a kMmap store: the memory tier's tmpfs slots): copy()
// fills each chunk straight into the slot's shared mapping and the writers only checksum and sync
// it, so a snapshot costs one memcpy instead of two (source -> pool -> slot). An engine that
// receives bytes itself (a replica off the wire) asks for chunk k's place with in_place_chunk(k)
// and hands it over with submit_in_place(k). Pool chunks still work beside it (submit()).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mpmc_queue.h"
#include "store.h"

namespace pcc {

// One array's bytes, in C order, placed at `offset` in the slot's data region.
struct ArraySource {
  const uint8_t* ptr = nullptr;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint64_t itemsize = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in bytes; may be negative or 0 (broadcast)

  // Derived by prepare(): dims [d0, ndim) are C-contiguous, so the array is a sequence of
  // `nruns` runs of `run_bytes` contiguous bytes each; d0 == 0 means fully contiguous.
  size_t d0 = 0;
  uint64_t run_bytes = 0;
  void prepare();
  // Copies logical bytes [begin, end) of the array into dst.
  void copy_range(uint64_t begin, uint64_t end, uint8_t* dst) const;
};

// Faults in every page of [p, p+n) for writing (MADV_POPULATE_WRITE where the kernel has it,
// else one write per page; fresh anonymous memory stays zero). First touch is slow on these
// machines: the chunk pool pays it once, and recovery pays it ahead of its O_DIRECT reads.
void prefault(uint8_t* p, size_t n);

class Engine;

// Where a run of the stream goes in the store file when it is not the slot's own data region
// (an incremental checkpoint writes each changed array into a cell of its choosing: docs/FORMAT.md
// §14). Extents tile the stream [0, stream_len) in order; every offset and length is a multiple of
// the block size, and each lies inside one slot's region.
struct Extent {
  uint64_t stream_off = 0;
  uint64_t len = 0;
  uint64_t file_off = 0;
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  // Claims and fills chunks until none is left to claim; returns then (others may still be
  // filling theirs: wait_copied). Stops early after claiming the chunk holding byte
  // `until` - 1 of the stream when until > 0.
  void copy(uint64_t until = 0);
  bool wait_copied(double timeout_s);  // every chunk filled: the sources may change again
  bool wait(double timeout_s);         // every chunk written: ready to commit

  // Step-by-step protocol for external copy engines. claim() returns the next chunk index or
  // -1 when all are claimed; a claimed chunk MUST be either submitted or skipped.
  int64_t claim();
  int64_t acquire_chunk(double timeout_s);  // a free chunk id, -1 on timeout (back-pressure)
  void fill(uint64_t k, uint32_t chunk);    // native memcpy of chunk k from host sources
  // Copies chunk k's bytes (gaps zeroed) from host sources to dst instead of a pool chunk: the
  // CPU engine's stand-in for a device reserve. dst must hold chunk_len(k) bytes.
  void fill_to(uint64_t k, uint8_t* dst, uint64_t capacity) const;
  uint64_t chunk_len(uint64_t k) const;     // bytes of the stream in chunk k (the last is short)
  void submit(uint64_t k, uint32_t chunk);  // hands a filled chunk to the writers
  void skip(uint64_t k, int err);           // gives up chunk k (e.g. a device copy failed)
  void release_chunk(uint32_t chunk);       // returns an acquired, unsubmitted chunk to the pool
  // In-place jobs only: the address of claimed chunk k in the slot (chunk_len(k) bytes), once its
  // meta record is zeroed and a writer task is free (back-pressure: at most kInPlaceTasks chunks
  // wait for the writers). nullptr when the job is not in place; throws NativeError when zeroing
  // the meta record failed, or when the engine closed (the chunk is then skipped: the job fails).
  // The caller MUST submit_in_place(k) or skip(k) + release_in_place().
  uint8_t* in_place_chunk(uint64_t k);
  void submit_in_place(uint64_t k);         // hands chunk k, filled in the slot, to the writers
  void release_in_place();                  // gives back in_place_chunk's writer task (after skip)
  bool in_place() const { return slot_map_ != nullptr; }
  int error() const { return err_.load(); }  // 0 or a negative errno
  std::vector<uint32_t> crcs() const;  // per array in the order given; valid once finished without error
  double copy_seconds() const { return copy_ns_.load() * 1e-9; }
  // Engines that fill chunks themselves (device copies) report their copy time here.
  void add_copy_seconds(double s) { copy_ns_ += static_cast<int64_t>(s * 1e9); }
  double backpressure_seconds() const { return backpressure_ns_.load() * 1e-9; }
  uint32_t slot() const { return slot_; }
  uint64_t num_chunks() const { return nchunks_; }

 private:
  friend class Engine;
  struct Piece {
    uint32_t array;
    uint64_t chunk_off;
    uint64_t len;
    uint32_t crc;
  };
  void fill_into(uint64_t k, uint8_t* chunk) const;
  int zero_meta_once();                          // 0, or the errno of zeroing the meta record
  uint8_t* slot_chunk(uint64_t k) const { return slot_map_ + k * chunk_size_; }
  void write_chunk(uint64_t k, uint8_t* chunk);  // writer thread
  void filled();                                // one chunk left the copy phase
  void done(uint64_t n);                        // n chunks (or the copy phase) finished
  void set_error(int rc) {
    int expected = 0;
    err_.compare_exchange_strong(expected, rc);
  }

  Engine* engine_ = nullptr;
  std::shared_ptr<Store> store_;
  uint32_t slot_ = 0;
  uint64_t slot_off_ = 0;
  uint64_t stream_len_ = 0;  // data region length, a multiple of the block size
  uint64_t chunk_size_ = 0;
  uint64_t nchunks_ = 0;
  uint8_t* slot_map_ = nullptr;                // in place: the slot's data region in the store's mapping
  std::vector<Extent> extents_;                // empty: the stream goes to [slot_off_, +stream_len_)
  std::vector<ArraySource> srcs_;              // sorted by offset, non-overlapping
  std::vector<uint32_t> input_index_;          // srcs_[i] was the input_index_[i]-th array given
  std::vector<std::vector<Piece>> pieces_;     // per chunk: the array bytes it carries
  std::vector<uint32_t> crcs_;
  std::atomic<int> err_{0};
  // Invariant: with zero_meta_, no data byte of this job reaches the slot before the slot's meta
  // record was zeroed: every write_chunk and every in-place fill (copy(), in_place_chunk) passes
  // through zero_meta_once() first (call_once makes the others wait for the one that zeroes), and
  // a failed zeroing fails the job unwritten.
  bool zero_meta_ = false;
  std::once_flag meta_once_;
  int meta_rc_ = 0;
  std::atomic<uint64_t> next_{0};              // next chunk index to claim
  std::atomic<uint64_t> filled_{0};            // chunks submitted or skipped
  std::atomic<uint64_t> remaining_{0};         // chunks not yet written + 1 for the copy phase
  std::mutex mu_;
  std::condition_variable cv_;
  bool copied_ = false;
  bool finished_ = false;
  std::atomic<int64_t> copy_ns_{0}, backpressure_ns_{0};  // summed over copying threads
};

class Engine {
 public:
  // Allocates and pre-touches chunk_size * num_chunks bytes (chunk_size: a multiple of 4096),
  // once; no allocation happens per checkpoint. Starts writer_threads writers.
  Engine(uint64_t chunk_size, uint32_t num_chunks, uint32_t writer_threads);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // zero_meta: the slot came from acquire_slot(t, false); the job zeroes its meta record before
  // the first data write (docs/FORMAT.md §3), on the first writer thread to reach it.
  // extents: where each run of the stream is written (see Extent); empty: the slot's own region.
  // in_place: fill the slot's mapping directly (see the top of this file); kMmap stores only
  // (std::invalid_argument otherwise). Meant for stores whose pages are populated (tmpfs):
  // filling a file-backed mapping in place would dirty page cache inside the copy phase.
  std::shared_ptr<Job> begin(std::shared_ptr<Store> store, uint32_t slot,
                             std::vector<ArraySource> sources, uint64_t stream_len, bool zero_meta = false,
                             bool in_place = false, std::vector<Extent> extents = {});
  // Chunks filled in place that may wait for the writers at once (tokens in in_place_tasks_).
  static constexpr uint32_t kInPlaceTasks = 64;
  static constexpr uint32_t kInPlace = 0xffffffffu;  // a Task's chunk id: the bytes are in the slot
  uint64_t chunk_size() const { return chunk_size_; }
  uint32_t num_chunks() const { return num_chunks_; }
  uint32_t free_chunks();  // only meaningful while idle
  // Chunks the prefaulter has faulted in (and put in the free queue) so far; num_chunks() once done.
  uint32_t prefaulted_chunks() const { return prefaulted_.load(std::memory_order_acquire); }
  // Blocks until every chunk is faulted in (true), the engine closes, or timeout_s passes (false;
  // timeout_s < 0: no limit). Safe while jobs run: it never touches the free queue.
  bool wait_prefaulted(double timeout_s);
  uintptr_t pool_address() const { return reinterpret_cast<uintptr_t>(pool_); }
  uint64_t pool_bytes() const { return pool_len_; }
  uintptr_t chunk_address(uint32_t id) const { return pool_address() + uint64_t(id) * chunk_size_; }
  void close();            // joins the writers; call when no job is in flight

 private:
  friend class Job;
  struct Task {
    std::shared_ptr<Job> job;
    uint64_t k = 0;
    uint32_t chunk = 0;
  };
  void writer_loop();
  uint8_t* chunk_ptr(uint32_t id) { return pool_ + uint64_t(id) * chunk_size_; }

  uint64_t chunk_size_;
  uint32_t num_chunks_;
  uint8_t* pool_ = nullptr;
  size_t pool_len_ = 0;
  BlockingQueue<uint32_t> free_chunks_;
  // Invariant: tasks_ never overflows (push fails when full): a task holds either a pool chunk
  // (at most num_chunks_) or an in-place token (at most kInPlaceTasks), and tasks_ holds both.
  BlockingQueue<Task> tasks_;
  BlockingQueue<uint32_t> in_place_tasks_;
  std::vector<std::thread> writers_;
  std::thread prefaulter_;                  // faults the pool in, chunk by chunk (see the constructor)
  std::atomic<bool> stop_prefault_{false};
  // Invariant: prefaulted_ only grows, under prefault_mu_ (so a waiter cannot miss the last notify).
  std::atomic<uint32_t> prefaulted_{0};
  std::mutex prefault_mu_;
  std::condition_variable prefault_cv_;
  bool closed_ = false;
};

}  // namespace pcc
