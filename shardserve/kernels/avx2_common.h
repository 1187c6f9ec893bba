// Helpers shared by the AVX2 CPU kernels.
#pragma once

#include <immintrin.h>

// The sum of a vector's eight floats, in a fixed order.
inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
