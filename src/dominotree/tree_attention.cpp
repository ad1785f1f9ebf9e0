// Attention of a short query block on AVX-512 CPUs: tree verifies (a mask) and one-token steps
// (no mask), in bf16 (AVX-512 BF16 CPUs without AMX) or fp32 (any AVX-512F CPU).
//
// torch's CPU flash kernel computes bf16 attention in fp32 products on these CPUs; for the 16-72
// query rows of a tree verify it is compute-bound at fp32 speed. In bf16 both products here run on
// the bf16 dot-product instruction (vdpbf16ps: bf16 pairs multiplied exactly, fp32 accumulation):
// the scores and softmax stay fp32, the softmax numerators are rounded to bf16 for the value
// product, as GPU flash kernels do. In fp32 (models run in fp32 where the CPU lacks bf16 hardware)
// both products are fp32 FMAs, where torch's kernel spends ~200 us per call on a 48-row block.
// Every query row is computed on its own, over the keys it sees in key order: a tree node's row
// (the context, then its ancestors) gives the same bits as a one-token step of that node over the
// same keys once its path is in the cache. See tree_attention.py. The bf16 kernel is compiled only
// where the compiler targets AVX-512 BF16 (__AVX512BF16__); the fp32 one needs AVX-512F alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int KB = 16;   // keys per score block: one fp32 lane each

// e^x for x <= 0 (scores minus their row maximum): 2^n * e^r with |r| <= ln2 / 2, a degree-6
// polynomial (about 1 ulp); exactly 0 below -103 (masked keys sit at -3.4e38).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512 y = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.f), _CMP_GT_OQ), y);
}

// A row's visible keys, closed up: its scores s[0 .. L) move to s[0 .. seen) in key order and
// keys[w] names the w-th; prefix = the keys it sees before its first unseen one (they stay where
// they were). A row that sees nothing sees every key, as SDPA weighs a fully masked row. Masked:
// an additive mask value below -1e30. The scores past `seen` up to a whole block are -inf.
template <typename MaskValue>
inline void close_up(float* s, int32_t* keys, int64_t L, MaskValue mask_at, int64_t* seen, int64_t* prefix) {
  int64_t w = 0, first = L;
  for (int64_t j = 0; j < L; ++j) {
    if (mask_at(j) < -1e30f) {
      first = std::min(first, j);
      continue;
    }
    s[w] = s[j];
    keys[w++] = int32_t(j);
  }
  if (w == 0) {
    for (int64_t j = 0; j < L; ++j) keys[j] = int32_t(j);
    w = L, first = L;        // (its scores were not moved)
  }
  *seen = w, *prefix = first;
  for (int64_t j = w; j < (w + KB - 1) / KB * KB; ++j) s[j] = -INFINITY;
}

// The row's softmax numerators e[0 .. seen) (block-padded with 0) over its closed-up scores; returns
// 1 / their sum. The sum runs in 16 lanes over the keys in order, so a row's bits depend only on the
// keys it sees.
inline float numerators(const float* s, int64_t seen, float* e) {
  const int64_t Lr = (seen + KB - 1) / KB * KB;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < Lr; j += KB) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < Lr; j += KB) {
    const __m512 x = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    sum = _mm512_add_ps(sum, x);
    _mm512_storeu_ps(e + j, x);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// One stage of a 16 x 16 transpose in registers: swap bit BIT of the row index with that bit of
// the column index (lo / hi: the lanes each pair of rows takes from the two, as permutex2var reads them).
template <int BIT>
inline void swap_index_bit(__m512 (&r)[16], const int32_t* lo, const int32_t* hi) {
  const __m512i il = _mm512_loadu_si512(lo), ih = _mm512_loadu_si512(hi);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & BIT) continue;
    const __m512 a = r[i], b = r[i + BIT];
    r[i] = _mm512_permutex2var_ps(a, il, b);
    r[i + BIT] = _mm512_permutex2var_ps(a, ih, b);
  }
}

// dst [D][16] = the first `keys` rows of src [16][D] transposed (the rest zero), 16 dims at a time
// (gathers are several times slower on these CPUs).
template <int D>
inline void transpose_keys(const float* src, int keys, float* dst) {
  static const int32_t lo[4][16] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
  static const int32_t hi[4][16] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
  for (int c0 = 0; c0 < D; c0 += 16) {
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = i < keys ? _mm512_loadu_ps(src + i * D + c0) : _mm512_setzero_ps();
    swap_index_bit<8>(r, lo[0], hi[0]);
    swap_index_bit<4>(r, lo[1], hi[1]);
    swap_index_bit<2>(r, lo[2], hi[2]);
    swap_index_bit<1>(r, lo[3], hi[3]);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (c0 + i) * KB, r[i]);
  }
}

// part[a] = sum over keys j < keys, in order, of p[a][j] * v[j, :] for G rows at once: each value
// row is loaded once for the G rows (a function of its own, so the G * C sums stay in registers).
template <int G, int C>
inline void shared_value_sums(const float* v, const float* const* p, int64_t keys, float* part) {
  constexpr int D = 16 * C;
  __m512 acc[G][C];
  for (int a = 0; a < G; ++a)
    for (int c = 0; c < C; ++c) acc[a][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m512 vz[C];
    for (int c = 0; c < C; ++c) vz[c] = _mm512_loadu_ps(v + j * D + 16 * c);
    for (int a = 0; a < G; ++a) {
      const __m512 pz = _mm512_set1_ps(p[a][j]);
      for (int c = 0; c < C; ++c) acc[a][c] = _mm512_fmadd_ps(pz, vz[c], acc[a][c]);
    }
  }
  for (int a = 0; a < G; ++a)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(part + a * D + 16 * c, acc[a][c]);
}

// s[r, j] = q[r] . k[j] * scale + mask[r, j] for rows r < N of q [N, D] over BB blocks of the
// transposed keys kt [blocks][D][16] from block b0 (a few rows take several blocks at once, so that
// FMA latency does not serialise them); -inf past the L keys. A score is its sum over d in order,
// whatever the rows or blocks around it.
template <int N, int BB, int D>
inline void score_blocks(const float* q, const float* kt, const float* mask, float scale, int64_t b0, int64_t L,
                         int64_t Lp, float* s) {
  __m512 acc[BB][N];
  for (int c = 0; c < BB; ++c)
    for (int r = 0; r < N; ++r) acc[c][r] = _mm512_setzero_ps();
  const float* kb = kt + b0 * D * KB;
  for (int d = 0; d < D; ++d) {
#pragma GCC unroll 4
    for (int c = 0; c < BB; ++c) {
      const __m512 kz = _mm512_loadu_ps(kb + (c * D + d) * KB);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) acc[c][r] = _mm512_fmadd_ps(kz, _mm512_set1_ps(q[r * D + d]), acc[c][r]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int c = 0; c < BB; ++c) {
    const int64_t j = (b0 + c) * KB;
    const __mmask16 valid = j + KB <= L ? __mmask16(0xFFFF) : __mmask16((1u << (L - j)) - 1);
    for (int r = 0; r < N; ++r) {
      __m512 x = _mm512_mul_ps(acc[c][r], sc);
      if (mask != nullptr) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(valid, mask + r * L + j));
      _mm512_storeu_ps(s + r * Lp + j, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, x));
    }
  }
}

template <int N, int D>
inline void score_rows(const float* q, const float* kt, const float* mask, float scale, int64_t nb, int64_t L,
                       int64_t Lp, float* s) {
  constexpr int BB = N <= 2 ? 4 : N <= 4 ? 2 : 1;
  int64_t b = 0;
  for (; b + BB <= nb; b += BB) score_blocks<N, BB, D>(q, kt, mask, scale, b, L, Lp, s);
  for (; b < nb; ++b) score_blocks<N, 1, D>(q, kt, mask, scale, b, L, Lp, s);
}

// q [H, R, D], k and v [H, L, D] fp32, contiguous; mask [R, L] additive fp32 or null.
template <int D>
void attend_f32(const float* q, const float* k, const float* v, const float* mask, float scale,
                int64_t H, int64_t R, int64_t L, float* out) {
  constexpr int C = D / 16;                  // fp32 vectors per output row
  constexpr int G = C >= 4 ? 16 / C : 4;     // output rows per value pass
  constexpr int RB = 8;                      // query rows per task (8 score accumulators)
  const int64_t nb = (L + KB - 1) / KB, Lp = nb * KB;
  // keys as [H][block][d][16 keys], zero-padded to Lp: a buffer kept per calling thread, as a
  // fresh one per call cost more than the products of a one-token step
  // (worker threads see their own thread_local: they get the pointer)
  static thread_local std::vector<float> kbuf;
  if (kbuf.size() < size_t(H * nb * D * KB)) kbuf.resize(H * nb * D * KB);
  float* const kp = kbuf.data();
  at::parallel_for(0, H * nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t hb = b0; hb < b1; ++hb) {
      const int64_t h = hb / nb, b = hb % nb;
      const int64_t j = b * KB;
      transpose_keys<D>(k + (h * L + j) * D, int(std::min<int64_t>(KB, L - j)), kp + hb * D * KB);
    }
  });
  const int64_t rblocks = (R + RB - 1) / RB;
  at::parallel_for(0, H * rblocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(RB * Lp), p(RB * Lp);
    std::vector<int32_t> seen_keys(RB * Lp);
    const float sc = scale;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / rblocks, r0 = (t % rblocks) * RB;
      const int nr = int(std::min<int64_t>(RB, R - r0));
      // scores: 16 keys per vector, each the sum over d in order of k[j, d] * q[d] (one FMA each)
      const float* qh = q + (h * R + r0) * D;
      const float* kh = kp + h * nb * D * KB;
      const float* mh = mask == nullptr ? nullptr : mask + r0 * L;
      switch (nr) {
#define SCORES(n) case n: score_rows<n, D>(qh, kh, mh, sc, nb, L, Lp, s.data()); break;
        SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8)
#undef SCORES
      }
      int64_t seen[RB], prefix[RB];
      float inv[RB];
      for (int r = 0; r < nr; ++r) {
        const float* mr = mask == nullptr ? nullptr : mask + (r0 + r) * L;
        close_up(s.data() + r * Lp, seen_keys.data() + r * Lp, L,
                 [mr](int64_t j) { return mr == nullptr ? 0.f : mr[j]; }, &seen[r], &prefix[r]);
        inv[r] = numerators(s.data() + r * Lp, seen[r], p.data() + r * Lp);
      }
      // out = sum over the keys a row sees, in order, of numerator * value, / sum: G rows at a time
      // over the keys every row of the group sees unmoved, then each row's own keys
      const float* vh = v + h * L * D;
      for (int g = 0; g < nr; g += G) {
        const int ng = std::min(G, nr - g);
        const float* pr[G];
        int64_t shared = L;
        for (int a = 0; a < G; ++a) pr[a] = p.data() + std::min(g + a, nr - 1) * Lp;
        for (int a = 0; a < ng; ++a) shared = std::min(shared, prefix[g + a]);
        float part[G][D];
        shared_value_sums<G, C>(vh, pr, shared, &part[0][0]);
        for (int a = 0; a < ng; ++a) {
          const int r = g + a;
          const int32_t* kr = seen_keys.data() + r * Lp;
          __m512 acc[C];
          for (int c = 0; c < C; ++c) acc[c] = _mm512_loadu_ps(part[a] + 16 * c);
          for (int64_t w = shared; w < seen[r]; ++w) {
            const __m512 pz = _mm512_set1_ps(pr[a][w]);
            const float* vr = vh + int64_t(kr[w]) * D;
            for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(pz, _mm512_loadu_ps(vr + 16 * c), acc[c]);
          }
          float* o = out + (h * R + r0 + r) * D;
          const __m512 iv = _mm512_set1_ps(inv[r]);
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], iv));
        }
      }
    }
  });
}

#ifdef __AVX512BF16__
inline float bf16_value(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// q [H, R, D], k and v [H, L, D] bf16, contiguous; mask [R, L] additive (fp32 or bf16) or null.
template <int D>
void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, const void* mask, bool mask_f32,
            float scale, int64_t H, int64_t R, int64_t L, uint16_t* out) {
  constexpr int DP = D / 2;                  // bf16 pairs per row: one dword each
  constexpr int C = D / 16;                  // fp32 vectors per output row
  constexpr int G = C >= 4 ? 16 / C : 4;     // output rows per value pass (16 accumulators)
  constexpr int RB = 8;                      // query rows per task (8 score accumulators)
  const int64_t nb = (L + KB - 1) / KB, Lp = nb * KB, L2 = Lp / 2;
  // keys as [H][block][pair][16 keys] and values as [H][key pair][D] dwords, zero-padded to Lp
  std::vector<uint32_t> kp(H * nb * DP * KB), vp(H * L2 * D);
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k);
  at::parallel_for(0, H * nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t hb = b0; hb < b1; ++hb) {
      const int64_t h = hb / nb, b = hb % nb;
      uint32_t* dst = kp.data() + hb * DP * KB;
      for (int jj = 0; jj < KB; ++jj) {
        const int64_t j = b * KB + jj;
        const uint32_t* src = k32 + (h * L + j) * DP;
        for (int d = 0; d < DP; ++d) dst[d * KB + jj] = j < L ? src[d] : 0u;
      }
      for (int64_t jp = b * KB / 2; jp < (b + 1) * KB / 2; ++jp) {
        uint32_t* vd = vp.data() + (h * L2 + jp) * D;
        const int64_t j0 = 2 * jp, j1 = j0 + 1;
        const uint16_t* a = v + (h * L + j0) * D;
        const uint16_t* c = v + (h * L + j1) * D;
        for (int d = 0; d < D; ++d)
          vd[d] = (j0 < L ? uint32_t(a[d]) : 0u) | ((j1 < L ? uint32_t(c[d]) : 0u) << 16);
      }
    }
  });
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
  const int64_t rblocks = (R + RB - 1) / RB;
  at::parallel_for(0, H * rblocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(RB * Lp), e(Lp);
    std::vector<uint16_t> p(RB * Lp);
    std::vector<int32_t> seen_keys(RB * Lp);   // each row's visible keys, in key order
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / rblocks, r0 = (t % rblocks) * RB;
      const int nr = int(std::min<int64_t>(RB, R - r0));
      // scores: 16 keys per fp32 vector, one bf16 pair of the query broadcast per instruction
      for (int64_t b = 0; b < nb; ++b) {
        __m512 acc[RB];
        for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
        const uint32_t* kb = kp.data() + (h * nb + b) * DP * KB;
        for (int d = 0; d < DP; ++d) {
          const __m512bh kz = (__m512bh)_mm512_loadu_si512(kb + d * KB);
          for (int r = 0; r < RB; ++r) {
            const int64_t row = r0 + (r < nr ? r : 0);
            acc[r] = _mm512_dpbf16_ps(acc[r], kz, (__m512bh)_mm512_set1_epi32(int(q32[(h * R + row) * DP + d])));
          }
        }
        const int64_t j = b * KB;
        const __mmask16 valid = j + KB <= L ? __mmask16(0xFFFF) : __mmask16((1u << (L - j)) - 1);
        for (int r = 0; r < nr; ++r) {
          __m512 x = _mm512_mul_ps(acc[r], sc);
          if (mask != nullptr) {
            const int64_t at = (r0 + r) * L + j;
            x = _mm512_add_ps(x, mask_f32 ? _mm512_maskz_loadu_ps(valid, static_cast<const float*>(mask) + at)
                                          : bf16_to_f32(_mm256_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(mask) + at)));
          }
          _mm512_storeu_ps(s.data() + r * Lp + j, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, x));
        }
      }
      // A row's scores close up over the keys its mask rules out, so its softmax and value sums run
      // over the keys it sees, in the lanes and pairs a one-token step would put them in; the
      // numerators are rounded to bf16 for the value product (their sums stay fp32)
      int64_t seen[RB], prefix[RB];
      float inv[RB];
      for (int r = 0; r < nr; ++r) {
        const int64_t at = (r0 + r) * L;
        close_up(s.data() + r * Lp, seen_keys.data() + r * Lp, L, [&](int64_t j) {
          return mask == nullptr ? 0.f : mask_f32 ? static_cast<const float*>(mask)[at + j]
                                                  : bf16_value(static_cast<const uint16_t*>(mask)[at + j]);
        }, &seen[r], &prefix[r]);
        inv[r] = numerators(s.data() + r * Lp, seen[r], e.data());
        for (int64_t j = 0; j < (seen[r] + KB - 1) / KB * KB; j += KB)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.data() + r * Lp + j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(e.data() + j)));
      }
      // out = numerators . values / sum, G rows at a time: one key pair's numerators per broadcast,
      // over the pairs every row of the group sees unmoved; then each row's own pairs
      const uint32_t* vh = vp.data() + h * L2 * D;
      const uint16_t* vrows = v + h * L * D;
      for (int g = 0; g < nr; g += G) {
        const int ng = std::min(G, nr - g);
        __m512 acc[G][C];
        for (int a = 0; a < G; ++a)
          for (int c = 0; c < C; ++c) acc[a][c] = _mm512_setzero_ps();
        const uint32_t* pr[G];
        int64_t shared = L2;
        for (int a = 0; a < G; ++a) pr[a] = reinterpret_cast<const uint32_t*>(p.data() + std::min(g + a, nr - 1) * Lp);
        for (int a = 0; a < ng; ++a) shared = std::min(shared, prefix[g + a] / 2);
        for (int64_t jp = 0; jp < shared; ++jp) {
          __m512bh vz[C];
          for (int c = 0; c < C; ++c) vz[c] = (__m512bh)_mm512_loadu_si512(vh + jp * D + 16 * c);
          for (int a = 0; a < G; ++a) {
            const __m512bh pz = (__m512bh)_mm512_set1_epi32(int(pr[a][jp]));
            for (int c = 0; c < C; ++c) acc[a][c] = _mm512_dpbf16_ps(acc[a][c], vz[c], pz);
          }
        }
        for (int a = 0; a < ng; ++a) {
          const int r = g + a;
          const int32_t* kr = seen_keys.data() + r * Lp;
          const int64_t pairs = (seen[r] + KB - 1) / KB * KB / 2;
          for (int64_t jp = shared; jp < pairs; ++jp) {
            const int64_t j0 = 2 * jp, j1 = j0 + 1;
            const __m512bh pz = (__m512bh)_mm512_set1_epi32(int(pr[a][jp]));
            for (int c = 0; c < C; ++c) {
              const __m512i lo = j0 < seen[r] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(vrows + int64_t(kr[j0]) * D + 16 * c)))
                                              : _mm512_setzero_si512();
              const __m512i hi = j1 < seen[r] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(vrows + int64_t(kr[j1]) * D + 16 * c)))
                                              : _mm512_setzero_si512();
              acc[a][c] = _mm512_dpbf16_ps(acc[a][c], (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)), pz);
            }
          }
        }
        for (int a = 0; a < ng; ++a) {
          uint16_t* o = out + (h * R + r0 + g + a) * D;
          const __m512 iv = _mm512_set1_ps(inv[g + a]);
          for (int c = 0; c < C; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[a][c], iv)));
        }
      }
    }
  });
}

#endif  // __AVX512BF16__

}  // namespace

// The checks that keep a wrong call from reading out of bounds live here; tree_attention.py
// decides which calls come here at all.
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [H, R, D], k and v [H, L, D]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q and k differ in heads or head size");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "bf16 or fp32 q, k, v, all of one dtype");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v");
  const int64_t H = q.size(0), R = q.size(1), L = k.size(1), D = q.size(2);
  TORCH_CHECK(L > 0 && R > 0, "no keys or no queries");
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head size ", D, " is not 16, 32, 64 or 128");
  const void* m = nullptr;
  bool mask_f32 = false;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == R && mask->size(1) == L && mask->is_contiguous(),
                "mask [R, L], contiguous");
    TORCH_CHECK(mask->scalar_type() == at::kFloat || (dtype == at::kBFloat16 && mask->scalar_type() == at::kBFloat16),
                "an additive fp32 mask (or bf16, for bf16 q)");
    mask_f32 = mask->scalar_type() == at::kFloat;
    m = mask->data_ptr();
  }
  auto out = torch::empty({H, R, D}, q.options());
  const float sc = float(scale);
  if (dtype == at::kFloat) {
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    const float* mp = static_cast<const float*>(m);
    float* op = out.data_ptr<float>();
    switch (D) {
      case 16: attend_f32<16>(qp, kp, vp, mp, sc, H, R, L, op); break;
      case 32: attend_f32<32>(qp, kp, vp, mp, sc, H, R, L, op); break;
      case 64: attend_f32<64>(qp, kp, vp, mp, sc, H, R, L, op); break;
      case 128: attend_f32<128>(qp, kp, vp, mp, sc, H, R, L, op); break;
    }
    return out;
  }
#ifdef __AVX512BF16__
  auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  switch (D) {
    case 16: attend<16>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 32: attend<32>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 64: attend<64>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 128: attend<128>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
  }
  return out;
#else
  TORCH_CHECK(false, "bf16 q, k, v: this build has no AVX-512 BF16 kernel (fp32 only)");
#endif
}

// Whether this build has the bf16 kernel (compiled with -mavx512bf16) besides the fp32 one.
bool has_bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_attention", &tree_attention);
  m.def("has_bf16", &has_bf16);
}
