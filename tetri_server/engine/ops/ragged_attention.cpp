// tetri::ragged_attention: one attention call per layer for a packed, ragged batch over the
// KV pool (see tetri_server/engine/attention.py for the layout and the reference loop).
//
// Built at first use by tetri_server/engine/ops/__init__.py, once per CPU capability (the
// -DCPU_CAPABILITY_* macro and -m flags select ATen's Vectorized<float> width; never
// -march=native).
//
// Rows of sequences with q_len < kSdpaMinQ (decode tokens, short chunks) run the kernel below:
// one work item per (sequence, kv head) covers every query row and every query head of that
// kv head's group, so each key and value row is read once per item. Per row the keys are
// walked in order in blocks of kKeyBlock with an online softmax in fp32; nothing depends on
// the other sequences of the batch or on how items are spread over threads.
// Longer prompt chunks run the tiled kernel of prefill_attention.cpp (fp32, AVX-512, head_dim
// 64 or 128, no sliding window), else ATen's SDPA on views of their extent, with the same
// masks as the reference loop. With tetri::set_attention_rows_only(true) (model.batch_invariant)
// every row runs the kernel below: a row's result then depends only on its query, its position
// and the keys, not on the chunk it came in or the batch (prefill 6-25% slower, session 50).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
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
// with the query / the running output in registers. Same float operations in the same order as
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

template <int ND>
void block_scores(const float* q, const float* k, int64_t ks, int64_t n, float scale, float* out,
                  const float* pf, int64_t pf_rows) {
  constexpr int64_t VS = Vec::size();
  const auto sum = [](Vec& x, Vec& y) { return x + y; };
  Vec qv[ND];
  for (int i = 0; i < ND; ++i) qv[i] = Vec::loadu(q + i * VS);
  const float* none = nullptr;
  int64_t credit = 0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_spread(pf, none, credit, 4 * pf_rows, n, ks, ND * VS * 4);
    const float* k0 = k + j * ks;
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
#pragma GCC unroll 8
    for (int i = 0; i < ND; ++i) {
      a0 = at::vec::fmadd(qv[i], Vec::loadu(k0 + i * VS), a0);
      a1 = at::vec::fmadd(qv[i], Vec::loadu(k0 + ks + i * VS), a1);
      a2 = at::vec::fmadd(qv[i], Vec::loadu(k0 + 2 * ks + i * VS), a2);
      a3 = at::vec::fmadd(qv[i], Vec::loadu(k0 + 3 * ks + i * VS), a3);
    }
    out[j] = at::vec::vec_reduce_all<float>(sum, a0) * scale;
    out[j + 1] = at::vec::vec_reduce_all<float>(sum, a1) * scale;
    out[j + 2] = at::vec::vec_reduce_all<float>(sum, a2) * scale;
    out[j + 3] = at::vec::vec_reduce_all<float>(sum, a3) * scale;
  }
  for (; j < n; ++j) {
    prefetch_spread(pf, none, credit, pf_rows, n, ks, ND * VS * 4);
    Vec a(0.f);
    for (int i = 0; i < ND; ++i) a = at::vec::fmadd(qv[i], Vec::loadu(k + j * ks + i * VS), a);
    out[j] = at::vec::vec_reduce_all<float>(sum, a) * scale;
  }
}

template <int ND>
void block_values(float* acc, float c, const float* p, const float* v, int64_t vs, int64_t n,
                  const float* pf_k, const float* pf_v, int64_t pf_rows) {
  constexpr int64_t VS = Vec::size();
  Vec a[ND];
  const Vec vc(c);
  for (int i = 0; i < ND; ++i) a[i] = Vec::loadu(acc + i * VS) * vc;
  int64_t credit = 0;
  for (int64_t j = 0; j < n; ++j) {
    prefetch_spread(pf_k, pf_v, credit, pf_rows, n, vs, ND * VS * 4);
    const Vec pj(p[j]);
#pragma GCC unroll 8
    for (int i = 0; i < ND; ++i) a[i] = at::vec::fmadd(Vec::loadu(v + j * vs + i * VS), pj, a[i]);
  }
  for (int i = 0; i < ND; ++i) a[i].store(acc + i * VS);
}

using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, float, float*, const float*,
                          int64_t);
using ValuesFn = void (*)(float*, float, const float*, const float*, int64_t, int64_t, const float*,
                          const float*, int64_t);
constexpr int kMaxND = 8;
constexpr ScoresFn kScores[kMaxND + 1] = {nullptr, block_scores<1>, block_scores<2>,
                                          block_scores<3>, block_scores<4>, block_scores<5>,
                                          block_scores<6>, block_scores<7>, block_scores<8>};
constexpr ValuesFn kValues[kMaxND + 1] = {nullptr, block_values<1>, block_values<2>,
                                          block_values<3>, block_values<4>, block_values<5>,
                                          block_values<6>, block_values<7>, block_values<8>};

struct Scratch {
  std::vector<float> q, acc, scores, kbuf, vbuf, m, l, c;
  Scratch(int64_t groups, int64_t d)
      : q(groups * d), acc(groups * d), scores(groups * kKeyBlock), kbuf(d), vbuf(d),
        m(groups), l(groups), c(groups) {}
};

// All query rows of one sequence for the `groups` query heads that share kv head `h`.
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
  for (int64_t r = 0; r < s.q_len; ++r) {
    const int64_t pos = s.ctx_len - s.q_len + r;  // context position of this query
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t hi = pos + 1;  // keys [lo, hi)
    const int64_t row = s.q_start + r;
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = q + row * q_s0 + (h * groups + g) * q_s1;
      for (int64_t i = 0; i < d; ++i) w.q[g * d + i] = static_cast<float>(src[i]);
      std::fill_n(w.acc.data() + g * d, d, 0.f);
      w.m[g] = -std::numeric_limits<float>::infinity();
      w.l[g] = 0.f;
    }
    for (int64_t kb = lo; kb < hi; kb += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, hi - kb);
      if constexpr (std::is_same_v<T, float>) {
        if (fast) {
          for (int64_t g = 0; g < groups; ++g) {  // the first block prefetches its values
            const bool pf = g == 0 && kb == lo;
            scores_fn(w.q.data() + g * d, kh + kb * kv_s1, kv_s1, n, scale,
                      w.scores.data() + g * kKeyBlock, pf ? vh + kb * kv_s1 : nullptr,
                      pf ? n : 0);
          }
        }
      }
      for (int64_t j = 0; j < n && !fast; ++j) {
        if (kb == lo) prefetch_row(vh + (kb + j) * kv_s1, d * sizeof(T));  // later blocks: below
        const float* k = as_float(kh + (kb + j) * kv_s1, w.kbuf.data(), d);
        for (int64_t g = 0; g < groups; ++g) {
          w.scores[g * kKeyBlock + j] = dot(w.q.data() + g * d, k, d) * scale;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* p = w.scores.data() + g * kKeyBlock;
        const float m_new = std::max(w.m[g], *std::max_element(p, p + n));
        w.c[g] = std::exp(w.m[g] - m_new);  // rescale of the running sums; 0 on the first block
        w.l[g] = w.l[g] * w.c[g] + exp_shift_sum(p, m_new, n);
        w.m[g] = m_new;
      }
      const int64_t n_next = std::min(kKeyBlock, hi - kb - n);  // keys of the next block
      // the last block of the last row prefetches the next item's first block instead
      const bool item_end = n_next == 0 && r + 1 == s.q_len && next_k != nullptr;
      const T* pf_k = item_end ? next_k : kh + (kb + n) * kv_s1;
      const T* pf_v = item_end ? next_v : vh + (kb + n) * kv_s1;
      const int64_t pf_rows = item_end ? next_rows : n_next;
      if constexpr (std::is_same_v<T, float>) {
        if (fast) {
          for (int64_t g = 0; g < groups; ++g) {  // the rescale is applied before the first key
            values_fn(w.acc.data() + g * d, w.c[g], w.scores.data() + g * kKeyBlock,
                      vh + kb * kv_s1, kv_s1, n, g == 0 ? pf_k : nullptr,
                      g == 0 ? pf_v : nullptr, g == 0 ? pf_rows : 0);
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
          scale_add(w.acc.data() + g * d, j == 0 ? w.c[g] : 1.f, w.scores[g * kKeyBlock + j], v,
                    d);
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      T* dst = out + row * o_s0 + (h * groups + g) * o_s1;
      const float inv = 1.f / w.l[g];
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(w.acc[g * d + i] * inv);
    }
  }
}

// The kernel's items, (short sequence, kv head), spread over torch's intra-op threads.
template <typename T>
void run_items(const std::vector<SeqInfo>& seqs, const std::vector<int64_t>& short_seqs,
               const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v,
               at::Tensor& out, float scale, int64_t window) {
  const int64_t kv_heads = pool_k.size(0), groups = q.size(1) / kv_heads, d = q.size(2);
  const int64_t items = static_cast<int64_t>(short_seqs.size()) * kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool_k.data_ptr<T>();
  const T* vp = pool_v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t stop) {
    Scratch w(groups, d);
    for (int64_t it = begin; it < stop; ++it) {
      const SeqInfo& s = seqs[short_seqs[it / kv_heads]];
      const T *next_k = nullptr, *next_v = nullptr;
      int64_t next_rows = 0;
      if (it + 1 < stop) {  // the next item's first key block, fetched during this one's end
        const SeqInfo& ns = seqs[short_seqs[(it + 1) / kv_heads]];
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
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "ragged_attention: heads must be a multiple of kv_heads");
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
