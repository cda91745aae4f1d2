// Stand-in for CUDA's <cuda_fp16.h> under the emulator (-Itests/cuda_emu): __half as raw bits.
#pragma once
#include "cuda_emulation.h"

struct __half {
  uint16_t bits;
};
EMU_INTERNAL inline float __half2float(__half h) { return emu::half_to_float(h.bits); }
