// y = x @ w^T with x float32 [M, K] and w bfloat16 [N, K], for decode-sized M on AVX2 CPUs.
//
// Decoding reads every weight once per token, so its speed is the memory bandwidth divided by the
// weight bytes: bfloat16 weights halve the bytes of float32 ones. CPUs without AVX-512 BF16 have no
// fast bfloat16 matmul in torch, so this kernel widens each bfloat16 weight to float32 in registers
// (a 16-bit shift) and accumulates in float32. Rows of w are split across torch's intra-op threads.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

#include <cstring>
#include <torch/extension.h>

namespace {

constexpr int kRowsAtOnce = 8;  // rows of x sharing each widened weight vector

inline __m256 widen_bf16(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One x row: four accumulators over k keep four FMA chains in flight instead of one.
float single_row(const float* x, const uint16_t* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen_bf16(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), widen_bf16(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), widen_bf16(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), widen_bf16(w + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen_bf16(w + k), a0);
  float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) sum += x[k] * bf16_to_float(w[k]);
  return sum;
}

void rows_block(const float* x, const uint16_t* w, float* y, int64_t m0, int64_t mb, int64_t n, int64_t K,
                int64_t N) {
  __m256 acc[kRowsAtOnce];
  for (int j = 0; j < mb; ++j) acc[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv = widen_bf16(w + k);
    for (int j = 0; j < mb; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + j) * K + k), wv, acc[j]);
  }
  for (int j = 0; j < mb; ++j) {
    float sum = horizontal_sum(acc[j]);
    for (int64_t t = k; t < K; ++t) sum += x[(m0 + j) * K + t] * bf16_to_float(w[t]);
    y[(m0 + j) * N + n] = sum;
  }
}

}  // namespace

torch::Tensor bf16_weight_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16, "expects float32 x, bfloat16 w");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      for (int64_t n = begin; n < end; ++n) yp[n] = single_row(xp, wp + n * K, K);
      return;
    }
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce)
        rows_block(xp, wp + n * K, yp, m0, std::min<int64_t>(kRowsAtOnce, M - m0), n, K, N);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_weight_linear", &bf16_weight_linear, "x (float32) @ w (bfloat16)^T for decode-sized batches");
}
