// AMX's tile units (Intel Xeon since Sapphire Rapids), for the kernels that use them
// (prompt_attention.cpp, amx_gemv.cpp). NANOSERVE_AMX is defined where the compiler targets a
// CPU with bf16 tiles (`-march=native` on one); a kernel still asks `tiles_permitted()` before
// its first tile instruction, because Linux hands the tile state to a process only on request.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define NANOSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux hands out AMX's tile state only to a process that asks for it (once; every thread of
// the process may then use it).
inline bool tiles_permitted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// The shapes of the eight tile registers (palette 1), loaded into the calling thread's tile unit
// by `load()`; every tile starts as 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int tile = 0; tile < 8; ++tile) bytes_per_row[tile] = 64, rows[tile] = 16;
  }
  // GCC 12 does not count _tile_loadconfig as reading the struct, and may drop the stores that
  // fill it as dead (seen in a build where a caller's configure_tiles was not inlined: the tile
  // unit then faults on the half-written config). The empty asm says the memory is read.
  void load() const {
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};

}  // namespace amx

#endif  // NANOSERVE_AMX
