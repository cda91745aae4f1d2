// CPU features of the batch-invariant ("exact") kernels beyond simd.h's AVX2: AVX-512 and
// AVX512-BF16, compiled per function with target attributes and chosen at run time.
#pragma once
#include "simd.h"

namespace dartree {
namespace cpu {

#if DARTREE_X86 && defined(__GNUC__)
#define DARTREE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define DARTREE_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))

inline bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         has_avx2();
  return ok;
}

inline bool has_avx512_bf16() {
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}
#else
inline bool has_avx512() { return false; }
inline bool has_avx512_bf16() { return false; }
#endif

}  // namespace cpu
}  // namespace dartree
