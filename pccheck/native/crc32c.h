// crc32c (Castagnoli), the checksum of every meta record, manifest and array (docs/FORMAT.md §5).
#pragma once
#include <cstddef>
#include <cstdint>

namespace pcc {

// Standard crc32c: crc32c_update(0, "123456789", 9) == 0xE3069283. Pass a previous result as
// `crc` to continue a stream. Uses the SSE4.2 instruction when the CPU has it.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t n);

// crc32c of A||B from crc32c(A), crc32c(B) and len(B), in O(log len) (zlib's method).
// Lets writer threads checksum pieces of one array out of order and combine them afterwards.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

bool crc32c_hardware();

}  // namespace pcc
