// Stand-in for CUDA's <cuda_bf16.h> under the emulator (-Itests/cuda_emu): bfloat16 as raw bits.
#pragma once
#include "cuda_emulation.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
EMU_INTERNAL inline float __bfloat162float(__nv_bfloat16 h) { return emu::bfloat16_to_float(h.bits); }
// round to nearest, ties to even (as cvt.rn.bf16.f32)
EMU_INTERNAL inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __nv_bfloat16{emu::float_to_bfloat16(x)}; }
