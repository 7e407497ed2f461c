#include "fingerprint.h"

#include <cstring>
#include <stdexcept>

namespace pcc {
namespace {

using u128 = unsigned __int128;
constexpr uint64_t P = kFingerprintPrime;
constexpr size_t kCoeffs = 8;                 // coefficients per block
constexpr size_t kBlockBytes = 7 * kCoeffs;   // 56 bytes: 8 coefficients of 7 bytes
constexpr uint64_t kMask56 = (uint64_t(1) << 56) - 1;

// x mod p for x < 2^124 (2^61 = 1 mod p, so the high bits fold onto the low ones).
inline uint64_t reduce(u128 x) {
  uint64_t s = static_cast<uint64_t>(x & P) + static_cast<uint64_t>(x >> 61);  // < 2^61 + 2^63
  s = (s & P) + (s >> 61);                                                     // < 2^61 + 4
  return s >= P ? s - P : s;
}

inline uint64_t mulmod(uint64_t a, uint64_t b) { return reduce(static_cast<u128>(a) * b); }

inline uint64_t load8(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts only (x86-64, aarch64): pccheck's targets
}

// One key's Horner state, 8 coefficients per step: h <- h k^8 + m_0 k^7 + m_1 k^6 + ... + m_7.
struct Lane {
  uint64_t pw[kCoeffs + 1];  // k^0 .. k^8
  uint64_t h = 0;
  explicit Lane(uint64_t k) {
    pw[0] = 1;
    for (size_t i = 1; i <= kCoeffs; i++) pw[i] = mulmod(pw[i - 1], k);
  }
};

// Invariant: the sum below stays under 2^124: h k^8 < 2^122, and each m_i k^j < 2^117, 8 of them.
inline void block(Lane& a, Lane& b, const uint8_t* p) {
  uint64_t m[kCoeffs];
  for (size_t i = 0; i + 1 < kCoeffs; i++) m[i] = load8(p + 7 * i) & kMask56;
  m[kCoeffs - 1] = load8(p + 7 * (kCoeffs - 1) - 1) >> 8;  // bytes 49..55, without reading past 56
  u128 sa = static_cast<u128>(a.h) * a.pw[kCoeffs];
  u128 sb = static_cast<u128>(b.h) * b.pw[kCoeffs];
  for (size_t i = 0; i < kCoeffs; i++) {
    sa += static_cast<u128>(m[i]) * a.pw[kCoeffs - 1 - i];
    sb += static_cast<u128>(m[i]) * b.pw[kCoeffs - 1 - i];
  }
  a.h = reduce(sa);
  b.h = reduce(sb);
}

struct Hasher {
  Lane a, b;
  uint8_t carry[kBlockBytes];
  size_t ncarry = 0;
  uint64_t total = 0;
  Hasher(uint64_t k1, uint64_t k2) : a(k1), b(k2) {}

  void update(const uint8_t* p, uint64_t n) {
    total += n;
    if (ncarry) {
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, kBlockBytes - ncarry));
      std::memcpy(carry + ncarry, p, take);
      ncarry += take;
      p += take;
      n -= take;
      if (ncarry < kBlockBytes) return;
      block(a, b, carry);
      ncarry = 0;
    }
    for (; n >= kBlockBytes; p += kBlockBytes, n -= kBlockBytes) block(a, b, p);
    std::memcpy(carry, p, n);
    ncarry = static_cast<size_t>(n);
  }

  std::pair<uint64_t, uint64_t> finish() {
    if (ncarry) {  // zero padding: equal-length inputs pad alike, so the map stays injective
      std::memset(carry + ncarry, 0, kBlockBytes - ncarry);
      block(a, b, carry);
    }
    uint64_t n = total % P;
    return {reduce(static_cast<u128>(a.h) * a.pw[1] + n), reduce(static_cast<u128>(b.h) * b.pw[1] + n)};
  }
};

}  // namespace

std::pair<uint64_t, uint64_t> fingerprint(const ArraySource& src, uint64_t k1, uint64_t k2) {
  if (k1 == 0 || k1 >= P || k2 == 0 || k2 >= P) throw std::invalid_argument("fingerprint keys must lie in [1, 2^61 - 1)");
  Hasher h(k1, k2);
  if (src.nbytes == 0) return h.finish();
  if (src.ptr == nullptr) throw std::invalid_argument("fingerprint: the array has no host address");
  if (src.d0 == 0) {
    h.update(src.ptr, src.nbytes);
    return h.finish();
  }
  // Strided: the logical bytes in C order, a bounded window at a time (copy_range walks the runs).
  constexpr uint64_t kWindow = 1 << 16;
  uint8_t buf[kWindow];
  for (uint64_t pos = 0; pos < src.nbytes; pos += kWindow) {
    uint64_t end = std::min(src.nbytes, pos + kWindow);
    src.copy_range(pos, end, buf);
    h.update(buf, end - pos);
  }
  return h.finish();
}

}  // namespace pcc
