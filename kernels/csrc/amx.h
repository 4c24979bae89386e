// What the AMX kernels (experts_amx.cpp, prefill_amx.cpp) share: asking Linux for the tile
// registers, and a tile configuration of 8 tiles of 16 rows x 64 bytes.
//
// Linux lends a process the tile registers only once it asks (`amx_permitted`); each thread
// loads its tile configuration before its first tile instruction (`configure_tiles`) and
// releases it after (`_tile_release`).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace conveyor {

inline bool amx_permitted() {
  constexpr int64_t kArchReqXcompPerm = 0x1023;
  constexpr int64_t kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes: 16 x 32 bfloat16, or 16 x 16 float32
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace conveyor
