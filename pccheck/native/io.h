// Every system call that writes or syncs the store goes through here, so that tests can
//  - fail the n-th one (SQLite's I/O-error loop): ENOSPC, EIO, EINTR or a short write, once or
//    from then on (faults.h), and
//  - record every one of them, with its file, offset, length and bytes, in one global order
//    (trace_start / trace_take), so a power-loss simulator can replay any prefix of the writes
//    with unsynced ones dropped or torn (tests/_crashsim.py; ALICE / CrashMonkey style).
// All I/O functions return 0 on success or a negative errno; none of them throws.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "faults.h"

namespace pcc::io {

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

// -- recording (tests only) ------------------------------------------------------------------------
//
// While recording is on, every pwrite_all, pwrite_all_overlapped, fdatasync_fd, msync_range and
// fallocate_fd call appends one TraceRecord. Its `begin` is taken when the call starts (before any
// byte can reach the file) and its `end` when it returns (after the kernel completed it), from one
// counter shared by all threads, so the records give a total order of call starts and ends:
//   - a pwrite may be on the disk from `begin` on, in part or whole, and is certainly there only
//     once an fdatasync of the same file that began after the pwrite's `end` has ended;
//   - an msync's `data` is the synced pages as they were in memory at `begin`: once it ended the
//     disk holds that or a later version of them (writeback may also write them at any time).
// Recording serialises the calls' bookkeeping on one mutex; when off it costs one atomic load.
enum TraceOp : uint32_t {
  kTracePwrite = 1,
  kTraceFdatasync = 2,
  kTraceMsync = 3,
  kTraceFallocate = 4,
};

struct TraceRecord {
  uint32_t op = 0;        // TraceOp
  int64_t tid = 0;        // the calling thread (gettid)
  uint64_t dev = 0;       // st_dev / st_ino of the file (msync: of the mapping, from /proc/self/maps;
  uint64_t ino = 0;       //   0 when the address is not a file mapping)
  uint64_t off = 0;       // file offset (msync: of the first synced page)
  uint64_t len = 0;       // bytes (msync: of the synced pages)
  std::string data;       // pwrite: the bytes written; msync: the synced pages at `begin`; else ""
  int64_t begin = -1;     // position of the call's start in the global order
  int64_t end = -1;       // position of its return; -1 while still running when the trace is taken
  int rc = 0;             // the call's result: 0 or a negative errno
};

// Clears the trace and starts recording.
void trace_start();
// Stops recording; calls still running finish their records.
void trace_stop();
// Returns the records so far (in `begin` order) and clears the trace.
std::vector<TraceRecord> trace_take();

}  // namespace pcc::io
