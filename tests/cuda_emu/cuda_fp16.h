// Stand-in for CUDA's <cuda_fp16.h> under the emulator (-Itests/cuda_emu): __half as raw bits.
#pragma once
#include "cuda_emulation.h"

struct __half {
  uint16_t bits;
};
EMU_INTERNAL inline float __half2float(__half h) { return emu::half_to_float(h.bits); }
// round to nearest, ties to even (as cvt.rn.f16.f32)
EMU_INTERNAL inline __half __float2half_rn(float x) { return __half{emu::float_to_half(x)}; }
