// The on-disk structures of a pccheck store file. docs/FORMAT.md is the normative spec; the
// section numbers below refer to it. All integers are little-endian.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pcc {

constexpr uint64_t kBlock = 4096;  // O_DIRECT alignment and the unit of every on-disk record
constexpr uint32_t kFormatVersion = 1;
constexpr uint32_t kMaxSlots = 255;  // the slot index is the low 8 bits of the CHECK_ADDR word
constexpr char kHeaderMagic[8] = {'P', 'C', 'C', 'H', 'E', 'C', 'K', '\0'};
constexpr char kMetaMagic[8] = {'P', 'C', 'C', 'M', 'E', 'T', 'A', '\0'};
constexpr size_t kCrcSpan = 124;          // both records: crc32c of bytes [0, 124) stored at 124
constexpr size_t kCheckAddrOffset = 128;  // the commit word, inside block 0 but outside the crc
constexpr uint64_t kMaxCounter = (uint64_t(1) << 56) - 1;  // the word is (counter << 8) | slot

// The fields of the two records, each defined once, here: X(type, name, byte offset). pack_*,
// parse_* and the Python bindings (header dict, field tables) are all generated from these lists,
// and tests/test_format_compat.py holds them against docs/FORMAT.md's tables. Bytes [0, 8) are the
// magic, [124, 128) the crc32c of [0, 124); everything else is zero.
#define PCC_HEADER_FIELDS(X)                                                                       \
  X(uint32_t, version, 8)          /* format version = 1 */                                        \
  X(uint32_t, block_size, 12)      /* = 4096 */                                                    \
  X(uint32_t, num_slots, 16)       /* N + 1, in [2, 255] */                                         \
  X(uint32_t, flags, 20)           /* = 0 */                                                       \
  X(uint64_t, slot_capacity, 24)   /* C, a positive multiple of kBlock */                          \
  X(uint64_t, slots_offset, 32)    /* == (1 + num_slots) * kBlock */                               \
  X(uint64_t, generation, 40)                                                                      \
  X(uint32_t, world_size, 48)                                                                      \
  X(uint32_t, rank, 52)                                                                            \
  X(uint64_t, created_unix_ns, 56)

#define PCC_META_FIELDS(X)                                                                         \
  X(uint32_t, version, 8)                                                                          \
  X(uint32_t, slot, 12)                                                                            \
  X(uint64_t, counter, 16)         /* in [1, kMaxCounter]: it shares the word with the slot */      \
  X(int64_t, step, 24)             /* the training step the user passed */                         \
  X(uint64_t, data_len, 32)        /* bytes of array data at the start of the slot */              \
  X(uint64_t, manifest_offset, 40) /* from the slot start; multiple of kBlock, >= data_len */      \
  X(uint64_t, manifest_len, 48)                                                                    \
  X(uint32_t, manifest_crc, 56)                                                                    \
  X(uint64_t, unix_ns, 64)         /* wall-clock time of the commit */

#define PCC_DECLARE_FIELD(type, name, offset) type name = 0;

// §2 Header, block 0. Written once when the file is created; identity and geometry are never
// rewritten. Only the CHECK_ADDR word at byte 128 changes afterwards, by CAS (§4).
// Invariant: after creation, block 0 is written only through the shared mapping of the word
// (Store::word_), never by pwrite: a pwrite of the block could race a CAS and undo it.
struct Header {
  PCC_HEADER_FIELDS(PCC_DECLARE_FIELD)
  Header() : version(kFormatVersion), block_size(kBlock), world_size(1) {}

  uint64_t file_size() const { return slots_offset + uint64_t(num_slots) * slot_capacity; }
  uint64_t slot_offset(uint32_t slot) const { return slots_offset + uint64_t(slot) * slot_capacity; }
  uint64_t meta_offset(uint32_t slot) const { return (1 + uint64_t(slot)) * kBlock; }
};

// §3 Meta record, block 1 + i for slot i. Invariant: a meta record that validates describes a
// slot whose data and manifest were made durable *before* the record itself (one fdatasync
// covers all three, and CHECK_ADDR moves only after it). An all-zero block is an empty slot.
struct Meta {
  PCC_META_FIELDS(PCC_DECLARE_FIELD)
  Meta() : version(kFormatVersion) {}
};

// One field of a record, for the bindings' tables: name, byte offset, width, signedness.
struct FieldInfo {
  const char* name;
  size_t offset;
  size_t size;
  bool is_signed;
};
std::vector<FieldInfo> header_fields();
std::vector<FieldInfo> meta_fields();

// §4 The commit word: (counter << 8) | slot. 0 means "no checkpoint yet".
inline uint64_t make_word(uint64_t counter, uint32_t slot) { return (counter << 8) | slot; }
inline uint64_t word_counter(uint64_t w) { return w >> 8; }
inline uint32_t word_slot(uint64_t w) { return static_cast<uint32_t>(w & 0xFF); }

void pack_header(const Header& h, uint8_t* block);  // fills kBlock bytes, word = 0
void pack_meta(const Meta& m, uint8_t* block);      // fills kBlock bytes

// Parsers treat their input as hostile: fixed offsets only, every size checked against the
// geometry with overflow-safe arithmetic. They return "" on success or what is wrong.
std::string parse_header(const uint8_t* data, size_t len, Header* out);
// Returns "empty" for an all-zero (never written or invalidated) record.
std::string parse_meta(const uint8_t* data, size_t len, const Header& h, uint32_t slot, Meta* out);

}  // namespace pcc
