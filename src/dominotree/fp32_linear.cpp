// fp32 linear products for the few rows of a decoding step or a tree verify, on AVX-512F CPUs.
//
// The weight lies in blocks of 16 outputs, [ceil(N / 16), K, 16], stored in bf16 where every fp32
// weight is a bf16 value (a bf16 checkpoint run in fp32: half the bytes to stream), else in fp32.
// A pass takes up to 14 rows and 2-8 blocks, whose outputs sit in registers; each step over k loads
// the blocks' weights once and adds x[m, k] * w[k, :] into every row's registers (one FMA each).
// Each output is thus the sum over k in k order, one rounding per term, whatever the number of
// rows, the row's place among them or the threads: a row alone gives the bits it gets among others.
// See fp32_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

constexpr int NB = 16;   // outputs per block: one fp32 lane each
constexpr int MR = 14;   // rows per pass at most (with 2 blocks: 28 accumulator registers)

inline __m512 load_weights(const uint16_t* w) {   // 16 bf16 -> fp32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_weights(const float* w) { return _mm512_loadu_ps(w); }

// Blocks b0 .. b0 + B - 1 of y for rows m < M of x [M, K]: M * B independent sums in registers
// (a few rows take several blocks at once, so that FMA latency never serialises them).
template <int M, int B, typename W>
inline void tile(const float* x, const W* w, int64_t K, int64_t N, int64_t b0, float* y) {
  __m512 acc[M][B];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < B; ++j) acc[m][j] = _mm512_setzero_ps();
  const W* wb = w + b0 * K * NB;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[B];
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) wk[j] = load_weights(wb + (j * K + k) * NB);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 8
      for (int j = 0; j < B; ++j) acc[m][j] = _mm512_fmadd_ps(xm, wk[j], acc[m][j]);
    }
  }
  for (int j = 0; j < B; ++j) {
    const int64_t n0 = (b0 + j) * NB;
    const int64_t valid = std::min<int64_t>(NB, N - n0);
    const __mmask16 keep = valid >= NB ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + n0, keep, acc[m][j]);
  }
}

template <int M, typename W>
void rows(const float* x, const W* w, int64_t K, int64_t N, float* y) {
  constexpr int B = M <= 2 ? 8 : M <= 4 ? 4 : M <= 8 ? 3 : 2;
  const int64_t blocks = (N + NB - 1) / NB, groups = (blocks + B - 1) / B;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * B;
      if (b0 + B <= blocks) {
        tile<M, B>(x, w, K, N, b0, y);
      } else {
        for (int64_t b = b0; b < blocks; ++b) tile<M, 1>(x, w, K, N, b, y);   // the last few blocks
      }
    }
  });
}

template <typename W>
void pass(const float* x, const W* w, int64_t M, int64_t K, int64_t N, float* y) {
  switch (M) {
#define ROWS(m) case m: rows<m>(x, w, K, N, y); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7)
    ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
#undef ROWS
  }
}

}  // namespace

// w [N, K] fp32 or bf16 -> blocks [ceil(N / 16), K, 16] of the same dtype (zero-padded outputs).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: a 2-D weight");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto padded = torch::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, NB, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 contiguous, blocks from `pack`, N outputs -> y [M, N] fp32.
torch::Tensor linear(torch::Tensor x, torch::Tensor blocks, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "linear: x [M, K] fp32 contiguous");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == NB && blocks.is_contiguous(), "linear: blocks from pack");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(blocks.size(1) == K && blocks.size(0) * NB >= N && blocks.size(0) * NB < N + NB, "linear: shapes");
  auto y = torch::empty({M, N}, x.options());
  const bool half = blocks.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(half || blocks.scalar_type() == torch::kFloat, "linear: bf16 or fp32 blocks");
  const int64_t passes = (M + MR - 1) / MR, per = (M + passes - 1) / passes;   // even passes: 16 = 8 + 8
  for (int64_t m0 = 0; m0 < M; m0 += per) {
    const int64_t m = std::min<int64_t>(per, M - m0);
    const float* xs = x.data_ptr<float>() + m0 * K;
    float* ys = y.data_ptr<float>() + m0 * N;
    if (half)
      pass(xs, reinterpret_cast<const uint16_t*>(blocks.data_ptr<at::BFloat16>()), m, K, N, ys);
    else
      pass(xs, blocks.data_ptr<float>(), m, K, N, ys);
  }
  return y;
}

// How many threads at::parallel_for ran `items` items on: it is serial where the build lacks OpenMP.
int64_t parallel_threads(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] -> blocks [ceil(N / 16), K, 16]");
  m.def("linear", &linear, "x [M, K] fp32 @ blocks^T -> [M, N] fp32");
  m.def("parallel_threads", &parallel_threads, "threads a parallel_for of `items` items ran on");
}
