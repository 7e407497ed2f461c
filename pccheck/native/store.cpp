#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>

#include "crc32c.h"
#include "io.h"
#include "ntcopy.h"

namespace pcc {
namespace {

#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // Linux 5.14; older kernels refuse it with EINVAL
#endif

struct AlignedBuf {
  uint8_t* p = nullptr;
  explicit AlignedBuf(size_t n) {
    if (posix_memalign(reinterpret_cast<void**>(&p), kBlock, n) != 0) p = nullptr;
    else std::memset(p, 0, n);
  }
  ~AlignedBuf() { std::free(p); }
};

uint64_t round_up(uint64_t v) { return (v + kBlock - 1) / kBlock * kBlock; }

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

void create_store(const std::string& path, uint32_t num_slots, uint64_t slot_capacity,
                  uint64_t generation, uint32_t world_size, uint32_t rank) {
  Header h;
  h.num_slots = num_slots;
  h.slot_capacity = slot_capacity;
  h.slots_offset = (1 + uint64_t(num_slots)) * kBlock;
  h.generation = generation;
  h.world_size = world_size;
  h.rank = rank;
  h.created_unix_ns = now_ns();
  AlignedBuf block(kBlock);
  if (!block.p) throw NativeError(ENOMEM, "out of memory");
  pack_header(h, block.p);
  {  // validate what we are about to write with the same parser recovery uses
    Header check;
    std::string why = parse_header(block.p, kBlock, &check);
    if (!why.empty()) throw std::invalid_argument("invalid store geometry: " + why);
  }
  int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0644);
  if (fd < 0) throw NativeError(errno, "cannot create store file " + path);
  int rc = io::fallocate_fd(fd, 0, h.file_size());  // meta records and slots read as zeros
  if (rc == 0) rc = io::pwrite_all(fd, block.p, kBlock, 0);
  if (rc == 0) rc = io::fdatasync_fd(fd);
  ::close(fd);
  if (rc != 0) {
    ::unlink(path.c_str());
    throw NativeError(-rc, "cannot preallocate store file " + path + " (" +
                               std::to_string(h.file_size()) + " bytes)");
  }
}

Store::Store(const std::string& path, Mode mode) : path_(path), mode_(mode), free_(kMaxSlots + 1) {
  int flags = O_RDWR | O_CLOEXEC | (mode == Mode::kODirect ? O_DIRECT : 0);
  fd_ = ::open(path.c_str(), flags);
  if (fd_ < 0) throw NativeError(errno, "cannot open store file " + path);
  AlignedBuf block(kBlock);
  ssize_t n = block.p ? ::pread(fd_, block.p, kBlock, 0) : -1;
  if (n != static_cast<ssize_t>(kBlock)) {
    int e = n < 0 ? errno : EIO;
    close();
    throw NativeError(e, "cannot read the header of " + path);
  }
  std::string why = parse_header(block.p, kBlock, &header_);
  struct stat st;
  if (why.empty() && (::fstat(fd_, &st) != 0 || uint64_t(st.st_size) < header_.file_size()))
    why = "file is shorter than its geometry";
  if (!why.empty()) {
    close();
    throw std::invalid_argument(path + ": " + why);
  }
  int err = 0;
  if (mode == Mode::kODirect) {
    map_len_ = kBlock;  // only the commit word's block; data and records go through O_DIRECT
    void* p = ::mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    map_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
    if (!map_) err = -errno;
  } else if (mode == Mode::kMmap) {
    map_len_ = header_.file_size();
    void* p = ::mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    map_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
    if (!map_) err = -errno;
  } else {
    map_len_ = header_.file_size();
    map_ = static_cast<uint8_t*>(pmem_map(fd_, map_len_, &is_pmem_, &err));
  }
  if (!map_) {
    close();
    throw NativeError(-err, "cannot map store file " + path);
  }
  word_ = reinterpret_cast<std::atomic<uint64_t>*>(map_ + kCheckAddrOffset);
}

Store::~Store() { close(); }

uint64_t Store::populate() {
  if (mode_ != Mode::kMmap) return 0;
  constexpr size_t kPiece = size_t(2) << 20;  // the lock (and the process's mmap lock) held briefly
  uint64_t done = 0;
  for (size_t off = 0;; off += kPiece) {
    std::lock_guard<std::mutex> g(populate_mu_);
    if (closing_.load(std::memory_order_relaxed) || !map_ || off >= map_len_) break;
    size_t n = std::min(kPiece, map_len_ - off);
    // Only the kernel's populate, never engine.h prefault's fallback: that one rewrites a byte
    // per page, which beside a writer (or the CHECK_ADDR CAS) could put back a stale byte.
    // Where the kernel lacks MADV_POPULATE_WRITE the writers fault the pages in themselves.
    if (::madvise(map_ + off, n, kPopulateWrite) != 0) break;
    done += n;
  }
  return done;
}

void Store::close() {
  free_.close();
  closing_.store(true, std::memory_order_relaxed);
  std::lock_guard<std::mutex> g(populate_mu_);  // a populate() piece in progress ends first
  if (map_) {
    if (mode_ == Mode::kPmem) pmem_unmap(map_, map_len_);
    else ::munmap(map_, map_len_);
    map_ = nullptr;
    word_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

int Store::init(uint64_t word, uint64_t next_counter, const std::vector<uint32_t>& protect) {
  counter_.store(next_counter);
  if (word_->load() != word) {
    word_->store(word);
    if (int rc = barrier_word()) return rc;
  }
  bool has_latest = word != 0;
  std::lock_guard<std::mutex> lk(pending_mu_);
  for (uint32_t s = 0; s < header_.num_slots; s++) {
    if (has_latest && s == word_slot(word)) continue;
    bool held = false;
    for (uint32_t p : protect) held |= p == s;
    if (held) held_.push_back(s);
    else free_.push(s);
  }
  return 0;
}

void Store::set_hold_replaced(bool hold) {
  std::lock_guard<std::mutex> lk(pending_mu_);
  hold_replaced_ = hold;
}

std::vector<uint32_t> Store::take_held() {
  std::lock_guard<std::mutex> lk(pending_mu_);
  std::vector<uint32_t> out;
  out.swap(held_);
  return out;
}

void Store::settle_pending_locked() {
  // Called after a successful word barrier: the durable word names a newer slot than any pending
  // one, so they are free to reuse - unless the caller holds replaced slots (distributed mode:
  // one may be the globally committed checkpoint), in which case the caller decides.
  for (uint32_t s : pending_) {
    if (hold_replaced_) held_.push_back(s);
    else free_.push(s);
  }
  pending_.clear();
}

int Store::settle_word() {
  // The word in memory is the truth: persisting it again is always safe (acquire_slot's retry).
  int rc = barrier_word();
  if (rc == 0) release_pending();
  return rc;
}

int Store::zero_meta(uint32_t slot) {
  uint8_t zeros[64] = {0};
  // Only the magic and crc need to go; a short record is padded with zeros to a full block.
  return write_record(header_.meta_offset(slot), zeros, sizeof(zeros));
}

int Store::acquire_slot(double timeout_s, bool zero_meta) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
  uint32_t slot;
  for (;;) {
    if (free_.try_pop(slot)) break;
    // Nothing free. If a failed barrier left slots pending, retry the barrier: the word in
    // memory is the truth, so persisting it again is always safe, and success frees them.
    bool has_pending;
    {
      std::lock_guard<std::mutex> lk(pending_mu_);
      has_pending = !pending_.empty();
    }
    if (has_pending) {
      if (int rc = barrier_word()) return rc;
      release_pending();
      continue;
    }
    // Sleep on the queue in short slices, so slots that become pending meanwhile are noticed.
    double left = timeout_s < 0 ? 0.05 : std::chrono::duration<double>(deadline - clock::now()).count();
    if (left <= 0) return -ETIMEDOUT;
    if (free_.pop(slot, left < 0.05 ? left : 0.05)) break;
    if (free_.closed()) return -ECANCELED;
  }
  if (zero_meta) {
    int rc = this->zero_meta(slot);
    if (rc != 0) {
      free_.push(slot);
      return rc;
    }
  }
  return static_cast<int>(slot);
}

void Store::release_slot(uint32_t slot) { free_.push(slot); }

uint8_t* Store::mapped(uint64_t file_off, uint64_t len) const {
  if (mode_ != Mode::kMmap || !map_ || file_off > map_len_ || len > map_len_ - file_off) return nullptr;
  return map_ + file_off;
}

int Store::write_data(const uint8_t* buf, size_t len, uint64_t file_off, void (*overlap)(void*), void* arg) {
  int rc = -EINVAL;
  switch (mode_) {
    case Mode::kODirect:
      return io::pwrite_all_overlapped(fd_, buf, len, file_off, overlap, arg);
    case Mode::kMmap:
      if (buf != map_ + file_off) std::memcpy(map_ + file_off, buf, len);
      rc = io::msync_range(map_ + file_off, len);
      break;
    case Mode::kPmem:
      pmem_copy_nodrain(map_ + file_off, buf, len);
      pmem_fence();  // per-CPU: each writer thread drains its own streaming stores
      rc = io::check_pmem_drain();
      break;
  }
  if (rc == 0) overlap(arg);
  return rc;
}

int Store::write_record(uint64_t file_off, const void* data, size_t len) {
  uint64_t padded = round_up(len);
  if (mode_ == Mode::kODirect) {
    AlignedBuf buf(padded);
    if (!buf.p) return -ENOMEM;
    std::memcpy(buf.p, data, len);
    return io::pwrite_all(fd_, buf.p, padded, file_off);
  }
  std::memcpy(map_ + file_off, data, len);
  std::memset(map_ + file_off + len, 0, padded - len);
  if (mode_ == Mode::kPmem) pmem_persist_range(map_ + file_off, padded);
  return 0;
}

int Store::sync_records() {
  if (mode_ == Mode::kPmem) return io::check_pmem_drain();  // records were persisted as written
  // fdatasync flushes the device cache after O_DIRECT writes, and writes back dirty mapped pages.
  return io::fdatasync_fd(fd_);
}

int Store::barrier_word() {
  if (mode_ == Mode::kPmem) {
    pmem_persist_range(word_, sizeof(uint64_t));
    return io::check_pmem_drain();
  }
  return io::msync_range(word_, sizeof(uint64_t));
}

void Store::release_pending() {
  std::lock_guard<std::mutex> lk(pending_mu_);
  settle_pending_locked();
}

int Store::commit(uint32_t slot, uint64_t counter, int64_t step, const std::string& manifest,
                  uint64_t manifest_offset, uint64_t data_len) {
  if (counter == 0 || counter > kMaxCounter || manifest_offset % kBlock || data_len > manifest_offset ||
      manifest_offset > header_.slot_capacity ||
      round_up(manifest.size()) > header_.slot_capacity - manifest_offset) {
    release_slot(slot);
    return -EOVERFLOW;
  }
  if (int rc = write_and_sync_records(slot, counter, step, manifest, manifest_offset, data_len)) {
    release_slot(slot);  // step 3 failed: never named by CHECK_ADDR, safe to reuse
    return rc;
  }
  return advance_word(slot, counter);
}

// FORMAT.md §4 step 3: the manifest, then the meta record, then ONE barrier for data + manifest +
// meta. A meta record that reaches the disk without its data is harmless: CHECK_ADDR never names
// it, and recovery's fallback scan rejects it by the array checksums.
int Store::write_and_sync_records(uint32_t slot, uint64_t counter, int64_t step, const std::string& manifest,
                                  uint64_t manifest_offset, uint64_t data_len) {
  Meta m;
  m.slot = slot;
  m.counter = counter;
  m.step = step;
  m.data_len = data_len;
  m.manifest_offset = manifest_offset;
  m.manifest_len = manifest.size();
  m.manifest_crc = crc32c_update(0, manifest.data(), manifest.size());
  m.unix_ns = now_ns();
  uint8_t block[kBlock];
  pack_meta(m, block);
  int rc = write_record(header_.slot_offset(slot) + manifest_offset, manifest.data(), manifest.size());
  if (rc == 0) rc = write_record(header_.meta_offset(slot), block, kBlock);
  if (rc == 0) rc = sync_records();
  return rc;
}

// FORMAT.md §4 steps 4-5: CAS CHECK_ADDR from the value last seen to ours, only ever forward, then a
// barrier on the word; on success the replaced slot is freed. Returns 1 (ours is the durable latest),
// 0 (a newer checkpoint had won) or a negative errno (the word's barrier failed).
int Store::advance_word(uint32_t slot, uint64_t counter) {
  const uint64_t mine = make_word(counter, slot);
  uint64_t cur = word_->load(std::memory_order_acquire);
  for (;;) {
    if (word_counter(cur) > counter) {
      // A newer checkpoint already won (§4 step 5). Make sure it is durable, then our slot, which
      // CHECK_ADDR never named, goes back to the free queue.
      int rc = barrier_word();
      if (rc == 0) release_pending();
      free_.push(slot);
      return rc < 0 ? rc : 0;
    }
    if (word_->compare_exchange_weak(cur, mine, std::memory_order_acq_rel, std::memory_order_acquire)) {
      int rc = barrier_word();
      std::lock_guard<std::mutex> lk(pending_mu_);
      if (cur != 0) pending_.push_back(word_slot(cur));
      if (rc != 0) return rc;  // old slot stays pending: the durable word may still name it
      // Invariant: the slot CHECK_ADDR names is never freed. `cur` was replaced by `mine` and
      // `mine` is durable, so every pending slot is now safe to reuse.
      settle_pending_locked();
      return 1;
    }
    // CAS failed: `cur` now holds the current word; loop re-checks whether it is newer.
  }
}

std::vector<uint32_t> Store::free_slots() {
  std::vector<uint32_t> out;
  uint32_t s;
  while (free_.try_pop(s)) out.push_back(s);
  for (uint32_t x : out) free_.push(x);
  return out;
}

}  // namespace pcc
