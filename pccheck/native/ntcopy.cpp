#include "ntcopy.h"

#include <errno.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifdef PCCHECK_HAVE_LIBPMEM
#include <libpmem.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pcc {

bool have_libpmem() {
#ifdef PCCHECK_HAVE_LIBPMEM
  return true;
#else
  return false;
#endif
}

#ifdef PCCHECK_HAVE_LIBPMEM

std::string ntcopy_kernel() { return "libpmem"; }
void pmem_copy_nodrain(void* dst, const void* src, size_t n) { pmem_memcpy_nodrain(dst, src, n); }
void pmem_fence() { pmem_drain(); }
void pmem_persist_range(const void* addr, size_t n) { pmem_persist(addr, n); }

void* pmem_map(int fd, size_t len, bool* is_pmem, int* err) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *err = -errno;
    return nullptr;
  }
  *is_pmem = pmem_is_pmem(p, len) != 0;
  *err = 0;
  return p;
}

#else  // streaming-store fallback

namespace {
bool has_avx2() { return __builtin_cpu_supports("avx2"); }

__attribute__((target("avx2"))) void nt_avx2(char* d, const char* s, size_t n) {
  for (; n >= 32; n -= 32, d += 32, s += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  if (n) {
    std::memcpy(d, s, n);
    _mm_clflush(d);
  }
}

void nt_sse2(char* d, const char* s, size_t n) {
  for (; n >= 16; n -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  if (n) {
    std::memcpy(d, s, n);
    _mm_clflush(d);
  }
}
}  // namespace

std::string ntcopy_kernel() { return has_avx2() ? "avx2" : "sse2"; }

void pmem_copy_nodrain(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // Unaligned head: ordinary stores, then flush the line so it is written back like the rest.
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  if (head > n) head = n;
  if (head) {
    std::memcpy(d, s, head);
    pmem_persist_range(d, head);
    d += head;
    s += head;
    n -= head;
  }
  if (has_avx2())
    nt_avx2(d, s, n);
  else
    nt_sse2(d, s, n);
}

void pmem_fence() { _mm_sfence(); }

void pmem_persist_range(const void* addr, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr) & ~uintptr_t(63);
  uintptr_t end = reinterpret_cast<uintptr_t>(addr) + n;
  for (; a < end; a += 64) _mm_clflush(reinterpret_cast<const void*>(a));
  _mm_sfence();
}

void* pmem_map(int fd, size_t len, bool* is_pmem, int* err) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *err = -errno;
    return nullptr;
  }
  const char* force = std::getenv("PMEM_IS_PMEM_FORCE");
  *is_pmem = force && std::strcmp(force, "1") == 0;
  *err = 0;
  return p;
}

#endif

void pmem_unmap(void* addr, size_t len) {
  if (addr) ::munmap(addr, len);
}

}  // namespace pcc
