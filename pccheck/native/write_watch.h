// Write tracking of host memory by the kernel (userfaultfd asynchronous write-protection and the
// PAGEMAP_SCAN ioctl, Linux >= 6.7), so that an array known unchanged since its last fingerprint
// need not be read again (incremental checkpoints, docs/ARCHITECTURE.md "Write watch").
//
// A range is *armed* by registering it with a userfaultfd in asynchronous write-protect mode and
// write-protecting its pages. A later write to a protected page takes one minor fault, which the
// kernel resolves itself by lifting the protection: the page is then "written". scan() reports the
// pages written (or no longer present, or file-backed) since they were last protected; it does not
// protect them again, so a written page is reported by every scan until arm() protects it anew.
//
// Invariant: arm() protects and reports atomically per page, so a write to a page that several
// arrays share is reported once by that arm() and must reach every array armed on it (the Python
// side maps each reported region to every armed array it overlaps).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace pcc {

class WriteWatch {
 public:
  // Opens the userfaultfd (user-mode faults only: no privilege needed) and /proc/self/pagemap.
  // Throws std::runtime_error saying why when the kernel lacks any piece.
  WriteWatch();
  ~WriteWatch();
  WriteWatch(const WriteWatch&) = delete;
  WriteWatch& operator=(const WriteWatch&) = delete;

  // Registers [lo, hi) (page-aligned) and protects every page of it, first backing its whole huge
  // pages by transparent huge pages where the kernel allows. Returns the regions that were written
  // (or not protected, or not present, or file-backed) just before protection.
  // Returns an error as -errno in the first element of the second member when registration fails.
  std::pair<std::vector<std::pair<uint64_t, uint64_t>>, int> arm(uint64_t lo, uint64_t hi);

  // The regions of [lo, hi) written, not present or file-backed since last protected (left
  // unprotected: reported again by the next scan). rc (second member) is -errno on failure (EPERM: part of the range is no longer
  // registered, e.g. unmapped and mapped again): the caller treats the whole range as written.
  std::pair<std::vector<std::pair<uint64_t, uint64_t>>, int> scan(uint64_t lo, uint64_t hi);

 private:
  std::pair<std::vector<std::pair<uint64_t, uint64_t>>, int> scan_impl(uint64_t lo, uint64_t hi, bool every_page);
  int uffd_ = -1;
  int pagemap_ = -1;
  uint64_t huge_ = 0;  // PMD huge page size, 0 where none
};

}  // namespace pcc
