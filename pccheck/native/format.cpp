#include "format.h"

#include "crc32c.h"

#include <type_traits>

namespace pcc {
namespace {

template <typename T>
void put(uint8_t* b, size_t off, T v) {
  std::memcpy(b + off, &v, sizeof(T));  // x86-64 and aarch64 Linux: little-endian, as §1 requires
}
template <typename T>
T get(const uint8_t* b, size_t off) {
  T v;
  std::memcpy(&v, b + off, sizeof(T));
  return v;
}

bool all_zero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

}  // namespace

#define PCC_PUT(type, name, offset) put<type>(b, offset, rec.name);
#define PCC_GET(type, name, offset) rec->name = get<type>(b, offset);
#define PCC_INFO(type, name, offset) {#name, offset, sizeof(type), std::is_signed<type>::value},
// Every field lies inside [8, kCrcSpan) and fits there: the magic and the crc are never overwritten.
#define PCC_CHECK(type, name, offset) static_assert(offset >= 8 && offset + sizeof(type) <= kCrcSpan, #name);
PCC_HEADER_FIELDS(PCC_CHECK)
PCC_META_FIELDS(PCC_CHECK)

std::vector<FieldInfo> header_fields() { return {PCC_HEADER_FIELDS(PCC_INFO)}; }
std::vector<FieldInfo> meta_fields() { return {PCC_META_FIELDS(PCC_INFO)}; }

void pack_header(const Header& rec, uint8_t* b) {
  std::memset(b, 0, kBlock);
  std::memcpy(b, kHeaderMagic, 8);
  PCC_HEADER_FIELDS(PCC_PUT)
  put<uint32_t>(b, kCrcSpan, crc32c_update(0, b, kCrcSpan));
}

void pack_meta(const Meta& rec, uint8_t* b) {
  std::memset(b, 0, kBlock);
  std::memcpy(b, kMetaMagic, 8);
  PCC_META_FIELDS(PCC_PUT)
  put<uint32_t>(b, kCrcSpan, crc32c_update(0, b, kCrcSpan));
}

std::string parse_header(const uint8_t* b, size_t len, Header* h) {
  if (len < kBlock) return "file is shorter than the 4096-byte header block";
  if (std::memcmp(b, kHeaderMagic, 8) != 0) return "bad magic: not a pccheck store";
  if (get<uint32_t>(b, kCrcSpan) != crc32c_update(0, b, kCrcSpan)) return "header checksum mismatch";
  Header* rec = h;
  PCC_HEADER_FIELDS(PCC_GET)
  if (h->version != kFormatVersion) return "unsupported format version " + std::to_string(h->version);
  if (h->block_size != kBlock) return "unsupported block size";
  if (h->num_slots < 2 || h->num_slots > kMaxSlots) return "slot count out of range [2, 255]";
  if (h->slot_capacity == 0 || h->slot_capacity % kBlock) return "slot capacity is not a positive multiple of 4096";
  if (h->slots_offset != (1 + uint64_t(h->num_slots)) * kBlock) return "slots offset does not follow the meta blocks";
  if (h->world_size == 0 || h->rank >= h->world_size) return "rank is not below world size";
  // file_size() must not overflow: num_slots <= 255, so bound slot_capacity first.
  if (h->slot_capacity > (UINT64_MAX - h->slots_offset) / h->num_slots) return "geometry overflows 64 bits";
  return "";
}

std::string parse_meta(const uint8_t* b, size_t len, const Header& h, uint32_t slot, Meta* m) {
  if (len < kBlock) return "meta record is truncated";
  if (all_zero(b, kBlock)) return "empty";
  if (std::memcmp(b, kMetaMagic, 8) != 0) return "bad meta magic";
  if (get<uint32_t>(b, kCrcSpan) != crc32c_update(0, b, kCrcSpan)) return "meta checksum mismatch";
  Meta* rec = m;
  PCC_META_FIELDS(PCC_GET)
  if (m->version != kFormatVersion) return "unsupported meta version";
  if (m->slot != slot) return "meta record names slot " + std::to_string(m->slot) + " but sits in block of slot " + std::to_string(slot);
  if (m->counter == 0 || m->counter > kMaxCounter) return "counter out of range";
  if (m->manifest_offset % kBlock) return "manifest offset is not block aligned";
  if (m->data_len > m->manifest_offset) return "data overlaps the manifest";
  if (m->manifest_offset > h.slot_capacity || m->manifest_len > h.slot_capacity - m->manifest_offset)
    return "manifest extends past the slot";
  return "";
}

}  // namespace pcc
