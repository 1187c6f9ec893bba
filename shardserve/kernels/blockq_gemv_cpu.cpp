// y = x @ w^T with x float32 [M, K] and w stored as GGUF-style blocks of 32 weights along K, for decode-sized M
// on AVX2 CPUs:
//   4-bit: w = d * q + m, q in 0..15 packed two per byte (low nibble first), d and m float32 per block;
//   8-bit: w = d * q, q int8, d float32 per block.
//
// Decoding reads every weight once per token: these are 0.75 and 1.13 bytes per weight against 4 for float32.
// Each block is widened in registers to exactly the float32 weights the dequantizer produced, so this is a
// float32 dot product over the same values as the other kernels; each row of x is computed as if alone.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

#include <torch/extension.h>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowsAtOnce = 2;  // rows of x sharing each dequantized block (4 accumulators each: 12 registers)

// One block's 32 weights as four vectors of float32, equal bit for bit to the dequantizer's d * q + m: d * q is
// exact in float32 (an 11-bit scale times a small integer), so one fused multiply-add rounds only the sum.
struct Block {
  __m256 w[4];
};

inline Block dequantize_q4(const uint8_t* q, float d, float m) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));  // q[0..15]
  __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f));  // q[16..31]
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  Block b;
  b.w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), vd, vm);
  b.w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), vd, vm);
  b.w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), vd, vm);
  b.w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), vd, vm);
  return b;
}

inline Block dequantize_q8(const int8_t* q, float d) {
  __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
  const __m256 vd = _mm256_set1_ps(d);
  Block b;
  b.w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd);
  b.w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vd);
  b.w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd);
  b.w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vd);
  return b;
}

// Invariant: row r's output is computed by the same operations in the same order whatever the other rows,
// their number (rows are grouped kRowsAtOnce at a time, each with its own four accumulators) and the thread
// split (over outputs n). So a row alone and the same row inside a batch give identical bits.
template <typename Dequantize>
void linear_rows(const float* x, int64_t M, int64_t K, int64_t N, float* y, Dequantize dequantize) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r0 = 0; r0 < M; r0 += kRowsAtOnce) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsAtOnce, M - r0));
        __m256 acc[kRowsAtOnce][4];
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const Block w = dequantize(n, blk);
          for (int r = 0; r < rows; ++r) {
            const float* xr = x + (r0 + r) * K + blk * kBlock;
            for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * j), w.w[j], acc[r][j]);
          }
        }
        for (int r = 0; r < rows; ++r)
          y[(r0 + r) * N + n] = horizontal_sum(
              _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
      }
    }
  });
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  const int64_t blocks = x.size(1) / kBlock;
  TORCH_CHECK(q.dim() == 2 && q.size(1) == blocks * bytes_per_block, "quantized weight has the wrong width");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == q.size(0) && d.size(1) == blocks && d.scalar_type() == at::kFloat,
              "scales must be float32 [N, K / 32]");
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  x = x.contiguous();
  check_inputs(x, q, d, kBlock / 2);
  TORCH_CHECK(q.scalar_type() == at::kByte && m.sizes() == d.sizes(), "4-bit weights are uint8, m like d");
  q = q.contiguous(), d = d.contiguous(), m = m.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), blocks = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  linear_rows(x.data_ptr<float>(), M, K, N, y.data_ptr<float>(), [&](int64_t n, int64_t blk) {
    const int64_t i = n * blocks + blk;
    return dequantize_q4(qp + i * (kBlock / 2), dp[i], mp[i]);
  });
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  x = x.contiguous();
  check_inputs(x, q, d, kBlock);
  TORCH_CHECK(q.scalar_type() == at::kChar, "8-bit weights are int8");
  q = q.contiguous(), d = d.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), blocks = K / kBlock;
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  linear_rows(x.data_ptr<float>(), M, K, N, y.data_ptr<float>(), [&](int64_t n, int64_t blk) {
    return dequantize_q8(qp + (n * blocks + blk) * kBlock, dp[n * blocks + blk]);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x (float32) @ w^T, w = d * q + m in 4-bit blocks of 32");
  m.def("q8_linear", &q8_linear, "x (float32) @ w^T, w = d * q in 8-bit blocks of 32");
}
