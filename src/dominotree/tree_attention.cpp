// Attention of a short query block on AVX-512 BF16 CPUs without AMX: tree verifies (a mask) and
// one-token steps (no mask).
//
// torch's CPU flash kernel computes bf16 attention in fp32 products on these CPUs; for the 16-72
// query rows of a tree verify it is compute-bound at fp32 speed. Here both products run on the
// bf16 dot-product instruction (vdpbf16ps: bf16 pairs multiplied exactly, fp32 accumulation): the
// scores and softmax stay fp32, the softmax numerators are rounded to bf16 for the value product,
// as GPU flash kernels do. Every query row is computed on its own, over the keys it sees in key
// order: a tree node's row (the context, then its ancestors) gives the same bits as a one-token
// step of that node over the same keys once its path is in the cache. See tree_attention.py.
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
    std::vector<float> s(RB * Lp);
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
      // A row's scores close up over the keys its mask rules out (below -1e30), so its softmax and
      // value sums run over the keys it sees, in the lanes and pairs a one-token step would put
      // them in. `prefix`: the keys it sees before its first unseen one (their pairs are shared).
      int64_t seen[RB], prefix[RB];
      for (int r = 0; r < nr; ++r) {
        float* sr = s.data() + r * Lp;
        int32_t* kr = seen_keys.data() + r * Lp;
        int64_t w = 0, first = L;
        for (int64_t j = 0; j < L; ++j) {
          const float m = mask == nullptr ? 0.f
                        : mask_f32 ? static_cast<const float*>(mask)[(r0 + r) * L + j]
                                   : bf16_value(static_cast<const uint16_t*>(mask)[(r0 + r) * L + j]);
          if (m < -1e30f) {
            first = std::min(first, j);
            continue;
          }
          sr[w] = sr[j];
          kr[w++] = int32_t(j);
        }
        if (w == 0) {            // a row that sees nothing: every key, as SDPA weighs a fully masked row
          for (int64_t j = 0; j < L; ++j) kr[j] = int32_t(j);
          w = L, first = L;      // (its scores were not moved)
        }
        seen[r] = w, prefix[r] = first;
        for (int64_t j = w; j < (w + KB - 1) / KB * KB; ++j) sr[j] = -INFINITY;
      }
      // softmax numerators, rounded to bf16 for the value product, and their fp32 sums
      float inv[RB];
      for (int r = 0; r < nr; ++r) {
        const float* sr = s.data() + r * Lp;
        const int64_t Lr = (seen[r] + KB - 1) / KB * KB;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < Lr; j += KB) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < Lr; j += KB) {
          const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.data() + r * Lp + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
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

}  // namespace

// The checks that keep a wrong call from reading out of bounds live here; tree_attention.py
// decides which calls come here at all.
torch::Tensor tree_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [H, R, D], k and v [H, L, D]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q and k differ in heads or head size");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v");
  const int64_t H = q.size(0), R = q.size(1), L = k.size(1), D = q.size(2);
  TORCH_CHECK(L > 0 && R > 0, "no keys or no queries");
  const void* m = nullptr;
  bool mask_f32 = false;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == R && mask->size(1) == L && mask->is_contiguous(),
                "mask [R, L], contiguous");
    TORCH_CHECK(mask->scalar_type() == at::kFloat || mask->scalar_type() == at::kBFloat16, "additive fp32 or bf16 mask");
    mask_f32 = mask->scalar_type() == at::kFloat;
    m = mask->data_ptr();
  }
  auto out = torch::empty({H, R, D}, q.options());
  auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float sc = float(scale);
  switch (D) {
    case 16: attend<16>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 32: attend<32>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 64: attend<64>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    case 128: attend<128>(qp, kp, vp, m, mask_f32, sc, H, R, L, op); break;
    default: TORCH_CHECK(false, "head size ", D, " is not 16, 32, 64 or 128");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tree_attention", &tree_attention); }
