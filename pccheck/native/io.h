// Every system call that writes or syncs the store goes through here, so that tests can fail
// the n-th one (SQLite's I/O-error loop): ENOSPC, EIO, EINTR or a short write, once or from then on.
// All functions return 0 on success or a negative errno; none of them throws.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace pcc::io {

enum Op : uint32_t {
  kPwrite = 1u << 0,
  kFdatasync = 1u << 1,
  kMsync = 1u << 2,
  kFallocate = 1u << 3,
  kPmemDrain = 1u << 4,  // the PMEM writer's per-chunk fence: a failure here models a media error
  kAll = 0xFFFFFFFFu,
};

// Special `err` value: the n-th pwrite writes only half of what it was asked, like a real short write.
constexpr int kShortWrite = -1;

// Arms the fault: the nth (1-based) call among the ops in `op_mask` fails with `err`
// (or every call from the nth on when `persistent`). EINTR and short writes are retried by the
// callers, so they must not surface as errors.
void set_fault(uint32_t op_mask, int64_t nth, int err, bool persistent);
void clear_fault();
// Calls among the armed mask since set_fault (so a test knows when n passed the last call site).
int64_t fault_calls();

// Writes all of buf at off: retries EINTR and continues after short writes.
int pwrite_all(int fd, const void* buf, size_t len, uint64_t off);
// Writes all of buf at off (an O_DIRECT fd) and runs `overlap` on this thread while the write is
// in flight (Linux AIO), so CPU work such as checksumming does not leave the device idle.
// Where AIO is unavailable the write is synchronous and `overlap` runs after it.
int pwrite_all_overlapped(int fd, const void* buf, size_t len, uint64_t off, void (*overlap)(void*), void* arg);
int fdatasync_fd(int fd);
int msync_range(void* addr, size_t len);  // addr need not be page aligned; MS_SYNC
int fallocate_fd(int fd, uint64_t off, uint64_t len);
// Returns the injected error for a PMEM fence, or 0; the fence itself is done by the caller.
int check_pmem_drain();

}  // namespace pcc::io
