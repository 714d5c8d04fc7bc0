#pragma once
// CRC-32C (Castagnoli; the checksum of iSCSI, ext4 and SSE4.2's crc32 instruction) of checkpoint
// data. It runs on the crc32 instruction where the CPU has SSE4.2 (several GB/s, so checksumming
// does not slow down a save or a load next to the disk), and on a table-driven loop otherwise.
//
//   uint32_t c = fsdp::storage::crc32c(data, n);
//   c = fsdp::storage::crc32c_extend(c, more, m);   // == crc32c of data followed by more
//   fsdp::storage::crc32c("123456789", 9) == 0xE3069283

#include <cstddef>
#include <cstdint>

namespace fsdp::storage {

/// The CRC-32C of the bytes whose CRC-32C is `crc`, followed by `data[0, size)`.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);

inline uint32_t crc32c(const void* data, size_t size) { return crc32c_extend(0, data, size); }

/// Whether crc32c runs on the SSE4.2 instruction on this CPU.
bool crc32c_uses_hardware();

}  // namespace fsdp::storage
