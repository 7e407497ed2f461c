#include "io.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include <atomic>
#include <cstdint>

namespace pcc::io {
namespace {

struct Fault {
  std::atomic<uint32_t> mask{0};
  std::atomic<int64_t> nth{0};
  std::atomic<int> err{0};
  std::atomic<bool> persistent{false};
  std::atomic<int64_t> calls{0};
};
Fault g_fault;

// Returns the error to inject for this call of `op`, or 0.
int injected(Op op) {
  if (!(g_fault.mask.load(std::memory_order_acquire) & op)) return 0;
  int64_t n = g_fault.calls.fetch_add(1) + 1;
  int64_t nth = g_fault.nth.load();
  if (n == nth || (g_fault.persistent.load() && n > nth)) return g_fault.err.load();
  return 0;
}

}  // namespace

void set_fault(uint32_t op_mask, int64_t nth, int err, bool persistent) {
  g_fault.mask.store(0);
  g_fault.calls.store(0);
  g_fault.nth.store(nth);
  g_fault.err.store(err);
  g_fault.persistent.store(persistent);
  g_fault.mask.store(op_mask, std::memory_order_release);
}

void clear_fault() { g_fault.mask.store(0); }

int64_t fault_calls() { return g_fault.calls.load(); }

int pwrite_all(int fd, const void* buf, size_t len, uint64_t off) {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n;
    int inj = injected(kPwrite);
    if (inj == kShortWrite && len >= 2 * 4096) {
      // Half, rounded to the O_DIRECT block, so the remainder stays aligned.
      n = ::pwrite(fd, p, (len / 2) & ~size_t(4095), static_cast<off_t>(off));
    } else if (inj > 0) {
      errno = inj;
      n = -1;
    } else {
      n = ::pwrite(fd, p, len, static_cast<off_t>(off));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) return -EIO;  // no progress on a regular file: treat as a device error
    p += n;
    off += static_cast<uint64_t>(n);
    len -= static_cast<size_t>(n);
  }
  return 0;
}

namespace {

// One kernel AIO context per writer thread, created on first use, destroyed at thread exit.
struct AioContext {
  aio_context_t ctx = 0;
  bool ok = false;
  AioContext() { ok = ::syscall(SYS_io_setup, 1, &ctx) == 0; }
  ~AioContext() {
    if (ok) ::syscall(SYS_io_destroy, ctx);
  }
};

}  // namespace

int pwrite_all_overlapped(int fd, const void* buf, size_t len, uint64_t off, void (*overlap)(void*), void* arg) {
  thread_local AioContext aio;
  size_t first = len;
  int inj;
  do {
    inj = injected(kPwrite);  // an interrupted submission is retried, as in pwrite_all
  } while (inj == EINTR);
  if (inj > 0) return -inj;
  if (inj == kShortWrite && len >= 2 * 4096) first = (len / 2) & ~size_t(4095);
  if (!aio.ok) {
    int rc = pwrite_all(fd, buf, len, off);
    if (rc == 0) overlap(arg);
    return rc;
  }
  struct iocb cb;
  std::memset(&cb, 0, sizeof(cb));
  cb.aio_lio_opcode = IOCB_CMD_PWRITE;
  cb.aio_fildes = static_cast<uint32_t>(fd);
  cb.aio_buf = reinterpret_cast<uint64_t>(buf);
  cb.aio_nbytes = first;
  cb.aio_offset = static_cast<int64_t>(off);
  struct iocb* cbs[1] = {&cb};
  long n;
  do {
    n = ::syscall(SYS_io_submit, aio.ctx, 1, cbs);
  } while (n < 0 && (errno == EINTR || errno == EAGAIN));
  if (n != 1) {  // could not submit at all: write synchronously instead
    int rc = pwrite_all(fd, buf, len, off);
    if (rc == 0) overlap(arg);
    return rc;
  }
  overlap(arg);  // the device works on the write meanwhile
  struct io_event ev;
  do {
    n = ::syscall(SYS_io_getevents, aio.ctx, 1, 1, &ev, nullptr);
  } while (n < 0 && errno == EINTR);
  if (n != 1) return -errno;
  if (ev.res < 0) return static_cast<int>(ev.res);
  size_t done = static_cast<size_t>(ev.res);
  if (done == 0 && len > 0) return -EIO;
  // A short completion continues synchronously, like pwrite_all.
  return done < len ? pwrite_all(fd, static_cast<const char*>(buf) + done, len - done, off + done) : 0;
}

int fdatasync_fd(int fd) {
  for (;;) {
    int inj = injected(kFdatasync);
    if (inj > 0 && inj != EINTR) return -inj;
    if (inj == EINTR) continue;
    if (::fdatasync(fd) == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}

int msync_range(void* addr, size_t len) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t start = a & ~(page - 1);
  size_t n = len + (a - start);
  for (;;) {
    int inj = injected(kMsync);
    if (inj > 0 && inj != EINTR) return -inj;
    if (inj == EINTR) continue;
    if (::msync(reinterpret_cast<void*>(start), n, MS_SYNC) == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}

int fallocate_fd(int fd, uint64_t off, uint64_t len) {
  int inj = injected(kFallocate);
  if (inj > 0 && inj != EINTR) return -inj;
  int rc;
  do {
    rc = ::posix_fallocate(fd, static_cast<off_t>(off), static_cast<off_t>(len));
  } while (rc == EINTR);
  return -rc;
}

int check_pmem_drain() {
  int inj = injected(kPmemDrain);
  return (inj > 0 && inj != EINTR) ? -inj : 0;
}

}  // namespace pcc::io
