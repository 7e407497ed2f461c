#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PCC_X86 1
#endif

namespace pcc {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t byte[8][256];  // slicing-by-8 for the software path
  uint32_t x2n[32];       // x^(2^k) mod P, for combine
  Tables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      byte[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
      for (int s = 1; s < 8; s++) byte[s][i] = (byte[s - 1][i] >> 8) ^ byte[0][byte[s - 1][i] & 0xFF];
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int n = 1; n < 32; n++) x2n[n] = p = multmodp(p, p);
  }
  static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
      if (a & m) {
        p ^= b;
        if ((a & (m - 1)) == 0) break;
      }
      m >>= 1;
      b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
    }
    return p;
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

uint32_t sw_update(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t.byte[7][v & 0xFF] ^ t.byte[6][(v >> 8) & 0xFF] ^ t.byte[5][(v >> 16) & 0xFF] ^
          t.byte[4][(v >> 24) & 0xFF] ^ t.byte[3][(v >> 32) & 0xFF] ^ t.byte[2][(v >> 40) & 0xFF] ^
          t.byte[1][(v >> 48) & 0xFF] ^ t.byte[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = t.byte[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  return crc;
}

#ifdef PCC_X86
// Three independent crc32 streams hide the instruction's 3-cycle latency; the stream results
// are merged with the same GF(2) shift that crc32c_combine uses.
__attribute__((target("sse4.2"))) uint32_t hw_update(uint32_t crc, const uint8_t* p, size_t n) {
  constexpr size_t kBlock = 8192;  // bytes per stream per round
  while (n >= 3 * kBlock) {
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    const uint8_t* p1 = p + kBlock;
    const uint8_t* p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p1 + i, 8);
      std::memcpy(&v2, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    // Raw (unconditioned) register states combine by shifting the earlier one over the later bytes.
    static const uint32_t shift = [] {
      uint64_t k = kBlock;  // x^(8*kBlock) mod P
      uint32_t r = 1u << 31;
      unsigned bit = 3;
      while (k) {
        if (k & 1) r = Tables::multmodp(tables().x2n[bit & 31], r);
        k >>= 1;
        bit++;
      }
      return r;
    }();
    uint32_t s = Tables::multmodp(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    s = Tables::multmodp(shift, s) ^ static_cast<uint32_t>(c2);
    crc = s;
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

bool detect_hw() {
#ifdef PCC_X86
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool kHw = detect_hw();

}  // namespace

bool crc32c_hardware() { return kHw; }

uint32_t crc32c_update(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#ifdef PCC_X86
  if (kHw) return ~hw_update(crc, p, n);
#endif
  return ~sw_update(crc, p, n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  const Tables& t = tables();
  uint32_t xp = 1u << 31;  // x^0
  unsigned k = 3;          // len_b bytes = 8 * len_b bits: start at x^(2^3)
  for (uint64_t n = len_b; n; n >>= 1, k++)
    if (n & 1) xp = Tables::multmodp(t.x2n[k & 31], xp);
  return Tables::multmodp(xp, crc_a) ^ crc_b;
}

}  // namespace pcc
