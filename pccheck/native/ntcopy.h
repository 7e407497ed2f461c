// Non-temporal copies and fences for the PMEM writer (docs/FORMAT.md §6 "PMEM").
// With libpmem (found at build time): pmem_memcpy_nodrain / pmem_drain / pmem_persist.
// Without it: SSE2/AVX2 streaming stores + sfence, and clflush + sfence to persist a range.
#pragma once
#include <cstddef>
#include <string>

namespace pcc {

// Copies with streaming stores that bypass the cache. Not ordered: call pmem_fence() after.
void pmem_copy_nodrain(void* dst, const void* src, size_t n);
// Orders and drains the streaming stores of the calling thread (per-CPU: every writer calls it).
void pmem_fence();
// Makes [addr, addr+n) durable on PMEM: flush its cache lines, then fence.
void pmem_persist_range(const void* addr, size_t n);

// Maps a whole file for PMEM writing; returns nullptr and sets err (negative errno) on failure.
// is_pmem reports what libpmem (or PMEM_IS_PMEM_FORCE without libpmem) says of the mapping.
void* pmem_map(int fd, size_t len, bool* is_pmem, int* err);
void pmem_unmap(void* addr, size_t len);

bool have_libpmem();
std::string ntcopy_kernel();  // "libpmem", "avx2" or "sse2": which implementation runs

}  // namespace pcc
