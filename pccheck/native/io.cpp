#include "io.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace pcc::io {
namespace {

// -- recording ---------------------------------------------------------------------------------

struct Trace {
  std::atomic<bool> on{false};
  std::mutex mu;
  std::vector<TraceRecord> recs;  // guarded by mu
  int64_t clock = 0;              // guarded by mu: the next position in the global order
  uint64_t epoch = 0;             // guarded by mu: bumped by start/take, so a call that began
                                  // before them cannot write its end into the new trace
};
Trace g_trace;

// A call's handle on its record; idx < 0 when it is not recorded.
struct Token {
  int64_t idx = -1;
  uint64_t epoch = 0;
};

bool tracing() { return g_trace.on.load(std::memory_order_relaxed); }

// Appends `r` with its start position. The caller fills everything but begin/end/rc/tid.
Token trace_begin(TraceRecord&& r) {
  r.tid = static_cast<int64_t>(::syscall(SYS_gettid));
  std::lock_guard<std::mutex> lk(g_trace.mu);
  if (!g_trace.on.load(std::memory_order_relaxed)) return {};
  r.begin = g_trace.clock++;
  g_trace.recs.push_back(std::move(r));
  return {static_cast<int64_t>(g_trace.recs.size()) - 1, g_trace.epoch};
}

void trace_end(const Token& t, int rc) {
  if (t.idx < 0) return;
  std::lock_guard<std::mutex> lk(g_trace.mu);
  if (t.epoch != g_trace.epoch || static_cast<size_t>(t.idx) >= g_trace.recs.size()) return;
  TraceRecord& r = g_trace.recs[static_cast<size_t>(t.idx)];
  r.end = g_trace.clock++;
  r.rc = rc;
}

void file_id(int fd, TraceRecord* r) {
  struct stat st;
  if (::fstat(fd, &st) == 0) {
    r->dev = static_cast<uint64_t>(st.st_dev);
    r->ino = static_cast<uint64_t>(st.st_ino);
  }
}

Token trace_fd_op(uint32_t op, int fd, uint64_t off, uint64_t len, const void* data) {
  if (!tracing()) return {};
  TraceRecord r;
  r.op = op;
  file_id(fd, &r);
  r.off = off;
  r.len = len;
  if (data) r.data.assign(static_cast<const char*>(data), len);
  return trace_begin(std::move(r));
}

// The file, and the offset in it, of a mapped page: the mapping's line in /proc/self/maps.
void mapping_id(uintptr_t page, TraceRecord* r) {
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return;
  char line[4096];
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long lo, hi, pgoff, ino;
    unsigned maj, min;
    char perms[8];
    if (std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu", &lo, &hi, perms, &pgoff, &maj, &min, &ino) != 7)
      continue;
    if (page < lo || page >= hi) continue;
    if (ino != 0) {
      r->dev = static_cast<uint64_t>(makedev(maj, min));
      r->ino = ino;
      r->off = pgoff + (page - lo);
    }
    break;
  }
  std::fclose(f);
}

Token trace_msync(uintptr_t start, size_t n) {
  if (!tracing()) return {};
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t pages_len = (n + page - 1) / page * page;  // msync syncs whole pages
  TraceRecord r;
  r.op = kTraceMsync;
  mapping_id(start, &r);
  r.len = pages_len;
  // The pages as they are now. Other threads may be CASing the CHECK_ADDR word in them, so read
  // in aligned 8-byte atomic loads (the range is page aligned).
  r.data.resize(pages_len);
  const auto* src = reinterpret_cast<const uint64_t*>(start);
  for (size_t i = 0; i < pages_len / 8; i++) {
    uint64_t v = __atomic_load_n(src + i, __ATOMIC_ACQUIRE);
    std::memcpy(&r.data[i * 8], &v, 8);
  }
  return trace_begin(std::move(r));
}

}  // namespace

void trace_start() {
  std::lock_guard<std::mutex> lk(g_trace.mu);
  g_trace.recs.clear();
  g_trace.clock = 0;
  g_trace.epoch++;
  g_trace.on.store(true);
}

void trace_stop() { g_trace.on.store(false); }

std::vector<TraceRecord> trace_take() {
  std::lock_guard<std::mutex> lk(g_trace.mu);
  std::vector<TraceRecord> out;
  out.swap(g_trace.recs);
  g_trace.epoch++;
  return out;
}

namespace {

// pwrite_all without recording: the body of pwrite_all, and the synchronous path of
// pwrite_all_overlapped (which records the call itself).
int pwrite_all_impl(int fd, const void* buf, size_t len, uint64_t off) {
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

int pwrite_all(int fd, const void* buf, size_t len, uint64_t off) {
  Token t = trace_fd_op(kTracePwrite, fd, off, len, buf);
  int rc = pwrite_all_impl(fd, buf, len, off);
  trace_end(t, rc);
  return rc;
}

namespace {

int pwrite_overlapped_impl(int fd, const void* buf, size_t len, uint64_t off, void (*overlap)(void*),
                           void* arg) {
  thread_local AioContext aio;
  size_t first = len;
  int inj;
  do {
    inj = injected(kPwrite);  // an interrupted submission is retried, as in pwrite_all
  } while (inj == EINTR);
  if (inj > 0) return -inj;
  if (inj == kShortWrite && len >= 2 * 4096) first = (len / 2) & ~size_t(4095);
  if (!aio.ok) {
    int rc = pwrite_all_impl(fd, buf, len, off);
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
    int rc = pwrite_all_impl(fd, buf, len, off);
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
  return done < len ? pwrite_all_impl(fd, static_cast<const char*>(buf) + done, len - done, off + done) : 0;
}

}  // namespace

int pwrite_all_overlapped(int fd, const void* buf, size_t len, uint64_t off, void (*overlap)(void*), void* arg) {
  // Recorded from before the submission (the device may start writing at once) until the
  // completion and any synchronous remainder: the whole call is one write in the trace.
  Token t = trace_fd_op(kTracePwrite, fd, off, len, buf);
  int rc = pwrite_overlapped_impl(fd, buf, len, off, overlap, arg);
  trace_end(t, rc);
  return rc;
}

namespace {

int fdatasync_impl(int fd) {
  for (;;) {
    int inj = injected(kFdatasync);
    if (inj > 0 && inj != EINTR) return -inj;
    if (inj == EINTR) continue;
    if (::fdatasync(fd) == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}

}  // namespace

int fdatasync_fd(int fd) {
  Token t = trace_fd_op(kTraceFdatasync, fd, 0, 0, nullptr);
  int rc = fdatasync_impl(fd);
  trace_end(t, rc);
  return rc;
}

namespace {

int msync_impl(uintptr_t start, size_t n) {
  for (;;) {
    int inj = injected(kMsync);
    if (inj > 0 && inj != EINTR) return -inj;
    if (inj == EINTR) continue;
    if (::msync(reinterpret_cast<void*>(start), n, MS_SYNC) == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}

int fallocate_impl(int fd, uint64_t off, uint64_t len) {
  int inj = injected(kFallocate);
  if (inj > 0 && inj != EINTR) return -inj;
  int rc;
  do {
    rc = ::posix_fallocate(fd, static_cast<off_t>(off), static_cast<off_t>(len));
  } while (rc == EINTR);
  return -rc;
}

}  // namespace

int msync_range(void* addr, size_t len) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t start = a & ~(page - 1);
  size_t n = len + (a - start);
  Token t = trace_msync(start, n);
  int rc = msync_impl(start, n);
  trace_end(t, rc);
  return rc;
}

int fallocate_fd(int fd, uint64_t off, uint64_t len) {
  Token t = trace_fd_op(kTraceFallocate, fd, off, len, nullptr);
  int rc = fallocate_impl(fd, off, len);
  trace_end(t, rc);
  return rc;
}

int check_pmem_drain() {
  int inj = injected(kPmemDrain);
  return (inj > 0 && inj != EINTR) ? -inj : 0;
}

}  // namespace pcc::io
