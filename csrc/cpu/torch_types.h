// torch's 16-bit float types as the torch-free CPU kernels name them (dartree/cpu/simd.h::Bits16Of),
// so that a kernel instantiated for at::BFloat16 / at::Half takes its vector conversions.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "dartree/cpu/simd.h"

namespace dartree {
namespace cpu {

template <>
struct Bits16Of<c10::BFloat16> {
  static constexpr Bits16 value = Bits16::kBFloat16;
};
template <>
struct Bits16Of<c10::Half> {
  static constexpr Bits16 value = Bits16::kFloat16;
};

}  // namespace cpu
}  // namespace dartree
