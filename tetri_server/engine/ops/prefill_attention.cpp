// Causal attention of one long prompt chunk (fp32, AVX-512 or AVX2, head_dim 64 or 128), the
// part of tetri::ragged_attention that ATen's SDPA ran before (its flash kernel reaches ~90
// GFLOP/s on an AVX-512 core at head_dim 64: its GEMMs have K = 64; ~35 on an AVX2 Zen 3 core).
//
// A tile of 48 query rows (3 vectors of 16: a row is a lane) first computes the scores of every
// key it can see, S^T = K Q^T, into a per-thread buffer of [keys][48] floats (L2-resident):
// 8 keys x 3 query vectors = 24 accumulators, each key element broadcast straight from the
// pool's K rows (no transpose). The causal mask and the row maxima are per lane, so a row's
// softmax is exact and takes no horizontal reduction: one max, then p = 2^(s - max) and the
// row sum in one pass. O = P V then runs in blocks of 64 keys (their V and P rows stay in L1)
// with 6 rows x D/16 vectors (3 x 8 at D = 128) in registers, each row group stopping at the
// last key its rows see. Sums run in a fixed order per row, so nothing depends on the other
// sequences of the batch or on the thread split ((query head, tile) items spread over threads).
//
// Returns false (the caller takes SDPA) for anything else: another build, another head_dim,
// a sliding window. The AVX2 build runs the same algorithm with its own tile sizes (below).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
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

constexpr int NV = 3;             // query vectors of 16 rows per tile
constexpr int64_t QT = 16 * NV;   // query rows per tile: the lanes of the score rows
constexpr int KG = 8;             // keys per score register tile (NV x KG = 24 accumulators)
constexpr int64_t KB = 64;        // keys per P V block (its V and P rows stay in L1)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch of one query tile, rows of QT floats (lane = query row of the tile).
struct Scratch {
  float* qt;  // [D][QT]: the tile's queries, transposed, times scale * log2(e)
  float* p;   // [keys][QT]: scores S^T (log2 units), then the unnormalised probabilities
  float* o;   // [QT][D]: P V of the rows, carried across key blocks
};

// 2^x for x <= 0: 2^(x - floor x) by a degree-6 polynomial on [0, 1) (~1.5 ulp), scaled by
// 2^floor(x); exactly 0 below 2^-126 (so -inf, the masked scores, gives 0 and no denormal
// reaches P V); NaN stays NaN.
inline __m512 exp2_neg(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_set1_ps(2.161292941e-04f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.246784115e-03f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.675452486e-03f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.548528209e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402293086e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931470633e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(keep, y, x);
}

// r[i][j] <- r[j][i] for a 16 x 16 block of floats.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// S^T of keys k0..k0+KG-1 (rows of kh; indices past klast read row klast) for the query
// vectors v0..v0+N-1 of the tile, into p (rows of QT). Not inlined: its 24 accumulators need
// the whole register file.
template <int N, int64_t D>
__attribute__((noinline)) void score_tile(const float* qt, int v0, const float* kh, int64_t ks,
                                          int64_t k0, int64_t klast, float* p) {
  const float* kr[KG];
  for (int j = 0; j < KG; ++j) kr[j] = kh + std::min<int64_t>(k0 + j, klast) * ks;
  __m512 acc[N][KG];
  for (int v = 0; v < N; ++v) {
    for (int j = 0; j < KG; ++j) acc[v][j] = _mm512_setzero_ps();
  }
#pragma GCC unroll 2
  for (int64_t i = 0; i < D; ++i) {
    __m512 qv[N];
    for (int v = 0; v < N; ++v) qv[v] = _mm512_load_ps(qt + i * QT + 16 * (v0 + v));
#pragma GCC unroll 8
    for (int j = 0; j < KG; ++j) {
      const __m512 kb = _mm512_set1_ps(kr[j][i]);
      for (int v = 0; v < N; ++v) acc[v][j] = _mm512_fmadd_ps(qv[v], kb, acc[v][j]);
    }
  }
  for (int v = 0; v < N; ++v) {
    for (int j = 0; j < KG; ++j) _mm512_store_ps(p + (k0 + j) * QT + 16 * (v0 + v), acc[v][j]);
  }
}

// Scores of the keys k0..k0+KG-1 into s.p for the query vectors v0..v0+N-1 (the vectors
// before v0 see none of these keys: they get -inf), masked causally (lane r sees keys <=
// pos[r]), with the running row maxima mx.
template <int N, int64_t D>
inline void score_group(const Scratch& s, const float* kh, int64_t ks, int64_t k0,
                        int64_t klast, int v0, const __m512i (&pos)[NV],
                        const int64_t (&pos0)[NV], __m512 (&mx)[NV]) {
  score_tile<N, D>(s.qt, v0, kh, ks, k0, klast, s.p);
#pragma GCC unroll 3
  for (int v = 0; v < NV; ++v) {
    if (v >= v0 + N) break;
    for (int j = 0; j < KG; ++j) {
      float* pj = s.p + (k0 + j) * QT + 16 * v;
      if (v < v0) {
        _mm512_store_ps(pj, _mm512_set1_ps(kMinusInf));
        continue;
      }
      __m512 x = _mm512_load_ps(pj);
      if (k0 + j > pos0[v]) {  // the diagonal
        const __mmask16 seen = _mm512_cmp_epi32_mask(
            pos[v], _mm512_set1_epi32(static_cast<int>(k0 + j)), _MM_CMPINT_NLT);
        x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kMinusInf), x);
        _mm512_store_ps(pj, x);
      }
      mx[v] = _mm512_max_ps(mx[v], x);
    }
  }
}

// O[r0..r0+R) (in s.o) += P[rows][k0..k1) V[k0..k1); the first block starts from zero. Rows of
// the last group past the tile's rows read lanes holding finite values (zeros or an earlier
// tile's probabilities) and are never written out.
template <int ND>
inline void pv_block(const Scratch& s, const float* vh, int64_t vs, int64_t r0, int64_t k0,
                     int64_t k1) {
  constexpr int R = 24 / ND;
  constexpr int64_t D = 16 * ND;
  __m512 ov[R][ND];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < ND; ++v) {
      ov[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(s.o + (r0 + r) * D + 16 * v);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* vrow = vh + k * vs;
    const float* prow = s.p + k * QT + r0;
    __m512 vv[ND];
#pragma GCC unroll 8
    for (int v = 0; v < ND; ++v) vv[v] = _mm512_loadu_ps(vrow + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(prow[r]);
#pragma GCC unroll 8
      for (int v = 0; v < ND; ++v) ov[r][v] = _mm512_fmadd_ps(pr, vv[v], ov[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < ND; ++v) _mm512_store_ps(s.o + (r0 + r) * D + 16 * v, ov[r][v]);
  }
}

// p = 2^(s - max) over the keys [k0, k1) of the query vectors [0, nv), the row sums in two
// fixed halves (even and odd keys; k0 even).
inline void exp_block(const Scratch& s, int64_t k0, int64_t k1, int nv, const __m512 (&mx)[NV],
                      __m512 (&l)[NV][2]) {
  for (int64_t k = k0; k < k1; k += 2) {
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) {
        if (v >= nv) break;
        float* pk = s.p + (k + h) * QT + 16 * v;
        const __m512 e = exp2_neg(_mm512_sub_ps(_mm512_load_ps(pk), mx[v]));
        _mm512_store_ps(pk, e);
        l[v][h] = _mm512_add_ps(l[v][h], e);
      }
    }
  }
}

// s.qt = Q^T * scale * log2(e) for the query vectors [0, nv) of the tile at row i0 of head
// hq; lanes past `rows` repeat the last row.
template <int64_t D>
inline void transposed_queries(const PrefillArgs& a, const Scratch& s, int64_t hq, int64_t i0,
                               int64_t rows, int nv) {
  const __m512 qscale = _mm512_set1_ps(a.scale * kLog2e);
  for (int v = 0; v < nv; ++v) {
    for (int64_t c = 0; c < D; c += 16) {
      __m512 blk[16];
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = a.q_start + i0 + std::min(16 * v + r, rows - 1);
        blk[r] = _mm512_mul_ps(_mm512_loadu_ps(a.q + row * a.q_s0 + hq * a.q_s1 + c), qscale);
      }
      transpose16(blk);
      for (int64_t i = 0; i < 16; ++i) _mm512_store_ps(s.qt + (c + i) * QT + 16 * v, blk[i]);
    }
  }
}

// One query head, rows [i0, i0 + rows) of the chunk, rows <= QT: all visible scores, one
// exact softmax per row (one max, one exp and sum pass), then P V, in key blocks.
template <int ND>
void tile(const PrefillArgs& a, const Scratch& s, int64_t hq, const float* kh, const float* vh,
          int64_t i0, int64_t rows) {
  constexpr int R = 24 / ND;
  constexpr int64_t D = 16 * ND;
  const int64_t first_pos = a.ctx_len - a.q_len + i0;  // context position of row 0
  const int64_t nk = first_pos + rows;                 // keys seen by the last row
  const int nv = static_cast<int>((rows + 15) / 16);  // query vectors in use
  transposed_queries<D>(a, s, hq, i0, rows, nv);
  __m512i pos[NV];
  int64_t pos0[NV], posn[NV];  // first and last row position of each query vector
  __m512 mx[NV], l[NV][2];
  for (int v = 0; v < NV; ++v) {
    const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(16 * v), _mm512_set_epi32(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i last = _mm512_set1_epi32(static_cast<int>(rows - 1));
    pos[v] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos)),
                              _mm512_min_epi32(lane, last));
    pos0[v] = first_pos + std::min<int64_t>(16 * v, rows - 1);
    posn[v] = first_pos + std::min<int64_t>(16 * v + 15, rows - 1);
    mx[v] = _mm512_set1_ps(kMinusInf);
    l[v][0] = l[v][1] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < nk; k0 += KG) {  // key 0 is seen by every row: the maxima end finite
    int v0 = 0;  // the first query vector that sees key k0
    while (posn[v0] < k0) ++v0;
    switch (nv - v0) {
      case 3: score_group<3, D>(s, kh, a.kv_s1, k0, nk - 1, v0, pos, pos0, mx); break;
      case 2: score_group<2, D>(s, kh, a.kv_s1, k0, nk - 1, v0, pos, pos0, mx); break;
      default: score_group<1, D>(s, kh, a.kv_s1, k0, nk - 1, v0, pos, pos0, mx); break;
    }
  }
  const int64_t nk_pad = (nk + KG - 1) / KG * KG;  // the scores written
  for (int64_t k0 = 0; k0 < nk; k0 += KB) {
    exp_block(s, k0, std::min(k0 + KB, nk_pad), nv, mx, l);
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t kend = first_pos + std::min<int64_t>(r0 + R, rows);  // keys the group sees
      if (k0 < kend) pv_block<ND>(s, vh, a.kv_s1, r0, k0, std::min(k0 + KB, kend));
    }
  }
  alignas(64) float lsum[QT];
  for (int v = 0; v < NV; ++v) _mm512_store_ps(lsum + 16 * v, _mm512_add_ps(l[v][0], l[v][1]));
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (a.q_start + i0 + r) * a.o_s0 + hq * a.o_s1;
    const float inv = 1.f / lsum[r];
    for (int64_t i = 0; i < D; ++i) dst[i] = s.o[r * D + i] * inv;
  }
}

// Items (query head, tile of QT rows) spread over torch's threads, each thread with its own
// scratch; an item's result does not depend on which thread runs it or with what else.
template <int ND>
void run(const PrefillArgs& a) {
  constexpr int64_t D = 16 * ND;
  const int64_t groups = a.heads / a.kv_heads;
  const int64_t p_rows = (a.ctx_len + KG - 1) / KG * KG;
  const int64_t tiles = (a.q_len + QT - 1) / QT;
  at::parallel_for(0, a.heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> storage((2 * D + p_rows) * QT + 16);
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    const Scratch s{base, base + D * QT, base + (D + p_rows) * QT};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t hq = item / tiles, i0 = item % tiles * QT;
      const int64_t h = hq / groups;  // the kv head of query head hq
      const float* kh = a.pk + h * a.kv_s0 + a.kv_start * a.kv_s1;
      const float* vh = a.pv + h * a.kv_s0 + a.kv_start * a.kv_s1;
      tile<ND>(a, s, hq, kh, vh, i0, std::min<int64_t>(QT, a.q_len - i0));
    }
  });
}

}  // namespace
#elif defined(CPU_CAPABILITY_AVX2)
// The same algorithm for AVX2 (8 lanes, 16 registers): tiles of 16 query rows (2 vectors), score
// register tiles of 2 query vectors x 6 keys (12 accumulators), P V in groups of 2 rows x 4
// vectors (32 dims) of the head at a time. Tested on this build by
// tests/unit/test_prefill_attention.py like the AVX-512 one.
namespace {

constexpr int NV = 2;             // query vectors of 8 rows per tile
constexpr int64_t QT = 8 * NV;    // query rows per tile: the lanes of the score rows
constexpr int KG = 6;             // keys per score register tile (NV x KG = 12 accumulators)
constexpr int64_t KB = 64;        // keys per P V block (its V and P rows stay in L1)
constexpr int R = 2;              // rows per P V register group (R x 4 accumulators)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct Scratch {
  float* qt;  // [D][QT]: the tile's queries, transposed, times scale * log2(e)
  float* p;   // [keys][QT]: scores S^T (log2 units), then the unnormalised probabilities
  float* o;   // [QT][D]: P V of the rows, carried across key blocks
};

// 2^x for x <= 0, as exp2_neg of the AVX-512 build: the same polynomial of x - floor(x) times
// 2^floor(x) (exact), 0 below -126 (-inf gives 0), NaN stays NaN.
inline __m256 exp2_neg(__m256 x) {
  const __m256 fl = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, fl);
  __m256 y = _mm256_set1_ps(2.161292941e-04f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.246784115e-03f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.675452486e-03f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.548528209e-02f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.402293086e-01f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931470633e-01f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.f));
  const __m256i n = _mm256_cvttps_epi32(_mm256_max_ps(fl, _mm256_set1_ps(-127.f)));
  const __m256 scale = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_NLT_UQ);
  return _mm256_and_ps(_mm256_mul_ps(y, scale), keep);
}

// r[i][j] <- r[j][i] for an 8 x 8 block of floats.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// S^T of keys k0..k0+KG-1 (rows of kh; indices past klast read row klast) for the query
// vectors v0..v0+N-1 of the tile, into p (rows of QT).
template <int N, int64_t D>
__attribute__((noinline)) void score_tile(const float* qt, int v0, const float* kh, int64_t ks,
                                          int64_t k0, int64_t klast, float* p) {
  const float* kr[KG];
  for (int j = 0; j < KG; ++j) kr[j] = kh + std::min<int64_t>(k0 + j, klast) * ks;
  __m256 acc[N][KG];
  for (int v = 0; v < N; ++v) {
    for (int j = 0; j < KG; ++j) acc[v][j] = _mm256_setzero_ps();
  }
#pragma GCC unroll 2
  for (int64_t i = 0; i < D; ++i) {
    __m256 qv[N];
    for (int v = 0; v < N; ++v) qv[v] = _mm256_load_ps(qt + i * QT + 8 * (v0 + v));
#pragma GCC unroll 6
    for (int j = 0; j < KG; ++j) {
      const __m256 kb = _mm256_broadcast_ss(kr[j] + i);
      for (int v = 0; v < N; ++v) acc[v][j] = _mm256_fmadd_ps(qv[v], kb, acc[v][j]);
    }
  }
  for (int v = 0; v < N; ++v) {
    for (int j = 0; j < KG; ++j) _mm256_store_ps(p + (k0 + j) * QT + 8 * (v0 + v), acc[v][j]);
  }
}

// Scores of the keys k0..k0+KG-1 into s.p for the query vectors v0..v0+N-1 (the vectors
// before v0 see none of these keys: they get -inf), masked causally (lane r sees keys <=
// pos[r]), with the running row maxima mx.
template <int N, int64_t D>
inline void score_group(const Scratch& s, const float* kh, int64_t ks, int64_t k0,
                        int64_t klast, int v0, const __m256i (&pos)[NV],
                        const int64_t (&pos0)[NV], __m256 (&mx)[NV]) {
  score_tile<N, D>(s.qt, v0, kh, ks, k0, klast, s.p);
  for (int v = 0; v < NV; ++v) {
    if (v >= v0 + N) break;
    for (int j = 0; j < KG; ++j) {
      float* pj = s.p + (k0 + j) * QT + 8 * v;
      if (v < v0) {
        _mm256_store_ps(pj, _mm256_set1_ps(kMinusInf));
        continue;
      }
      __m256 x = _mm256_load_ps(pj);
      if (k0 + j > pos0[v]) {  // the diagonal: lanes whose row sees key k0 + j keep it
        const __m256i seen = _mm256_cmpgt_epi32(
            pos[v], _mm256_set1_epi32(static_cast<int>(k0 + j - 1)));
        x = _mm256_blendv_ps(_mm256_set1_ps(kMinusInf), x, _mm256_castsi256_ps(seen));
        _mm256_store_ps(pj, x);
      }
      mx[v] = _mm256_max_ps(mx[v], x);
    }
  }
}

// O[r0..r0+R) (in s.o) += P[rows][k0..k1) V[k0..k1), 32 dims at a time; the first block
// starts from zero. A group's row past the tile's rows reads lanes holding finite values (the
// repeated last row) and is never written out.
template <int64_t D>
inline void pv_block(const Scratch& s, const float* vh, int64_t vs, int64_t r0, int64_t k0,
                     int64_t k1) {
  for (int64_t c = 0; c < D; c += 32) {
    __m256 ov[R][4];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) {
        ov[r][v] = k0 == 0 ? _mm256_setzero_ps()
                           : _mm256_load_ps(s.o + (r0 + r) * D + c + 8 * v);
      }
    }
    for (int64_t k = k0; k < k1; ++k) {
      const float* vrow = vh + k * vs + c;
      const float* prow = s.p + k * QT + r0;
      __m256 vv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) vv[v] = _mm256_loadu_ps(vrow + 8 * v);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 pr = _mm256_broadcast_ss(prow + r);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) ov[r][v] = _mm256_fmadd_ps(pr, vv[v], ov[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < 4; ++v) _mm256_store_ps(s.o + (r0 + r) * D + c + 8 * v, ov[r][v]);
    }
  }
}

// p = 2^(s - max) over the keys [k0, k1) of the query vectors [0, nv), the row sums in two
// fixed halves (even and odd keys; k0 even).
inline void exp_block(const Scratch& s, int64_t k0, int64_t k1, int nv, const __m256 (&mx)[NV],
                      __m256 (&l)[NV][2]) {
  for (int64_t k = k0; k < k1; k += 2) {
    for (int h = 0; h < 2; ++h) {
      for (int v = 0; v < NV; ++v) {
        if (v >= nv) break;
        float* pk = s.p + (k + h) * QT + 8 * v;
        const __m256 e = exp2_neg(_mm256_sub_ps(_mm256_load_ps(pk), mx[v]));
        _mm256_store_ps(pk, e);
        l[v][h] = _mm256_add_ps(l[v][h], e);
      }
    }
  }
}

// s.qt = Q^T * scale * log2(e) for the query vectors [0, nv) of the tile at row i0 of head
// hq; lanes past `rows` repeat the last row.
template <int64_t D>
inline void transposed_queries(const PrefillArgs& a, const Scratch& s, int64_t hq, int64_t i0,
                               int64_t rows, int nv) {
  const __m256 qscale = _mm256_set1_ps(a.scale * kLog2e);
  for (int v = 0; v < nv; ++v) {
    for (int64_t c = 0; c < D; c += 8) {
      __m256 blk[8];
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t row = a.q_start + i0 + std::min(8 * v + r, rows - 1);
        blk[r] = _mm256_mul_ps(_mm256_loadu_ps(a.q + row * a.q_s0 + hq * a.q_s1 + c), qscale);
      }
      transpose8(blk);
      for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(s.qt + (c + i) * QT + 8 * v, blk[i]);
    }
  }
}

// One query head, rows [i0, i0 + rows) of the chunk, rows <= QT: all visible scores, one
// exact softmax per row (one max, one exp and sum pass), then P V, in key blocks.
template <int64_t D>
void tile(const PrefillArgs& a, const Scratch& s, int64_t hq, const float* kh, const float* vh,
          int64_t i0, int64_t rows) {
  const int64_t first_pos = a.ctx_len - a.q_len + i0;  // context position of row 0
  const int64_t nk = first_pos + rows;                 // keys seen by the last row
  const int nv = static_cast<int>((rows + 7) / 8);    // query vectors in use
  transposed_queries<D>(a, s, hq, i0, rows, nv);
  __m256i pos[NV];
  int64_t pos0[NV], posn[NV];  // first and last row position of each query vector
  __m256 mx[NV], l[NV][2];
  for (int v = 0; v < NV; ++v) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(8 * v),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i last = _mm256_set1_epi32(static_cast<int>(rows - 1));
    pos[v] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first_pos)),
                              _mm256_min_epi32(lane, last));
    pos0[v] = first_pos + std::min<int64_t>(8 * v, rows - 1);
    posn[v] = first_pos + std::min<int64_t>(8 * v + 7, rows - 1);
    mx[v] = _mm256_set1_ps(kMinusInf);
    l[v][0] = l[v][1] = _mm256_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < nk; k0 += KG) {  // key 0 is seen by every row: the maxima end finite
    int v0 = 0;  // the first query vector that sees key k0
    while (posn[v0] < k0) ++v0;
    if (nv - v0 == 2) {
      score_group<2, D>(s, kh, a.kv_s1, k0, nk - 1, v0, pos, pos0, mx);
    } else {
      score_group<1, D>(s, kh, a.kv_s1, k0, nk - 1, v0, pos, pos0, mx);
    }
  }
  const int64_t nk_pad = (nk + KG - 1) / KG * KG;  // the scores written
  for (int64_t k0 = 0; k0 < nk; k0 += KB) {
    exp_block(s, k0, std::min(k0 + KB, nk_pad), nv, mx, l);
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t kend = first_pos + std::min<int64_t>(r0 + R, rows);  // keys the group sees
      if (k0 < kend) pv_block<D>(s, vh, a.kv_s1, r0, k0, std::min(k0 + KB, kend));
    }
  }
  alignas(32) float lsum[QT];
  for (int v = 0; v < NV; ++v) _mm256_store_ps(lsum + 8 * v, _mm256_add_ps(l[v][0], l[v][1]));
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (a.q_start + i0 + r) * a.o_s0 + hq * a.o_s1;
    const float inv = 1.f / lsum[r];
    for (int64_t i = 0; i < D; ++i) dst[i] = s.o[r * D + i] * inv;
  }
}

// Items (query head, tile of QT rows) spread over torch's threads, each thread with its own
// scratch; an item's result does not depend on which thread runs it or with what else.
template <int64_t D>
void run(const PrefillArgs& a) {
  const int64_t groups = a.heads / a.kv_heads;
  const int64_t p_rows = (a.ctx_len + KG - 1) / KG * KG;
  const int64_t tiles = (a.q_len + QT - 1) / QT;
  at::parallel_for(0, a.heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> storage((2 * D + p_rows) * QT + 16);
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    const Scratch s{base, base + D * QT, base + (D + p_rows) * QT};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t hq = item / tiles, i0 = item % tiles * QT;
      const int64_t h = hq / groups;  // the kv head of query head hq
      const float* kh = a.pk + h * a.kv_s0 + a.kv_start * a.kv_s1;
      const float* vh = a.pv + h * a.kv_s0 + a.kv_start * a.kv_s1;
      tile<D>(a, s, hq, kh, vh, i0, std::min<int64_t>(QT, a.q_len - i0));
    }
  });
}

}  // namespace
#endif

bool covers(int64_t d, int64_t window) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return window <= 0 && (d == 64 || d == 128);
#else
  (void)d;
  (void)window;
  return false;
#endif
}

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
  if (!covers(a.d, window)) return false;
#if defined(CPU_CAPABILITY_AVX512)
  if (a.d == 64) {
    run<4>(a);
    return true;
  }
  if (a.d == 128) {
    run<8>(a);
    return true;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (a.d == 64) {
    run<64>(a);
    return true;
  }
  if (a.d == 128) {
    run<128>(a);
    return true;
  }
#else
  (void)a;
#endif
  return false;
}

}  // namespace tetri_ops

// tetri::tiled_prefill_covers(head_dim, window): whether prompt chunks of that shape take this
// kernel in this build (else SDPA); tests check the kernel they mean to test really runs.
TORCH_LIBRARY_FRAGMENT(tetri, m) {
  m.def("tiled_prefill_covers(int head_dim, int window) -> bool");
}

namespace {
bool covers_op(int64_t d, int64_t window) { return tetri_ops::covers(d, window); }
}  // namespace

TORCH_LIBRARY_IMPL(tetri, CatchAll, m) { m.impl("tiled_prefill_covers", &covers_op); }
