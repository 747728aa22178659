// Causal attention of one long prompt chunk (fp32, AVX-512, head_dim 64 or 128), the part of
// tetri::ragged_attention that ATen's SDPA ran before (its flash kernel reaches ~90 GFLOP/s
// here at head_dim 64: its GEMMs have K = 64).
//
// Per kv head, the keys of the sequence's context are transposed once into blocks of 64 keys
// ([block][D][64]), shared by every query head of the group and every query tile. A tile of R
// query rows (R x D/16 vectors = 24 accumulators) then walks the key blocks it can see: the
// scores S = Q K^T of the block in a register tile (like tetri::packed_linear's), the causal
// mask on the diagonal blocks, an online softmax per row in fp32, and O += P V in a second
// register tile over the block's value rows. Nothing depends on the other sequences of the
// batch or on the thread split (kv heads are spread over threads).
//
// Returns false (the caller takes SDPA) for anything else: another build, another head_dim,
// a sliding window.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tetri_ops {

struct PrefillArgs {
  const float* q;  // [T, heads, D], strides q_s0, q_s1
  int64_t q_s0, q_s1;
  const float* pk;  // [kv_heads, tokens, D], strides kv_s0, kv_s1
  const float* pv;
  int64_t kv_s0, kv_s1;
  float* out;  // like q, strides o_s0, o_s1
  int64_t o_s0, o_s1;
  int64_t q_start, q_len, ctx_len, kv_start;
  int64_t heads, kv_heads, d;
  float scale;
};

#if defined(CPU_CAPABILITY_AVX512)
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t KB = 64;  // keys per block: 4 vectors of 16
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// One query head, rows [i0, i0 + rows) of the chunk (R >= rows), over the transposed keys kt.
template <int ND>
void tile(const PrefillArgs& a, int64_t hq, const float* kt, const float* vh, int64_t i0,
          int64_t rows) {
  constexpr int R = 24 / ND;
  constexpr int64_t D = 16 * ND;
  alignas(64) float qt[R][D];
  alignas(64) float o[R][D];
  alignas(64) float s[R][KB];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    const float* src = a.q + (a.q_start + i0 + std::min<int64_t>(r, rows - 1)) * a.q_s0 +
                       hq * a.q_s1;
    for (int64_t i = 0; i < D; ++i) qt[r][i] = src[i] * a.scale;
    std::fill_n(o[r], D, 0.f);
    m[r] = kMinusInf;
    l[r] = 0.f;
  }
  const int64_t first_pos = a.ctx_len - a.q_len + i0;  // context position of row 0
  const int64_t last_pos = first_pos + rows - 1;
  for (int64_t b = 0; b * KB <= last_pos; ++b) {
    const float* ktb = kt + b * D * KB;
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < D; ++i) {
      __m512 w[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) w[v] = _mm512_load_ps(ktb + i * KB + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(qt[r][i]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(x, w[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) _mm512_store_ps(s[r] + 16 * v, acc[r][v]);
    }
    const int64_t k0 = b * KB, nk = std::min(KB, a.ctx_len - k0);
    if (k0 + KB - 1 > first_pos) {  // the diagonal: row r sees keys <= first_pos + r
      for (int r = 0; r < R; ++r) {
        for (int64_t j = std::max<int64_t>(0, first_pos + r + 1 - k0); j < KB; ++j) {
          s[r][j] = kMinusInf;
        }
      }
    } else if (nk < KB) {
      for (int r = 0; r < R; ++r) std::fill(s[r] + nk, s[r] + KB, kMinusInf);
    }
    for (int r = 0; r < R; ++r) {  // online softmax; block 0 gives every row a finite max
      Vec mx(kMinusInf);
      for (int64_t j = 0; j < KB; j += 16) mx = at::vec::maximum(mx, Vec::loadu(s[r] + j));
      const float bm = at::vec::vec_reduce_all<float>(
          [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mx);
      const float m_new = std::max(m[r], bm);
      const float c = std::exp(m[r] - m_new);  // 0 on the first block
      Vec sum(0.f);
      const Vec vm(m_new);
      for (int64_t j = 0; j < KB; j += 16) {
        const Vec e = (Vec::loadu(s[r] + j) - vm).exp_u20();
        e.store(s[r] + j);
        sum = sum + e;
      }
      l[r] = l[r] * c + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
      m[r] = m_new;
      if (c != 1.f) {
        const Vec vc(c);
        for (int64_t i = 0; i < D; i += 16) (Vec::loadu(o[r] + i) * vc).store(o[r] + i);
      }
    }
    __m512 ov[R][ND];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < ND; ++v) ov[r][v] = _mm512_load_ps(o[r] + 16 * v);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const float* vrow = vh + (k0 + j) * a.kv_s1;
      __m512 vv[ND];
#pragma GCC unroll 8
      for (int v = 0; v < ND; ++v) vv[v] = _mm512_loadu_ps(vrow + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(s[r][j]);
#pragma GCC unroll 8
        for (int v = 0; v < ND; ++v) ov[r][v] = _mm512_fmadd_ps(p, vv[v], ov[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < ND; ++v) _mm512_store_ps(o[r] + 16 * v, ov[r][v]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (a.q_start + i0 + r) * a.o_s0 + hq * a.o_s1;
    const float inv = 1.f / l[r];
    for (int64_t i = 0; i < D; ++i) dst[i] = o[r][i] * inv;
  }
}

template <int ND>
void run(const PrefillArgs& a) {
  constexpr int R = 24 / ND;
  constexpr int64_t D = 16 * ND;
  const int64_t groups = a.heads / a.kv_heads;
  const int64_t blocks = (a.ctx_len + KB - 1) / KB;
  at::parallel_for(0, a.kv_heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> storage(blocks * D * KB + 16, 0.f);
    float* kt = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    for (int64_t h = h0; h < h1; ++h) {
      const float* kh = a.pk + h * a.kv_s0 + a.kv_start * a.kv_s1;
      const float* vh = a.pv + h * a.kv_s0 + a.kv_start * a.kv_s1;
      std::fill_n(kt, blocks * D * KB, 0.f);
      for (int64_t t = 0; t < a.ctx_len; ++t) {  // kt[t / KB][i][t % KB] = k[t][i]
        const float* krow = kh + t * a.kv_s1;
        float* dst = kt + (t / KB) * D * KB + (t % KB);
        for (int64_t i = 0; i < D; ++i) dst[i * KB] = krow[i];
      }
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i0 = 0; i0 < a.q_len; i0 += R) {
          tile<ND>(a, h * groups + g, kt, vh, i0, std::min<int64_t>(R, a.q_len - i0));
        }
      }
    }
  });
}

}  // namespace
#endif

// Declared in ragged_attention.cpp with the same scalar arguments (no shared header: the build
// hashes only the sources it compiles).
bool tiled_prefill_attention(const float* q, int64_t q_s0, int64_t q_s1, const float* pk,
                             const float* pv, int64_t kv_s0, int64_t kv_s1, float* out,
                             int64_t o_s0, int64_t o_s1, int64_t q_start, int64_t q_len,
                             int64_t ctx_len, int64_t kv_start, int64_t heads,
                             int64_t kv_heads, int64_t d, float scale, int64_t window) {
  const PrefillArgs a{q,       q_s0,  q_s1,    pk,       pv,      kv_s0, kv_s1,
                      out,     o_s0,  o_s1,    q_start,  q_len,   ctx_len, kv_start,
                      heads,   kv_heads, d,    scale};
#if defined(CPU_CAPABILITY_AVX512)
  if (window > 0) return false;
  if (a.d == 64) {
    run<4>(a);
    return true;
  }
  if (a.d == 128) {
    run<8>(a);
    return true;
  }
#else
  (void)a;
  (void)window;
#endif
  return false;
}

}  // namespace tetri_ops
