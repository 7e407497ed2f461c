// The slot store: one preallocated file with a header, N+1 meta records and N+1 slots
// (docs/FORMAT.md), the free-slot queue, the global counter and the commit protocol (FORMAT.md §4,
// steps 1-5). Errors are negative errnos, or NativeError exceptions from constructors.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "format.h"
#include "mpmc_queue.h"

namespace pcc {

// An OS error with its errno, raised to Python as OSError.
struct NativeError : std::runtime_error {
  int err;
  NativeError(int e, const std::string& what) : std::runtime_error(what), err(e) {}
};

enum class Mode {
  kODirect,  // data: pwrite(O_DIRECT) of aligned chunks; durability: fdatasync
  kMmap,     // data: memcpy into a shared mapping + msync of the written range
  kPmem,     // data: non-temporal copy + per-thread drain; records: pmem_persist
};

// Creates a new store file at `path` (which must not exist): header, zeroed meta records and
// preallocated (posix_fallocate) slots, made durable with fdatasync. The caller renames it into
// place and fsyncs the directory.
void create_store(const std::string& path, uint32_t num_slots, uint64_t slot_capacity,
                  uint64_t generation, uint32_t world_size, uint32_t rank);

class Store {
 public:
  // Opens an existing store for writing. Throws NativeError (EINVAL for O_DIRECT on a file
  // system that lacks it, e.g. tmpfs) or std::invalid_argument for a bad header.
  Store(const std::string& path, Mode mode);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const Header& header() const { return header_; }
  Mode mode() const { return mode_; }
  bool is_pmem() const { return is_pmem_; }
  uint64_t check_word() const { return word_->load(std::memory_order_acquire); }

  // Called once after open, before any checkpoint. Points CHECK_ADDR at `word` (the recovered
  // latest, which the caller validated; 0 for none) and persists it if it changed, then fills
  // the free queue with every other slot. Invariant established here and kept by commit():
  // the slot CHECK_ADDR names is never in the free queue.
  // Slots in `protect` are neither free nor latest: they go to the held list (see take_held).
  int init(uint64_t word, uint64_t next_counter, const std::vector<uint32_t>& protect = {});

  // Distributed mode: a slot replaced in CHECK_ADDR is not freed but held, because it may hold
  // the globally committed checkpoint that every rank must keep (docs/FORMAT.md §8). The caller
  // collects held slots with take_held() and frees them with release_slot() once a newer
  // global step is recorded.
  void set_hold_replaced(bool hold);
  // After a commit whose word barrier failed (the CAS happened in memory): persists the word in
  // memory again and, on success, frees the slots it replaced, as acquire_slot does when no slot is
  // free. Returns 0 (the word in memory is durable) or a negative errno.
  int settle_word();
  std::vector<uint32_t> take_held();

  // §4 step 1: a fresh counter (atomic add). Invariant: counters stay below 2^56 (kMaxCounter),
  // since the word packs (counter << 8) | slot; commit() refuses one above it (-EOVERFLOW), and at
  // a checkpoint per microsecond the counter would take 2,000 years to get there.
  uint64_t next_counter() { return counter_.fetch_add(1); }
  // §4 step 2: a free slot, -ETIMEDOUT after timeout_s (< 0: wait forever). With
  // `zero_meta`, its meta record is zeroed first so a half-rewritten slot can never pass for its
  // previous checkpoint (a failure there is returned as a negative errno). Without it the caller
  // must call zero_meta(slot) before the slot's first data write (the engine's Job does, from a
  // writer thread, so a disk busy with the previous checkpoint never delays the training thread).
  int acquire_slot(double timeout_s, bool zero_meta = true);
  // Zeroes `slot`'s meta record (docs/FORMAT.md §3): block-padded, not synced, like the data.
  int zero_meta(uint32_t slot);
  // Returns a slot whose checkpoint failed before its commit.
  void release_slot(uint32_t slot);

  // kMmap only: the address of file bytes [file_off, file_off + len) in the store's shared mapping,
  // or nullptr (another mode, a range beyond the file, or a closed store). A job that fills a slot
  // in place writes there (Engine::begin's in_place); the store must outlive that job's writes.
  uint8_t* mapped(uint64_t file_off, uint64_t len) const;

  // Writes a filled chunk at an absolute file offset, durably for kMmap and kPmem; kODirect
  // relies on the fdatasync in commit(). Called by writer threads, concurrently. kMmap: a `buf`
  // that already is the destination (mapped(file_off, len), a chunk filled in place) is not
  // copied again, only synced and checksummed.
  // `overlap(arg)` runs exactly once on success, while the write is in flight where the mode
  // allows it (kODirect: kernel AIO), else after it.
  int write_data(const uint8_t* buf, size_t len, uint64_t file_off, void (*overlap)(void*), void* arg);

  // §4 steps 3-5 for a slot whose chunks are all written: manifest + meta record, one
  // durability barrier, then CAS on CHECK_ADDR and its persistence barrier. Returns 1 when this
  // checkpoint became the durable latest, 0 when a newer one had already won, or a negative
  // errno (the slot is then released, and the previous latest stays untouched and loadable).
  int commit(uint32_t slot, uint64_t counter, int64_t step, const std::string& manifest,
             uint64_t manifest_offset, uint64_t data_len);

  // Free slots, in queue order. Only meaningful while no checkpoint is in flight.
  std::vector<uint32_t> free_slots();

  // kMmap only (a no-op otherwise): faults every page of the mapping in, writable, in 2 MiB
  // pieces (MADV_POPULATE_WRITE only: nothing is ever rewritten), so the writers' memcpy into
  // the slots never takes a page fault. Meant for a store on tmpfs (the memory tier): there each
  // first write of a page allocates and zeroes it inside the fault, which cost the loop 0.1-2
  // CPU-s per iteration for the first 6-9 checkpoints when unpopulated; on a disk-backed file it
  // would dirty every page. Contents are kept (the kernel's populate writes nothing). Returns the
  // bytes populated (less when close() came first; 0 where the kernel has no
  // MADV_POPULATE_WRITE). Safe beside the writers and beside close() (populate_mu_).
  uint64_t populate();
  void close();

 private:
  int write_record(uint64_t file_off, const void* data, size_t len);  // block-padded, not synced
  int sync_records();        // makes data + manifest + meta durable (before the CAS)
  int barrier_word();        // makes the CHECK_ADDR word durable (after the CAS)
  int write_and_sync_records(uint32_t slot, uint64_t counter, int64_t step, const std::string& manifest,
                             uint64_t manifest_offset, uint64_t data_len);  // §4 step 3
  int advance_word(uint32_t slot, uint64_t counter);                         // §4 steps 4-5
  void release_pending();    // after a successful barrier_word
  void settle_pending_locked();  // pending_ -> free_ (or held_); pending_mu_ held

  std::string path_;
  Mode mode_;
  int fd_ = -1;
  Header header_;
  uint8_t* map_ = nullptr;   // block 0 (kODirect) or the whole file (kMmap, kPmem)
  size_t map_len_ = 0;
  bool is_pmem_ = false;
  // Invariant: map_ is unmapped only under populate_mu_, and populate() touches map_ only under it
  // with closing_ false, so a populate thread never touches an unmapped range.
  std::mutex populate_mu_;
  std::atomic<bool> closing_{false};
  std::atomic<uint64_t>* word_ = nullptr;  // CHECK_ADDR, inside map_
  std::atomic<uint64_t> counter_{1};
  // Invariant (the slot partition): each slot is in exactly one of these states: free (in free_),
  // pending (in pending_: replaced in CHECK_ADDR, its replacement's barrier failed), held (in
  // held_: kept for the caller, distributed mode), in flight (acquired, not yet committed or
  // released), or named by the word. acquire_slot moves free -> in flight; commit moves in flight ->
  // named (and the slot it replaced -> pending -> free or held) or, if a newer one won or it
  // failed, -> free; release_slot moves in flight or held -> free.
  BlockingQueue<uint32_t> free_;
  std::mutex pending_mu_;
  // Slots replaced in CHECK_ADDR whose replacement is not yet known durable (its barrier failed):
  // the durable word may still name them, so they are freed only after a later barrier succeeds.
  std::vector<uint32_t> pending_;
  bool hold_replaced_ = false;  // guarded by pending_mu_
  std::vector<uint32_t> held_;  // replaced slots kept for the caller (hold_replaced_)
};

}  // namespace pcc
