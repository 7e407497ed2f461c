// Fault injection for the store's I/O calls (tests only): the n-th call among chosen operations
// fails with a chosen error, once or from then on (SQLite's I/O-error loop). io.cpp asks
// injected() at every call site; the bindings (binding_io.cpp) arm and clear it. When disarmed it
// costs one atomic load per call.
#pragma once
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
// For io.cpp's call sites: the error to inject for this call of `op`, or 0.
int injected(Op op);

}  // namespace pcc::io
