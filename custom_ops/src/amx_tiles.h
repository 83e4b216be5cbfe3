// The AMX tile configuration (palette 1) shared by the AMX kernels: AMX-BF16's
// (amx_bf16_tiles.h) and IndexerScore's AMX-INT8 (indexer_score.h int8::amx). A kernel fills
// rows and colsb of the tiles it uses, loads the config in each task before any tile
// instruction and releases the tiles (_tile_release) when the task is done.
#pragma once

#include <cstdint>

namespace csa::amx_tiles {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads cfg as this thread's tile configuration. Not _tile_loadconfig: GCC 12's macro names
// only 8 bytes of the config as read, and -O2 drops the stores to the rest (the instruction
// then faults on a half-written config).
__attribute__((target("amx-tile"))) inline void load(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

}  // namespace csa::amx_tiles
