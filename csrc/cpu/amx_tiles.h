// AMX tile plumbing shared by the CPU kernels' AMX paths (skinny_linear_amx.cpp: bf16;
// w8a8_linear.cpp: int8; the functions below other than the weight_row_tile template are defined
// in skinny_linear_amx.cpp). Both use tiles of 16 rows x 64 bytes only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SGLD_HAS_AMX 1
#endif

namespace sglang_dflash::cpu {

constexpr int64_t kAmxRows = 16;      // rows a tile holds
constexpr int64_t kAmxRowBytes = 64;  // bytes a tile row holds

// LDTILECFG's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Weight rows [16 t, 16 t + 16) as a tile's A operand rows: the weight itself, or for the last tile
// of an N that is not a multiple of 16, its rows copied into `padded` (zeros below them: no read
// past the weight). Only the last tile can be partial, so one `padded` serves a thread's tiles.
template <typename T>
struct WeightRowTile {
  const T* rows;
  int64_t stride;  // elements between rows
  int64_t count;   // real rows
};

template <typename T>
WeightRowTile<T> weight_row_tile(const T* w, int64_t ldw, int64_t N, int64_t K, int64_t t, std::vector<T>& padded) {
  const int64_t n0 = t * kAmxRows, count = std::min(kAmxRows, N - n0);
  if (count == kAmxRows) return {w + n0 * ldw, ldw, count};
  padded.assign(kAmxRows * K, T{});
  for (int64_t r = 0; r < count; ++r) std::memcpy(padded.data() + r * K, w + (n0 + r) * ldw, K * sizeof(T));
  return {padded.data(), K, count};
}

// M rows of x (`bytes` bytes each, a multiple of 64, rows `stride` bytes apart) as AMX B tiles, the
// VNNI layout of bf16 pairs and of int8 quads alike: tile (mb, kb) holds in row p, column m the
// 32-bit word at byte 64 kb + 4 p of x row 16 mb + m, XOR `flip`; columns past M are 0. Tile
// (mb, kb) starts at word (mb * bytes / 64 + kb) * 256 of `packed`.
void pack_b_tiles(const uint8_t* x, int64_t stride, int64_t M, int64_t bytes, uint32_t flip,
                  std::vector<uint32_t>& packed);

// Tiles 0..tiles-1 as 16 rows of 64 bytes.
TileConfig full_tiles(int tiles);

// Whether this process may run AMX code using the AMX feature in CPUID leaf 7 EDX bit `edx_bit`
// (AMX-BF16: 22, AMX-INT8: 25): the CPU has AMX-TILE, that feature and AVX-512 F/BW/VL (the
// epilogues), Linux granted the tile state (arch_prctl; refused where the kernel or the VM lacks
// it), and SGLANG_DFLASH_NO_AMX is not set (tests run the other paths that way).
bool amx_usable(unsigned edx_bit);

}  // namespace sglang_dflash::cpu
