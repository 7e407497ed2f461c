// A 122-bit fingerprint of an array's logical bytes (C order), to decide whether an array is
// unchanged since an earlier checkpoint (incremental checkpoints, docs/ARCHITECTURE.md
// "Incremental checkpoints: change detection").
//
// Two polynomial hashes over GF(p), p = 2^61 - 1, with independent keys k1, k2 in [1, p):
// the bytes, zero-padded to a multiple of 56, are cut into 7-byte little-endian coefficients
// m_0 .. m_{L-1} (each < 2^56 < p), and
//   H_k = (m_0 k^L + m_1 k^(L-1) + ... + m_{L-1} k + n) mod p      (n = the byte count)
// For two different byte strings of the same length the difference is a non-zero polynomial
// in k of degree <= L, so they collide for at most L of the p keys: P[H_k equal] <= L / p for a
// key drawn independently of the data, and <= (L/p)^2 for both hashes together.
#pragma once
#include <cstdint>
#include <utility>

#include "engine.h"

namespace pcc {

// (H_k1, H_k2) of the array's logical bytes; keys must lie in [1, 2^61 - 1).
std::pair<uint64_t, uint64_t> fingerprint(const ArraySource& src, uint64_t k1, uint64_t k2);

constexpr uint64_t kFingerprintPrime = (uint64_t(1) << 61) - 1;

}  // namespace pcc
