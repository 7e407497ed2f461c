#include "faults.h"

#include <atomic>

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

}  // namespace

int injected(Op op) {
  if (!(g_fault.mask.load(std::memory_order_acquire) & op)) return 0;
  int64_t n = g_fault.calls.fetch_add(1) + 1;
  int64_t nth = g_fault.nth.load();
  if (n == nth || (g_fault.persistent.load() && n > nth)) return g_fault.err.load();
  return 0;
}

void set_fault(uint32_t op_mask, int64_t nth, int err, bool persistent) {
  g_fault.mask.store(0);  // disarmed while the fields change
  g_fault.calls.store(0);
  g_fault.nth.store(nth);
  g_fault.err.store(err);
  g_fault.persistent.store(persistent);
  g_fault.mask.store(op_mask, std::memory_order_release);
}

void clear_fault() { g_fault.mask.store(0); }

int64_t fault_calls() { return g_fault.calls.load(); }

}  // namespace pcc::io
