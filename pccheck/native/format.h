// The on-disk structures of a pccheck store file. docs/FORMAT.md is the normative spec; the
// section numbers below refer to it. All integers are little-endian.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace pcc {

constexpr uint64_t kBlock = 4096;  // O_DIRECT alignment and the unit of every on-disk record
constexpr uint32_t kFormatVersion = 1;
constexpr uint32_t kMaxSlots = 255;  // the slot index is the low 8 bits of the CHECK_ADDR word
constexpr char kHeaderMagic[8] = {'P', 'C', 'C', 'H', 'E', 'C', 'K', '\0'};
constexpr char kMetaMagic[8] = {'P', 'C', 'C', 'M', 'E', 'T', 'A', '\0'};
constexpr size_t kCrcSpan = 124;          // both records: crc32c of bytes [0, 124) stored at 124
constexpr size_t kCheckAddrOffset = 128;  // the commit word, inside block 0 but outside the crc

// §2 Header, block 0. Written once when the file is created; identity and geometry are never
// rewritten. Only the CHECK_ADDR word at byte 128 changes afterwards, by CAS (§4).
struct Header {
  uint32_t version = kFormatVersion;
  uint32_t block_size = kBlock;
  uint32_t num_slots = 0;       // N + 1
  uint32_t flags = 0;
  uint64_t slot_capacity = 0;   // m, a multiple of kBlock
  uint64_t slots_offset = 0;    // == (1 + num_slots) * kBlock
  uint64_t generation = 0;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint64_t created_unix_ns = 0;

  uint64_t file_size() const { return slots_offset + uint64_t(num_slots) * slot_capacity; }
  uint64_t slot_offset(uint32_t slot) const { return slots_offset + uint64_t(slot) * slot_capacity; }
  uint64_t meta_offset(uint32_t slot) const { return (1 + uint64_t(slot)) * kBlock; }
};

// §3 Meta record, block 1 + i for slot i. Invariant: a meta record that validates describes a
// slot whose data and manifest were made durable *before* the record itself (one fdatasync
// covers all three, and CHECK_ADDR moves only after it). An all-zero block is an empty slot.
struct Meta {
  uint32_t version = kFormatVersion;
  uint32_t slot = 0;
  uint64_t counter = 0;          // > 0; orders all checkpoints of the store
  int64_t step = 0;              // the training step the user passed
  uint64_t data_len = 0;         // bytes of array data at the start of the slot
  uint64_t manifest_offset = 0;  // from the slot start; multiple of kBlock, >= data_len
  uint64_t manifest_len = 0;
  uint32_t manifest_crc = 0;
  uint64_t unix_ns = 0;          // wall-clock time of the commit
};

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
