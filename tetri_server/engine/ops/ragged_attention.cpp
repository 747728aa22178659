// tetri::ragged_attention: one attention call per layer for a packed, ragged batch over the
// KV pool (see tetri_server/engine/attention.py for the layout and the reference loop).
//
// Built at first use by tetri_server/engine/ops/__init__.py, once per CPU capability (the
// -DCPU_CAPABILITY_* macro and -m flags select ATen's Vectorized<float> width; never
// -march=native).
//
// Rows of sequences with q_len < kSdpaMinQ (decode tokens, short chunks) run the kernel below:
// one work item per (sequence, kv head) covers every query row and every query head of that
// kv head's group. Per row the keys are walked in order in blocks of kKeyBlock with an online
// softmax in fp32; nothing depends on the other sequences of the batch or on how items are
// spread over threads. On a token-major pool (a token's kv heads side by side) fp32 decode rows
// read the keys in address order instead (attend_token_major), with the same float operations.
// Prompt rows (fp32, head_dim a multiple of the vector width up to kMaxND Vecs, no sliding
// window) go in tiles of a few rows that
// share each whole key block they all see (each key and value row read once a tile, not once a
// row), with the same float operations per row as a row alone: a row's bits do not depend on
// the tile it lands in.
// Longer prompt chunks run the tiled kernel of prefill_attention.cpp (fp32, AVX-512, head_dim
// 64 or 128, no sliding window), else ATen's SDPA on views of their extent, with the same
// masks as the reference loop. With tetri::set_attention_rows_only(true) (model.batch_invariant)
// every row runs the kernel below: a row's result then depends only on its query, its position
// and the keys, not on the chunk it came in or the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace tetri_ops {  // prefill_attention.cpp: false when it does not cover the case
bool tiled_prefill_attention(const float* q, int64_t q_s0, int64_t q_s1, const float* pk,
                             const float* pv, int64_t kv_s0, int64_t kv_s1, float* out,
                             int64_t o_s0, int64_t o_s1, int64_t q_start, int64_t q_len,
                             int64_t ctx_len, int64_t kv_start, int64_t heads,
                             int64_t kv_heads, int64_t d, float scale, int64_t window);
}  // namespace tetri_ops

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kKeyBlock = 64;   // keys per online-softmax step
constexpr int64_t kSdpaMinQ = 16;   // prompt chunks at least this long go to ATen's SDPA

std::atomic<bool> g_rows_only{false};  // every row through the row kernel (batch invariance)

struct SeqInfo {
  int64_t q_start, q_len, ctx_len, kv_start;
};

// Row `src` of D elements as floats: the row itself for fp32, else converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t d) {
  using VT = at::vec::Vectorized<T>;
  int64_t i = 0;
  for (; i + VT::size() <= d; i += VT::size()) {
    auto [lo, hi] = at::vec::convert_to_float<T>(VT::loadu(src + i));
    lo.store(buf + i);
    hi.store(buf + i + Vec::size());
  }
  for (; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// Ask for a row's cache lines ahead of use (the KV stream is read once, from DRAM).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);  // into L2
}

inline float dot(const float* a, const float* b, int64_t d) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// y = y * c + p * x over d floats
inline void scale_add(float* y, float c, float p, const float* x, int64_t d) {
  const Vec vc(c), vp(p);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    at::vec::fmadd(Vec::loadu(x + i), vp, Vec::loadu(y + i) * vc).store(y + i);
  }
  for (; i < d; ++i) y[i] = y[i] * c + p * x[i];
}

// p[j] = exp(p[j] - m) for j < n; returns their sum
inline float exp_shift_sum(float* p, float m, int64_t n) {
  const Vec vm(m);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec e = (Vec::loadu(p + j) - vm).exp_u20();
    e.store(p + j);
    acc = acc + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - m);
    s += p[j];
  }
  return s;
}

// fp32 rows of ND vectors (head_dim = ND * Vec::size()): the two passes over a block of keys
// with the query / the running output in registers (up to 8 Vecs; past that the query is read
// from L1 and the output goes in two passes of at most 8). Same float operations in the same order as
// dot() / scale_add() above, so the results are bit for bit those of the generic path.
//   block_scores: out[j] = dot(q, k_j) * scale for n keys, four keys at a time; prefetches
//     `pf_rows` rows from `pf` (stride ks) spread over the keys (nullptr: none).
//   block_values: acc = acc * c + sum_j p[j] * v_j, keys in order; prefetches likewise from
//     `pf_k` and `pf_v`.
inline void prefetch_spread(const float*& pf_k, const float*& pf_v, int64_t& credit, int64_t rows,
                            int64_t n, int64_t stride, int64_t bytes) {
  for (credit += rows; credit >= n; credit -= n) {
    if (pf_k != nullptr) { prefetch_row(pf_k, bytes); pf_k += stride; }
    if (pf_v != nullptr) { prefetch_row(pf_v, bytes); pf_v += stride; }
  }
}

// out[0..3] = vec_reduce_all(sum, a_j) * scale for four accumulators at once: the same adds on
// the same operands as ATen's reduction ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)), so bit for bit
// its results, with 128-bit shuffles (no lane-crossing permute per key).
inline void reduce4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float scale,
                    float* out) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  const __m256 v0 = a0, v1 = a1, v2 = a2, v3 = a3;
  const __m128 b0 = _mm_add_ps(_mm256_castps256_ps128(v0), _mm256_extractf128_ps(v0, 1));
  const __m128 b1 = _mm_add_ps(_mm256_castps256_ps128(v1), _mm256_extractf128_ps(v1, 1));
  const __m128 b2 = _mm_add_ps(_mm256_castps256_ps128(v2), _mm256_extractf128_ps(v2, 1));
  const __m128 b3 = _mm_add_ps(_mm256_castps256_ps128(v3), _mm256_extractf128_ps(v3, 1));
  // [k.b0 + k.b2, k.b1 + k.b3] for keys (0, 1) and (2, 3)
  const __m128 c01 = _mm_add_ps(_mm_shuffle_ps(b0, b1, 0x44), _mm_shuffle_ps(b0, b1, 0xEE));
  const __m128 c23 = _mm_add_ps(_mm_shuffle_ps(b2, b3, 0x44), _mm_shuffle_ps(b2, b3, 0xEE));
  const __m128 d = _mm_add_ps(_mm_shuffle_ps(c01, c23, 0x88), _mm_shuffle_ps(c01, c23, 0xDD));
  _mm_storeu_ps(out, _mm_mul_ps(d, _mm_set1_ps(scale)));
#else
  const auto sum = [](Vec& x, Vec& y) { return x + y; };
  out[0] = at::vec::vec_reduce_all<float>(sum, a0) * scale;
  out[1] = at::vec::vec_reduce_all<float>(sum, a1) * scale;
  out[2] = at::vec::vec_reduce_all<float>(sum, a2) * scale;
  out[3] = at::vec::vec_reduce_all<float>(sum, a3) * scale;
#endif
}

template <int ND>
void block_scores(const float* q, const float* k, int64_t ks, int64_t n, float scale, float* out,
                  const float* pf, int64_t pf_rows) {
  constexpr int64_t VS = Vec::size();
  const auto sum = [](Vec& x, Vec& y) { return x + y; };
  // the query in registers up to 8 Vecs; past that each Vec is read again (from L1) per use
  constexpr int kHeld = ND <= 8 ? ND : 1;
  Vec held[kHeld];
  for (int i = 0; i < kHeld; ++i) held[i] = Vec::loadu(q + i * VS);
  const auto qv = [&](int i) -> Vec {
    if constexpr (ND <= 8) return held[i];
    else return Vec::loadu(q + i * VS);
  };
  const float* none = nullptr;
  int64_t credit = 0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_spread(pf, none, credit, 4 * pf_rows, n, ks, ND * VS * 4);
    const float* k0 = k + j * ks;
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
#pragma GCC unroll 8
    for (int i = 0; i < ND; ++i) {
      a0 = at::vec::fmadd(qv(i), Vec::loadu(k0 + i * VS), a0);
      a1 = at::vec::fmadd(qv(i), Vec::loadu(k0 + ks + i * VS), a1);
      a2 = at::vec::fmadd(qv(i), Vec::loadu(k0 + 2 * ks + i * VS), a2);
      a3 = at::vec::fmadd(qv(i), Vec::loadu(k0 + 3 * ks + i * VS), a3);
    }
    reduce4(a0, a1, a2, a3, scale, out + j);
  }
  for (; j < n; ++j) {
    prefetch_spread(pf, none, credit, pf_rows, n, ks, ND * VS * 4);
    Vec a(0.f);
    for (int i = 0; i < ND; ++i) a = at::vec::fmadd(qv(i), Vec::loadu(k + j * ks + i * VS), a);
    out[j] = at::vec::vec_reduce_all<float>(sum, a) * scale;
  }
}

// One pass of block_values over NP Vecs of the head dim from Vec i0 (held in registers).
template <int NP>
inline void values_pass(float* acc, const Vec& vc, const float* p, const float* v, int64_t vs,
                        int64_t n, const float* pf_k, const float* pf_v, int64_t pf_rows,
                        int64_t row_bytes) {
  constexpr int64_t VS = Vec::size();
  Vec a[NP];
  for (int i = 0; i < NP; ++i) a[i] = Vec::loadu(acc + i * VS) * vc;
  int64_t credit = 0;
  for (int64_t j = 0; j < n; ++j) {
    prefetch_spread(pf_k, pf_v, credit, pf_rows, n, vs, row_bytes);
    const Vec pj(p[j]);
    const float* vj = v + j * vs;
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) a[i] = at::vec::fmadd(Vec::loadu(vj + i * VS), pj, a[i]);
  }
  for (int i = 0; i < NP; ++i) a[i].store(acc + i * VS);
}

template <int ND>
void block_values(float* acc, float c, const float* p, const float* v, int64_t vs, int64_t n,
                  const float* pf_k, const float* pf_v, int64_t pf_rows) {
  constexpr int64_t VS = Vec::size();
  const Vec vc(c);
  if constexpr (ND <= 8) {
    values_pass<ND>(acc, vc, p, v, vs, n, pf_k, pf_v, pf_rows, ND * VS * 4);
  } else {  // two passes (each element's adds still in key order); the first one prefetches
    values_pass<8>(acc, vc, p, v, vs, n, pf_k, pf_v, pf_rows, ND * VS * 4);
    values_pass<ND - 8>(acc + 8 * VS, vc, p, v + 8 * VS, vs, n, nullptr, nullptr, 0, 0);
  }
}

// The largest of p[0..n) (a max is exact: the order it is taken in does not matter).
inline float block_max(const float* p, int64_t n) {
  int64_t j = 0;
  float mx = -std::numeric_limits<float>::infinity();
  if (n >= Vec::size()) {
    Vec acc = Vec::loadu(p);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) {
      acc = at::vec::maximum(acc, Vec::loadu(p + j));
    }
    mx = at::vec::vec_reduce_all<float>(
        [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, acc);
  }
  for (; j < n; ++j) mx = std::max(mx, p[j]);
  return mx;
}

// The online-softmax step of one query vector over a block of n scores (turned into exp(s - m) in
// place): one function for every path, so the float operations are the same wherever it runs.
inline void softmax_step(float* p, int64_t n, float& m, float& l, float& c) {
  const float m_new = std::max(m, block_max(p, n));
  c = std::exp(m - m_new);  // rescale of the running sums; 0 on the first block
  const float block_sum = exp_shift_sum(p, m_new, n);
  // the product rounded, never fused into the add: whether the compiler contracts
  // l * c + block_sum into an FMA depends on the code around it, and every path must round alike
  volatile float scaled = l * c;
  l = scaled + block_sum;
  m = m_new;
}

// Several query vectors of one kv head over one whole block of kKeyBlock keys (prompt rows: each
// key and value row is read once for the tile, not once a row). Per vector the same float
// operations in the same order as block_scores / block_values, so a vector's result is bit for
// bit what it gets alone (model.batch_invariant relies on it).
//   tile_scores: out[t][j] = dot(q[t], k_j) * scale; two vectors x four keys at a time.
//   tile_values: acc[t] = acc[t] * c[t] + sum_j p[t][j] * v_j; four vectors x two of the head
//     dim's Vecs at a time, keys in order.
template <int ND>
void tile_scores(const float* const* q, int64_t nv, const float* k, int64_t ks, float scale,
                 float* const* out) {
  constexpr int64_t VS = Vec::size();
  int64_t t = 0;
  for (; t + 2 <= nv; t += 2) {
    const float* q0 = q[t];
    const float* q1 = q[t + 1];
    for (int64_t j = 0; j < kKeyBlock; j += 4) {
      const float* k0 = k + j * ks;
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), b0(0.f), b1(0.f), b2(0.f), b3(0.f);
#pragma GCC unroll 8
      for (int i = 0; i < ND; ++i) {
        const Vec x0 = Vec::loadu(k0 + i * VS), x1 = Vec::loadu(k0 + ks + i * VS);
        const Vec x2 = Vec::loadu(k0 + 2 * ks + i * VS), x3 = Vec::loadu(k0 + 3 * ks + i * VS);
        const Vec u = Vec::loadu(q0 + i * VS);
        a0 = at::vec::fmadd(u, x0, a0);
        a1 = at::vec::fmadd(u, x1, a1);
        a2 = at::vec::fmadd(u, x2, a2);
        a3 = at::vec::fmadd(u, x3, a3);
        const Vec w = Vec::loadu(q1 + i * VS);
        b0 = at::vec::fmadd(w, x0, b0);
        b1 = at::vec::fmadd(w, x1, b1);
        b2 = at::vec::fmadd(w, x2, b2);
        b3 = at::vec::fmadd(w, x3, b3);
      }
      reduce4(a0, a1, a2, a3, scale, out[t] + j);
      reduce4(b0, b1, b2, b3, scale, out[t + 1] + j);
    }
  }
  for (; t < nv; ++t) block_scores<ND>(q[t], k, ks, kKeyBlock, scale, out[t], nullptr, 0);
}

template <int ND>
void tile_values(float* const* acc, const float* c, const float* const* p, int64_t nv,
                 const float* v, int64_t vs) {
  constexpr int64_t VS = Vec::size();
  int64_t t = 0;
  for (; t + 4 <= nv; t += 4) {
    for (int i0 = 0; i0 < ND; i0 += 2) {
      const int w = std::min(2, ND - i0);  // Vecs of the head dim in this pass
      Vec a[4][2];
      for (int u = 0; u < 4; ++u) {
        const Vec vc(c[t + u]);
        for (int i = 0; i < w; ++i) a[u][i] = Vec::loadu(acc[t + u] + (i0 + i) * VS) * vc;
      }
      for (int64_t j = 0; j < kKeyBlock; ++j) {
        const float* vj = v + j * vs + i0 * VS;
        const Vec x0 = Vec::loadu(vj);
        const Vec x1 = w == 2 ? Vec::loadu(vj + VS) : x0;
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          const Vec pj(p[t + u][j]);
          a[u][0] = at::vec::fmadd(x0, pj, a[u][0]);
          if (w == 2) a[u][1] = at::vec::fmadd(x1, pj, a[u][1]);
        }
      }
      for (int u = 0; u < 4; ++u) {
        for (int i = 0; i < w; ++i) a[u][i].store(acc[t + u] + (i0 + i) * VS);
      }
    }
  }
  for (; t < nv; ++t) {
    block_values<ND>(acc[t], c[t], p[t], v, vs, kKeyBlock, nullptr, nullptr, 0);
  }
}

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, float, float*, const float*,
                          int64_t);
using ValuesFn = void (*)(float*, float, const float*, const float*, int64_t, int64_t, const float*,
                          const float*, int64_t);
using TileScoresFn = void (*)(const float* const*, int64_t, const float*, int64_t, float,
                              float* const*);
using TileValuesFn = void (*)(float* const*, const float*, const float* const*, int64_t,
                              const float*, int64_t);
constexpr int kMaxND = 16;  // head_dim up to 128 on AVX2, 256 on AVX-512
template <int... N>
constexpr std::array<ScoresFn, sizeof...(N) + 1> scores_table(std::integer_sequence<int, N...>) {
  return {nullptr, block_scores<N + 1>...};
}
template <int... N>
constexpr std::array<ValuesFn, sizeof...(N) + 1> values_table(std::integer_sequence<int, N...>) {
  return {nullptr, block_values<N + 1>...};
}
template <int... N>
constexpr std::array<TileScoresFn, sizeof...(N) + 1> tile_scores_table(
    std::integer_sequence<int, N...>) {
  return {nullptr, tile_scores<N + 1>...};
}
template <int... N>
constexpr std::array<TileValuesFn, sizeof...(N) + 1> tile_values_table(
    std::integer_sequence<int, N...>) {
  return {nullptr, tile_values<N + 1>...};
}
constexpr auto kScores = scores_table(std::make_integer_sequence<int, kMaxND>{});
constexpr auto kValues = values_table(std::make_integer_sequence<int, kMaxND>{});
constexpr auto kTileScores = tile_scores_table(std::make_integer_sequence<int, kMaxND>{});
constexpr auto kTileValues = tile_values_table(std::make_integer_sequence<int, kMaxND>{});

// Query rows a tile holds: at least two, and at least eight query vectors.
inline int64_t tile_rows(int64_t groups) { return std::max<int64_t>(2, (8 + groups - 1) / groups); }

// Per query vector (a row's query head): its query, running output, block scores and softmax
// state; `rows` rows of `groups` vectors.
struct Scratch {
  std::vector<float> q, acc, scores, kbuf, vbuf, m, l, c;
  std::vector<const float*> q_at, p_at;
  std::vector<float*> acc_at, scores_at;
  Scratch(int64_t rows, int64_t groups, int64_t d)
      : q(rows * groups * d), acc(rows * groups * d), scores(rows * groups * kKeyBlock),
        kbuf(d), vbuf(d), m(rows * groups), l(rows * groups), c(rows * groups),
        q_at(rows * groups), p_at(rows * groups), acc_at(rows * groups),
        scores_at(rows * groups) {
    for (int64_t v = 0; v < rows * groups; ++v) {
      q_at[v] = q.data() + v * d;
      acc_at[v] = acc.data() + v * d;
      scores_at[v] = scores.data() + v * kKeyBlock;
      p_at[v] = scores_at[v];
    }
  }
};

// All query rows of one sequence for the `groups` query heads that share kv head `h`. Without a
// sliding window, on the register paths (fp32, head_dim a multiple of the vector width up to
// kMaxND Vecs), prompt rows go in tiles of tile_rows(groups): the key blocks every row of
// a tile sees whole run for the tile together (tile_scores / tile_values), then each row goes on
// alone from there (decode rows: alone from the start).
template <typename T>
void attend(const SeqInfo& s, int64_t h, int64_t groups, int64_t d, float scale, int64_t window,
            const T* q, int64_t q_s0, int64_t q_s1, const T* pk, const T* pv, int64_t kv_s0,
            int64_t kv_s1, T* out, int64_t o_s0, int64_t o_s1, Scratch& w, const T* next_k,
            const T* next_v, int64_t next_rows) {
  const T* kh = pk + h * kv_s0 + s.kv_start * kv_s1;
  const T* vh = pv + h * kv_s0 + s.kv_start * kv_s1;
  // fp32 with head_dim a multiple of the vector width up to kMaxND vectors: the register paths
  const int64_t nd = d % Vec::size() == 0 ? d / Vec::size() : 0;
  const bool fast = std::is_same_v<T, float> && nd >= 1 && nd <= kMaxND;
  const ScoresFn scores_fn = fast ? kScores[nd] : nullptr;
  const ValuesFn values_fn = fast ? kValues[nd] : nullptr;
  const int64_t rt = fast && window == 0 ? tile_rows(groups) : 1;
  for (int64_t r0 = 0; r0 < s.q_len; r0 += rt) {
    const int64_t rows = std::min(rt, s.q_len - r0);
    for (int64_t v = 0; v < rows * groups; ++v) {
      const int64_t row = s.q_start + r0 + v / groups;
      const T* src = q + row * q_s0 + (h * groups + v % groups) * q_s1;
      for (int64_t i = 0; i < d; ++i) w.q[v * d + i] = static_cast<float>(src[i]);
      std::fill_n(w.acc.data() + v * d, d, 0.f);
      w.m[v] = -std::numeric_limits<float>::infinity();
      w.l[v] = 0.f;
    }
    int64_t joint_end = 0;  // keys [0, joint_end): whole blocks every row of the tile sees
    if constexpr (std::is_same_v<T, float>) {
      if (rows > 1) {
        const int64_t nv = rows * groups;
        joint_end = (s.ctx_len - s.q_len + r0 + 1) / kKeyBlock * kKeyBlock;
        for (int64_t kb = 0; kb < joint_end; kb += kKeyBlock) {
          kTileScores[nd](w.q_at.data(), nv, kh + kb * kv_s1, kv_s1, scale, w.scores_at.data());
          for (int64_t v = 0; v < nv; ++v) {
            softmax_step(w.scores_at[v], kKeyBlock, w.m[v], w.l[v], w.c[v]);
          }
          kTileValues[nd](w.acc_at.data(), w.c.data(), w.p_at.data(), nv, vh + kb * kv_s1,
                          kv_s1);
        }
      }
    }
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const int64_t pos = s.ctx_len - s.q_len + r;  // context position of this query
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t hi = pos + 1;  // keys [lo, hi)
      const int64_t row = s.q_start + r;
      const int64_t v0 = (r - r0) * groups;  // this row's first query vector
      const int64_t first = std::max(lo, joint_end);
      for (int64_t kb = first; kb < hi; kb += kKeyBlock) {
        const int64_t n = std::min(kKeyBlock, hi - kb);
        const int64_t n_next = std::min(kKeyBlock, hi - kb - n);  // keys of the next block
        // the last block of the last row prefetches the next item's first block instead
        const bool item_end = n_next == 0 && r + 1 == s.q_len && next_k != nullptr;
        const T* pf_k = item_end ? next_k : kh + (kb + n) * kv_s1;
        const T* pf_v = item_end ? next_v : vh + (kb + n) * kv_s1;
        const int64_t pf_rows = item_end ? next_rows : n_next;
        // Register paths: the scores pass prefetches the next block's keys (a row's first block:
        // its own values instead), the values pass the next block's values (a row's first block:
        // the next block's keys too), each query head of the group a share. To session 51 every
        // next-block prefetch went in the first head's values pass: on Zen 1 GQA decode took
        // 1.09-1.31x as long, MHA level (docs/benchmarks.md, session 52).
        const auto share = [groups](int64_t n_rows, int64_t g) {
          return std::pair<int64_t, int64_t>{g * n_rows / groups, (g + 1) * n_rows / groups};
        };
        if constexpr (std::is_same_v<T, float>) {
          if (fast) {
            for (int64_t g = 0; g < groups; ++g) {
              const T* pf = kb == first ? vh + kb * kv_s1 : pf_k;
              const auto [lo_g, hi_g] = share(kb == first ? n : pf_rows, g);
              scores_fn(w.q.data() + (v0 + g) * d, kh + kb * kv_s1, kv_s1, n, scale,
                        w.scores.data() + (v0 + g) * kKeyBlock, pf + lo_g * kv_s1, hi_g - lo_g);
            }
          }
        }
        for (int64_t j = 0; j < n && !fast; ++j) {
          if (kb == first) prefetch_row(vh + (kb + j) * kv_s1, d * sizeof(T));  // later: below
          const float* k = as_float(kh + (kb + j) * kv_s1, w.kbuf.data(), d);
          for (int64_t g = 0; g < groups; ++g) {
            w.scores[(v0 + g) * kKeyBlock + j] = dot(w.q.data() + (v0 + g) * d, k, d) * scale;
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t v = v0 + g;
          softmax_step(w.scores.data() + v * kKeyBlock, n, w.m[v], w.l[v], w.c[v]);
        }
        if constexpr (std::is_same_v<T, float>) {
          if (fast) {
            for (int64_t g = 0; g < groups; ++g) {  // the rescale is applied before the first key
              const int64_t v = v0 + g;
              const auto [lo_g, hi_g] = share(pf_rows, g);
              values_fn(w.acc.data() + v * d, w.c[v], w.scores.data() + v * kKeyBlock,
                        vh + kb * kv_s1, kv_s1, n, kb == first ? pf_k + lo_g * kv_s1 : nullptr,
                        pf_v + lo_g * kv_s1, hi_g - lo_g);
            }
            continue;
          }
        }
        int64_t credit = 0;
        for (int64_t j = 0; j < n; ++j) {
          for (credit += pf_rows; credit >= n; credit -= n, pf_k += kv_s1, pf_v += kv_s1) {
            prefetch_row(pf_k, d * sizeof(T));
            prefetch_row(pf_v, d * sizeof(T));
          }
          const float* v = as_float(vh + (kb + j) * kv_s1, w.vbuf.data(), d);
          for (int64_t g = 0; g < groups; ++g) {  // the rescale is folded into the first key
            scale_add(w.acc.data() + (v0 + g) * d, j == 0 ? w.c[v0 + g] : 1.f,
                      w.scores[(v0 + g) * kKeyBlock + j], v, d);
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* dst = out + row * o_s0 + (h * groups + g) * o_s1;
        const float inv = 1.f / w.l[v0 + g];
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(w.acc[(v0 + g) * d + i] * inv);
      }
    }
  }
}

// A token-major pool (a token's kv heads side by side: stride(0) == head_dim, stride(1) ==
// kv_heads * head_dim) holds a sequence's context of a layer as one run of memory. Decode rows
// read it in address order: per block of keys, one key at a time (its rows of every kv head in
// [h0, h1), each row held in registers for the query vectors of its group), scores then values.
// Per query vector the float operations are those of block_scores / block_values (a four-key
// group's sums kept and reduced together, the values added in key order, the rescale before the
// first key), so a row's bits are those of attend whatever the layout or the heads an item
// covers. Four keys at a time for each head in turn (attend's order over the interleaved rows)
// made decode steps 1.01-1.65x as long here (session 56): the hardware prefetcher lost the stream.
constexpr int64_t kAheadKeys = 4;  // keys whose rows are asked for ahead of use

struct TokenMajorScratch {
  std::vector<float> q, acc, scores, sums, m, l, c;
  TokenMajorScratch(int64_t nv, int64_t d)
      : q(nv * d), acc(nv * d), scores(nv * kKeyBlock), sums(nv * 4 * Vec::size()), m(nv),
        l(nv), c(nv) {}
};

template <int ND>
void attend_token_major(const SeqInfo& s, int64_t h0, int64_t h1, int64_t groups, float scale,
                        int64_t window, const float* q, int64_t q_s0, int64_t q_s1,
                        const float* pk, const float* pv, int64_t kv_s0, int64_t kv_s1,
                        float* out, int64_t o_s0, int64_t o_s1, TokenMajorScratch& w) {
  constexpr int64_t VS = Vec::size();
  constexpr int64_t d = ND * VS;
  constexpr int kHeld = ND <= 8 ? ND : 8;  // Vecs of a K or V row held in registers
  const int64_t nh = h1 - h0, nv = nh * groups;
  const int64_t record_bytes = nh * kv_s0 * sizeof(float);  // one key's rows of heads [h0, h1)
  const auto sum = [](Vec& x, Vec& y) { return x + y; };
  // sums[v][t] = the vector sum of q_v * k for key t of a four-key group (t = 0 when alone)
  const auto key_sums = [&](const float* rec, int64_t t) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* k = rec + hh * kv_s0;
      Vec kr[kHeld];
      for (int i = 0; i < kHeld; ++i) kr[i] = Vec::loadu(k + i * VS);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t v = hh * groups + g;
        const float* qv = w.q.data() + v * d;
        Vec a(0.f);
#pragma GCC unroll 8
        for (int i = 0; i < ND; ++i) {
          const Vec kv = i < kHeld ? kr[i < kHeld ? i : 0] : Vec::loadu(k + i * VS);
          a = at::vec::fmadd(Vec::loadu(qv + i * VS), kv, a);
        }
        a.store(w.sums.data() + (v * 4 + t) * VS);
      }
    }
  };
  for (int64_t r = 0; r < s.q_len; ++r) {
    const int64_t row = s.q_start + r;
    const int64_t pos = s.ctx_len - s.q_len + r;  // context position of this query
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t hi = pos + 1;  // keys [lo, hi)
    for (int64_t v = 0; v < nv; ++v) {
      std::copy_n(q + row * q_s0 + (h0 * groups + v) * q_s1, d, w.q.data() + v * d);
      std::fill_n(w.acc.data() + v * d, d, 0.f);
      w.m[v] = -std::numeric_limits<float>::infinity();
      w.l[v] = 0.f;
    }
    for (int64_t kb = lo; kb < hi; kb += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, hi - kb);
      const float* kblock = pk + (s.kv_start + kb) * kv_s1 + h0 * kv_s0;
      const float* vblock = pv + (s.kv_start + kb) * kv_s1 + h0 * kv_s0;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        for (int64_t t = 0; t < 4; ++t) {
          if (kb + j + t + kAheadKeys < hi) {
            prefetch_row(kblock + (j + t + kAheadKeys) * kv_s1, record_bytes);
          }
          key_sums(kblock + (j + t) * kv_s1, t);
        }
        for (int64_t v = 0; v < nv; ++v) {
          const float* a = w.sums.data() + v * 4 * VS;
          reduce4(Vec::loadu(a), Vec::loadu(a + VS), Vec::loadu(a + 2 * VS),
                  Vec::loadu(a + 3 * VS), scale, w.scores.data() + v * kKeyBlock + j);
        }
      }
      for (; j < n; ++j) {
        if (kb + j + kAheadKeys < hi) {
          prefetch_row(kblock + (j + kAheadKeys) * kv_s1, record_bytes);
        }
        key_sums(kblock + j * kv_s1, 0);
        for (int64_t v = 0; v < nv; ++v) {
          Vec a = Vec::loadu(w.sums.data() + v * 4 * VS);
          w.scores[v * kKeyBlock + j] = at::vec::vec_reduce_all<float>(sum, a) * scale;
        }
      }
      for (int64_t v = 0; v < nv; ++v) {
        softmax_step(w.scores.data() + v * kKeyBlock, n, w.m[v], w.l[v], w.c[v]);
      }
      // acc = acc * c + sum_j p[j] * v_j, one key (its rows of every head) at a time
      for (j = 0; j < n; ++j) {
        if (kb + j + kAheadKeys < hi) {
          prefetch_row(vblock + (j + kAheadKeys) * kv_s1, record_bytes);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          const float* vrow = vblock + j * kv_s1 + hh * kv_s0;
          Vec vr[kHeld];
          for (int i = 0; i < kHeld; ++i) vr[i] = Vec::loadu(vrow + i * VS);
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t v = hh * groups + g;
            float* a = w.acc.data() + v * d;
            const Vec p(w.scores[v * kKeyBlock + j]), vc(w.c[v]);
#pragma GCC unroll 8
            for (int i = 0; i < ND; ++i) {
              Vec x = Vec::loadu(a + i * VS);
              if (j == 0) x = x * vc;
              const Vec vv = i < kHeld ? vr[i < kHeld ? i : 0] : Vec::loadu(vrow + i * VS);
              at::vec::fmadd(vv, p, x).store(a + i * VS);
            }
          }
        }
      }
    }
    for (int64_t v = 0; v < nv; ++v) {
      float* dst = out + row * o_s0 + (h0 * groups + v) * o_s1;
      const float inv = 1.f / w.l[v];
      for (int64_t i = 0; i < d; ++i) dst[i] = w.acc[v * d + i] * inv;
    }
  }
}

using TokenMajorFn = void (*)(const SeqInfo&, int64_t, int64_t, int64_t, float, int64_t,
                              const float*, int64_t, int64_t, const float*, const float*, int64_t,
                              int64_t, float*, int64_t, int64_t, TokenMajorScratch&);
template <int... N>
constexpr std::array<TokenMajorFn, sizeof...(N) + 1> token_major_table(
    std::integer_sequence<int, N...>) {
  return {nullptr, attend_token_major<N + 1>...};
}
constexpr auto kTokenMajor = token_major_table(std::make_integer_sequence<int, kMaxND>{});

// The kernel's items spread over torch's intra-op threads: (short sequence, kv head), and on a
// token-major pool with the fp32 register paths, (decode sequence, run of kv heads).
template <typename T>
void run_items(const std::vector<SeqInfo>& seqs, const std::vector<int64_t>& short_seqs,
               const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
               at::Tensor& out, float scale, int64_t window) {
  const int64_t kv_heads = pool_k.size(0), groups = q.size(1) / kv_heads, d = q.size(2);
  const int64_t nd = d % Vec::size() == 0 ? d / Vec::size() : 0;
  const bool token_major = std::is_same_v<T, float> && nd >= 1 && nd <= kMaxND &&
                           pool_k.stride(0) == d && pool_k.stride(1) == kv_heads * d;
  std::vector<int64_t> head_seqs, alone_seqs;  // head by head; decode rows, token-major
  for (int64_t i : short_seqs) {
    (token_major && seqs[i].q_len == 1 ? alone_seqs : head_seqs).push_back(i);
  }
  // kv heads per token-major item: all of them, or with several threads fewer while the items
  // would not give every thread a few (the results do not depend on it; a split item reads
  // only its heads' share of each key's rows)
  const int64_t threads = at::get_num_threads();
  const int64_t want = threads > 1 ? 4 * threads : 1;
  const int64_t n_alone = static_cast<int64_t>(alone_seqs.size());
  const int64_t chunks =
      n_alone == 0 ? 1 : std::min(kv_heads, std::max<int64_t>(1, (want + n_alone - 1) / n_alone));
  const int64_t per_item = (kv_heads + chunks - 1) / chunks;
  const int64_t head_items = static_cast<int64_t>(head_seqs.size()) * kv_heads;
  const int64_t items = head_items + n_alone * chunks;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t stop) {
    Scratch w(tile_rows(groups), groups, d);
    std::unique_ptr<TokenMajorScratch> tm;
    for (int64_t it = begin; it < stop; ++it) {
      if (it >= head_items) {
        if constexpr (std::is_same_v<T, float>) {
          if (!tm) tm = std::make_unique<TokenMajorScratch>(per_item * groups, d);
          const int64_t k = it - head_items;
          const int64_t h0 = k % chunks * per_item, h1 = std::min(kv_heads, h0 + per_item);
          if (h0 < h1) {
            kTokenMajor[nd](seqs[alone_seqs[k / chunks]], h0, h1, groups, scale, window, qp,
                            q.stride(0), q.stride(1), kp, vp, pool_k.stride(0), pool_k.stride(1),
                            op, out.stride(0), out.stride(1), *tm);
          }
        }
        continue;
      }
      const SeqInfo& s = seqs[head_seqs[it / kv_heads]];
      const T *next_k = nullptr, *next_v = nullptr;
      int64_t next_rows = 0;
      // the next item's first key block, fetched during this one's end
      if (it + 1 < std::min(stop, head_items)) {
        const SeqInfo& ns = seqs[head_seqs[(it + 1) / kv_heads]];
        const int64_t h = (it + 1) % kv_heads;
        const int64_t pos = ns.ctx_len - ns.q_len;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        next_k = kp + h * pool_k.stride(0) + (ns.kv_start + lo) * pool_k.stride(1);
        next_v = vp + h * pool_k.stride(0) + (ns.kv_start + lo) * pool_k.stride(1);
        next_rows = std::min(kKeyBlock, pos + 1 - lo);
      }
      attend<T>(s, it % kv_heads, groups, d, scale, window, qp, q.stride(0), q.stride(1), kp, vp,
                pool_k.stride(0), pool_k.stride(1), op, out.stride(0), out.stride(1), w, next_k,
                next_v, next_rows);
    }
  });
}

at::Tensor window_mask(int64_t q_len, int64_t ctx_len, int64_t first_key, int64_t window,
                       const at::Device& dev) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
  auto q_pos = at::arange(ctx_len - q_len, ctx_len, opts).unsqueeze(1);
  auto k_pos = at::arange(first_key, ctx_len, opts).unsqueeze(0);
  auto m = k_pos <= q_pos;
  if (window > 0) m = m.logical_and(k_pos > q_pos - window);
  return m;
}

// Same branches as attention.py::paged_attention for one long prompt chunk.
void sdpa_chunk(const SeqInfo& s, const at::Tensor& q, const at::Tensor& pool_k,
                const at::Tensor& pool_v, at::Tensor& out, double scale, int64_t window) {
  const int64_t ql = s.q_len, ctx = s.ctx_len;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - ql - window + 1) : 0;
  auto qi = q.narrow(0, s.q_start, ql).transpose(0, 1).unsqueeze(0);
  auto ki = pool_k.narrow(1, s.kv_start + lo, ctx - lo).unsqueeze(0);
  auto vi = pool_v.narrow(1, s.kv_start + lo, ctx - lo).unsqueeze(0);
  const bool gqa = q.size(1) != pool_k.size(0);
  at::Tensor o;
  if (window > 0 && window < ctx - lo) {
    o = at::scaled_dot_product_attention(qi, ki, vi, window_mask(ql, ctx, lo, window, q.device()),
                                         0.0, false, scale, gqa);
  } else if (ql == ctx - lo) {
    o = at::scaled_dot_product_attention(qi, ki, vi, {}, 0.0, true, scale, gqa);
  } else {
    o = at::scaled_dot_product_attention(qi, ki, vi, window_mask(ql, ctx, lo, 0, q.device()), 0.0,
                                         false, scale, gqa);
  }
  out.narrow(0, s.q_start, ql).copy_(o[0].transpose(0, 1));
}

void ragged_attention_cpu(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
                          const at::Tensor& out_, const at::Tensor& q_start, const at::Tensor& q_len,
                          const at::Tensor& ctx_len, const at::Tensor& kv_start, double scale,
                          int64_t window) {
  at::Tensor out = out_;
  TORCH_CHECK(q.dim() == 3 && pool_k.dim() == 3 && pool_v.dim() == 3 && out.dim() == 3,
              "ragged_attention: q/out [T, heads, D], pool_k/pool_v [kv_heads, tokens, D]");
  TORCH_CHECK(pool_k.sizes() == pool_v.sizes() && pool_k.strides() == pool_v.strides(),
              "ragged_attention: pool_k and pool_v differ in shape or strides");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(),
              "ragged_attention: out must be a contiguous tensor shaped like q");
  TORCH_CHECK(q.scalar_type() == pool_k.scalar_type() && q.scalar_type() == pool_v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "ragged_attention: q, pools and out must have one dtype");
  TORCH_CHECK(q.stride(2) == 1 && pool_k.stride(2) == 1, "ragged_attention: head_dim not contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = pool_k.size(0), pool_tokens = pool_k.size(1);
  TORCH_CHECK(pool_k.size(2) == d, "ragged_attention: head_dim of q and the pool differ");
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0,
              "ragged_attention: heads must be a positive multiple of kv_heads");
  for (const auto* t : {&q_start, &q_len, &ctx_len, &kv_start}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                    t->is_contiguous() && t->numel() == q_start.numel(),
                "ragged_attention: metadata must be contiguous int64 CPU vectors of one length");
  }
  const int64_t n = q_start.numel();
  std::vector<SeqInfo> seqs(n);
  const int64_t *qs = q_start.data_ptr<int64_t>(), *ql = q_len.data_ptr<int64_t>();
  const int64_t *cl = ctx_len.data_ptr<int64_t>(), *ks = kv_start.data_ptr<int64_t>();
  int64_t end = 0;
  std::vector<int64_t> short_seqs;
  const bool rows_only = g_rows_only.load(std::memory_order_relaxed);
  for (int64_t i = 0; i < n; ++i) {
    seqs[i] = {qs[i], ql[i], cl[i], ks[i]};
    TORCH_CHECK(ql[i] > 0 && ql[i] <= cl[i] && qs[i] >= 0 && qs[i] + ql[i] <= tokens &&
                    ks[i] >= 0 && ks[i] + cl[i] <= pool_tokens,
                "ragged_attention: sequence ", i, " out of range (q_start ", qs[i], ", q_len ",
                ql[i], ", ctx_len ", cl[i], ", kv_start ", ks[i], ")");
    end = std::max(end, qs[i] + ql[i]);
    if (rows_only || ql[i] < kSdpaMinQ) short_seqs.push_back(i);
  }
  if (end < tokens) out.narrow(0, end, tokens - end).zero_();  // padding rows
  for (int64_t i = 0; i < n; ++i) {
    const SeqInfo& s = seqs[i];
    if (rows_only || s.q_len < kSdpaMinQ) continue;
    const bool tiled = q.scalar_type() == at::kFloat && tetri_ops::tiled_prefill_attention(
        q.data_ptr<float>(), q.stride(0), q.stride(1), pool_k.data_ptr<float>(),
        pool_v.data_ptr<float>(), pool_k.stride(0), pool_k.stride(1), out.data_ptr<float>(),
        out.stride(0), out.stride(1), s.q_start, s.q_len, s.ctx_len, s.kv_start, heads,
        kv_heads, d, static_cast<float>(scale), window);
    if (!tiled) sdpa_chunk(s, q, pool_k, pool_v, out, scale, window);
  }
  const float fscale = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      return run_items<float>(seqs, short_seqs, q, pool_k, pool_v, out, fscale, window);
    case at::kBFloat16:
      return run_items<at::BFloat16>(seqs, short_seqs, q, pool_k, pool_v, out, fscale, window);
    case at::kHalf:
      return run_items<at::Half>(seqs, short_seqs, q, pool_k, pool_v, out, fscale, window);
    default:
      TORCH_CHECK(false, "ragged_attention: float32, bfloat16 or float16 only, got ",
                  q.scalar_type());
  }
}

// tetri::write_kv: the new tokens' K and V rows into the pool, one row copy per (token, kv
// head) (index_copy_ over the pool's token dim costs ~120 us a call for a 32-token step).
void write_kv_cpu(const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes() &&
                  pool_k.strides() == pool_v.strides() && pool_k.stride(2) == 1,
              "write_kv: pools must be two [kv_heads, tokens, D] tensors alike, D contiguous");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.size(1) == pool_k.size(0) && k.size(2) == pool_k.size(2),
              "write_kv: k and v must be [T, kv_heads, D] with D contiguous");
  TORCH_CHECK(k.scalar_type() == pool_k.scalar_type() && v.scalar_type() == pool_k.scalar_type(),
              "write_kv: k, v and the pools must have one dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() <= k.size(0),
              "write_kv: slots must be a contiguous int64 vector, one per new token");
  const int64_t n = slots.numel(), heads = k.size(1), pool_tokens = pool_k.size(1);
  const int64_t row_bytes = k.size(2) * k.element_size(), es = k.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < pool_tokens, "write_kv: slot ", s[t], " of token ", t,
                " outside the pool (", pool_tokens, " tokens)");
  }
  auto* pk = static_cast<char*>(pool_k.data_ptr());
  auto* pv = static_cast<char*>(pool_v.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (h * pool_k.stride(0) + s[t] * pool_k.stride(1)) * es;
      std::memcpy(pk + dst, kp + (t * k.stride(0) + h * k.stride(1)) * es, row_bytes);
      std::memcpy(pv + dst, vp + (t * v.stride(0) + h * v.stride(1)) * es, row_bytes);
    }
  }
}

void set_rows_only(bool on) { g_rows_only.store(on); }
bool rows_only() { return g_rows_only.load(); }

void ragged_attention_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, double, int64_t) {}

}  // namespace

TORCH_LIBRARY(tetri, m) {
  m.def(
      "ragged_attention(Tensor q, Tensor pool_k, Tensor pool_v, Tensor(a!) out, Tensor q_start, "
      "Tensor q_len, Tensor ctx_len, Tensor kv_start, float scale, int window) -> ()");
  m.def("write_kv(Tensor(a!) pool_k, Tensor(b!) pool_v, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("set_attention_rows_only(bool on) -> ()");
  m.def("attention_rows_only() -> bool");
}

TORCH_LIBRARY_IMPL(tetri, CatchAll, m) {
  m.impl("set_attention_rows_only", &set_rows_only);
  m.impl("attention_rows_only", &rows_only);
}

TORCH_LIBRARY_IMPL(tetri, CPU, m) {
  m.impl("ragged_attention", &ragged_attention_cpu);
  m.impl("write_kv", &write_kv_cpu);
}

TORCH_LIBRARY_IMPL(tetri, Meta, m) { m.impl("ragged_attention", &ragged_attention_meta); }
