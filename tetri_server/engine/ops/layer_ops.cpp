// The small per-layer ops of a Llama-family layer, fused: each is one pass over its rows where
// eager PyTorch makes 3-8 kernel calls and as many temporaries (tetri_server/engine/ops/layer.py
// has the reference for each, and falls back to it off CPU or for dtypes other than float32).
//
//   rms_norm(x, w, eps)              -> w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x!, delta, w, eps)  -> x += delta in place, then rms_norm(x, w, eps)
//   rope_(q!, k!, cos, sin)          -> q, k rotated in place (rotate-half convention)
//   silu_mul(gate_up)                -> silu(gate) * up, gate|up the two halves of each row
//   argmax_rows(x)                   -> torch.argmax(x, -1) (first NaN, else first maximum)
//
// Same order of float operations as the reference (statistics in fp32, products rounded before
// sums, as ATen's elementwise kernels do), except the mean's summation order. Rows are spread
// over threads with at::parallel_for; each row's result depends only on that row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;

inline float sum_squares(const float* x, int64_t d) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    Vec v = Vec::loadu(x + i);
    acc = acc + v * v;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

// out = w * (x * r) over d floats
inline void scale_row(float* out, const float* x, const float* w, float r, int64_t d) {
  const Vec vr(r);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    (Vec::loadu(w + i) * (Vec::loadu(x + i) * vr)).store(out + i);
  }
  for (; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              op, ": x must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == at::kFloat &&
                  w.size(0) == x.size(1),
              op, ": weight must be a contiguous float32 [H] tensor");
}

at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t t = x.size(0), d = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      const float mean = sum_squares(row, d) / static_cast<float>(d);
      scale_row(op + r * d, row, wp, 1.0f / std::sqrt(mean + feps), d);
    }
  });
  return out;
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  return norm_rows(x, w, eps);
}

at::Tensor add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                            double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.scalar_type() == at::kFloat,
              "add_rms_norm: delta must be a contiguous float32 tensor shaped like x");
  const int64_t n = x.numel();
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + Vec::size() <= end; i += Vec::size()) {
      (Vec::loadu(xp + i) + Vec::loadu(dp + i)).store(xp + i);
    }
    for (; i < end; ++i) xp[i] += dp[i];
  });
  return norm_rows(x, w, eps);
}

// One head row of D: o1 = x1*c1 + (-x2)*s1, o2 = x2*c2 + x1*s2 (c, s: the token's cos/sin).
inline void rotate_row(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i);
    Vec o1 = x1 * Vec::loadu(c + i) + x2.neg() * Vec::loadu(s + i);
    Vec o2 = x2 * Vec::loadu(c + half + i) + x1 * Vec::loadu(s + half + i);
    o1.store(x + i);
    o2.store(x + half + i);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] + (-x2) * s[i];
    x[half + i] = x2 * c[half + i] + x1 * s[half + i];
  }
}

void rotate_heads(const at::Tensor& x, const float* cp, const float* sp, int64_t t) {
  if (x.size(1) == 0) return;
  const int64_t heads = x.size(1), d = x.size(2);
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) rotate_row(xp + r * st + h * sh, cp + r * d, sp + r * d, d / 2);
    }
  });
}

void rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
              const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rope_: q and k must be [T, heads, D] with one T and D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rope_: float32 q and k with contiguous, even head_dim");
  const int64_t t = q.size(0), d = q.size(2);
  for (const auto* c : {&cos, &sin}) {
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->numel() == t * d,
                "rope_: cos and sin must be contiguous float32 [T, 1, D]");
  }
  rotate_heads(q, cos.data_ptr<float>(), sin.data_ptr<float>(), t);
  rotate_heads(k, cos.data_ptr<float>(), sin.data_ptr<float>(), t);
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous float32 [T, 2I] tensor");
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Vec one(1.f);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * inter;
      const float* u = g + inter;
      float* o = op + r * inter;
      int64_t i = 0;
      for (; i + Vec::size() <= inter; i += Vec::size()) {
        Vec x = Vec::loadu(g + i);
        ((x / (one + x.neg().exp())) * Vec::loadu(u + i)).store(o + i);
      }
      for (; i < inter; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
  return out;
}

// torch.argmax(x, -1) of float32 rows [S, V]: the first NaN if a row has one, else the first
// maximum (ATen's single-threaded argmax over a 32 x 8192 batch of logits takes ~0.5 ms).
at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: x must be a contiguous float32 [S, V] tensor with V > 0");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      Vec best(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + Vec::size() <= v; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(row + i));
      float m = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
      for (; i < v; ++i) m = std::isnan(row[i]) || row[i] > m ? row[i] : m;
      int64_t at = 0;
      if (std::isnan(m)) {
        while (!std::isnan(row[at])) ++at;
      } else {
        while (row[at] != m) ++at;
      }
      op[r] = at;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tetri, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tetri, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rope_", &rope_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
}
