// tetri::packed_linear: y = x @ w.T + b for float32 on CPU, over a weight packed once at load
// (tetri::pack_linear_weight), for every row count the engine runs (tetri_server/engine/ops/
// linear.py dispatches, docs/benchmarks.md has the measurements).
//
// Layout. The weight [N, K] is cut into panels of PW = 4 vectors of output features; a panel
// is stored k-major, [K][PW], so the kernel streams it in the order it uses it; the last panel
// is zero-padded. Packed: [ceil(N / PW), K, PW].
//
// Kernel. A register tile of R rows x NV vectors of outputs is accumulated over the whole K
// (R x NV accumulators, each k: NV panel loads, R broadcasts of x, R x NV FMAs). Few rows
// (decode batches, up to a per-CPU setting) take the tall tile over half a panel (NV = 2), many
// rows (prefill) the wide one over the whole panel (NV = 4) in blocks of up to 256 rows, so a
// panel is re-read from cache, not memory. Each tile over a panel prefetches its share of the panel kAhead further
// on, spread over its K steps: the weight stream overlaps the FMAs (with few rows the step is
// as much memory- as compute-bound).
//
// Every output is one FMA chain over k = 0..K-1, then + bias: the same value whatever the row
// count, the tile, the row's place in the batch or the thread that computes it (threads split
// the panels). So decode results do not depend on the rest of the batch.
//
// tetri::packed_glu: silu(x @ gate.T) * (x @ up.T) for a gate|up weight [2I, K] packed by
// tetri::pack_glu_weight with its gate and up rows interleaved a vector at a time (a panel holds
// gate, up, gate, up vectors of V features), so every tile holds both halves of its outputs and
// applies SiLU-and-mul before it stores: the [M, 2I] product is never written. The same float
// operations as packed_linear then tetri::silu_mul, so the same bits.
//
// Built per CPU capability (see ops/__init__.py): AVX-512 and AVX2 get intrinsics kernels, any
// other build reports `packed_linear_supported() == false` and linear.py keeps oneDNN/F.linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define TETRI_LINEAR_SIMD 1
#endif

namespace {

#if defined(CPU_CAPABILITY_AVX512)
using VReg = __m512;
constexpr int64_t V = 16;
constexpr int kTallRows = 12;  // 12 x 2 accumulators + 2 panel vectors of 32 zmm
constexpr int kWideRows = 6;   // 6 x 4 + 4
inline VReg vload(const float* p) { return _mm512_loadu_ps(p); }
inline VReg vset1(float f) { return _mm512_set1_ps(f); }
inline VReg vfma(VReg a, VReg b, VReg c) { return _mm512_fmadd_ps(a, b, c); }
inline VReg vzero() { return _mm512_setzero_ps(); }
inline VReg vadd(VReg a, VReg b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VReg v) { _mm512_storeu_ps(p, v); }
#elif defined(CPU_CAPABILITY_AVX2)
using VReg = __m256;
constexpr int64_t V = 8;
constexpr int kTallRows = 6;  // 6 x 2 + 2 of 16 ymm
constexpr int kWideRows = 3;  // 3 x 4 + 4
inline VReg vload(const float* p) { return _mm256_loadu_ps(p); }
inline VReg vset1(float f) { return _mm256_set1_ps(f); }
inline VReg vfma(VReg a, VReg b, VReg c) { return _mm256_fmadd_ps(a, b, c); }
inline VReg vzero() { return _mm256_setzero_ps(); }
inline VReg vadd(VReg a, VReg b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VReg v) { _mm256_storeu_ps(p, v); }
#else
constexpr int64_t V = 8;  // layout only: no kernel in this build
#endif

constexpr int64_t PW = 4 * V;          // output features per panel
constexpr int64_t kLineFloats = 16;    // floats per 64-byte cache line
constexpr int64_t kAhead = 1;          // panels between the one run and the one prefetched
// Up to this many rows the tall tile, else the wide one: a run-time setting
// (tetri::set_packed_linear_tall_rows, chosen per CPU by linear.py). 48 measured faster for
// decode on an Intel Xeon (AVX-512, session 18); on an AMD EPYC with AVX-512 (Zen 4, session
// 39) the wide tile was 4-7% faster at 32 and 48 rows and level at 8 and 16, so 0 there. Both
// tiles give the same bits (one FMA chain per output).
std::atomic<int64_t> g_tall_max_rows{48};
constexpr int64_t kBlockRows = 256;  // at most, per pass over the panels (measured best)

void check_weight(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat,
              op, ": float32 CPU tensors only");
}

// Panels of w's rows in order; the caller reorders the rows first for a GLU pack.
at::Tensor pack_rows(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + PW - 1) / PW;
  at::Tensor packed = at::zeros({panels, k, PW}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < std::min(PW, n - p * PW); ++c) {
        const float* row = src + (p * PW + c) * k;
        float* col = dst + p * k * PW + c;
        for (int64_t i = 0; i < k; ++i) col[i * PW] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor pack_cpu(const at::Tensor& w) {
  check_weight(w, "pack_linear_weight");
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: weight must be [out, in]");
  return pack_rows(w.contiguous());
}

// [2I, K] = gate | up, I a multiple of V: rows reordered gate[0:V], up[0:V], gate[V:2V], ...,
// then packed like any weight; returned as [panels, K, PW / V, V] so that packed_linear (which
// takes 3-D packs only) refuses it.
at::Tensor pack_glu_cpu(const at::Tensor& w) {
  check_weight(w, "pack_glu_weight");
  TORCH_CHECK(w.dim() == 2 && w.size(0) % (2 * V) == 0,
              "pack_glu_weight: weight must be [2 * inter, in] with inter a multiple of ", V);
  const int64_t inter = w.size(0) / 2, k = w.size(1);
  const at::Tensor pairs = at::stack({w.narrow(0, 0, inter).reshape({inter / V, V, k}),
                                      w.narrow(0, inter, inter).reshape({inter / V, V, k})}, 1);
  const at::Tensor packed = pack_rows(pairs.reshape({2 * inter, k}).contiguous());
  return packed.view({packed.size(0), k, PW / V, V});
}

int64_t lanes_cpu() { return V; }

int64_t tall_rows_cpu() { return g_tall_max_rows.load(); }

void set_tall_rows_cpu(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= kBlockRows,
              "set_packed_linear_tall_rows: rows must be in [0, ", kBlockRows, "]");
  g_tall_max_rows.store(rows);
}

#ifdef TETRI_LINEAR_SIMD
// R rows x NV vectors of outputs at y (row stride ldy), over K; `ncols` valid columns (less
// than NV * V only in the last panel); with Glu, vectors 2j and 2j + 1 are a gate and an up
// vector and the tile stores NV / 2 vectors of silu(gate) * up; `pf_lines` cache lines from
// `pf` prefetched evenly over the K steps (this tile's share of the next panel).
template <int R, int NV, bool Glu>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k,
          const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t ncols,
          const float* __restrict pf, int64_t pf_lines) {
  VReg acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  }
  int64_t credit = 0;  // pf_lines / k lines per step, without a division per step
  for (int64_t i = 0; i < k; ++i) {
    for (credit += pf_lines; credit >= k; credit -= k, pf += kLineFloats) {
      __builtin_prefetch(pf, 0, 2);  // into L2: used by the next panel
    }
    VReg w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) w[v] = vload(panel + i * PW + v * V);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const VReg xb = vset1(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xb, w[v], acc[r][v]);
    }
  }
  if constexpr (Glu) {
    using FVec = at::vec::Vectorized<float>;
    const FVec one(1.f);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int j = 0; j < NV / 2; ++j) {
        if (2 * j * V >= ncols) break;  // the last panel may hold one pair
        const FVec g(acc[r][2 * j]);
        ((g / (one + g.neg().exp())) * FVec(acc[r][2 * j + 1])).store(y + r * ldy + j * V);
      }
    }
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (bias != nullptr) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vadd(acc[r][v], vload(bias + v * V));
    }
    float* dst = y + r * ldy;
    if (ncols == NV * V) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vstore(dst + v * V, acc[r][v]);
    } else {
      float tmp[NV * V];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vstore(tmp + v * V, acc[r][v]);
      std::memcpy(dst, tmp, ncols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                        int64_t, const float*, int64_t);

template <int NV, bool Glu, int... Rs>
constexpr auto tiles(std::integer_sequence<int, Rs...>) {
  return std::array<TileFn, sizeof...(Rs) + 1>{nullptr, &tile<Rs + 1, NV, Glu>...};
}
template <bool Glu>
const auto kTall = tiles<2, Glu>(std::make_integer_sequence<int, kTallRows>{});
template <bool Glu>
const auto kWide = tiles<4, Glu>(std::make_integer_sequence<int, kWideRows>{});

// Rows [m0, m0 + rows) x panels [p0, p1), in tall tiles (half a panel) or wide ones; with Glu
// the n columns are gate/up pairs and y has n / 2.
template <bool Glu>
void run_panels(const float* x, int64_t k, const float* packed, const float* bias, float* y,
                int64_t n, int64_t m0, int64_t rows, int64_t p0, int64_t p1, int64_t panels,
                bool tall) {
  const int64_t step_rows = tall ? kTallRows : kWideRows;
  const int64_t tile_cols = tall ? 2 * V : PW;
  // The next panel is prefetched while this one runs, a share per tile: one tile alone
  // cannot keep enough lines in flight, and tiles without a share would leave the bus idle.
  const int64_t tiles = (std::min(PW, n) + tile_cols - 1) / tile_cols *
                        ((rows + step_rows - 1) / step_rows);
  const int64_t lines = k * PW / kLineFloats;
  int64_t t = 0;
  for (int64_t p = p0; p < p1; ++p, t = 0) {
    const float* panel = packed + p * k * PW;
    // prefetched during panel p: panel p + kAhead; during the first, panels p + 1 .. p + kAhead
    // (contiguous), so none comes cold; the last panels prefetch nothing. One panel ahead
    // measured faster than two and four here (weights streamed from memory, 1-256 rows:
    // docs/benchmarks.md, session 20).
    const int64_t ahead_first = p == p0 ? p + 1 : p + kAhead;
    const int64_t ahead_last = std::min(p + kAhead, panels - 1);
    const float* next = packed + std::min(ahead_first, panels - 1) * k * PW;
    const int64_t next_lines = ahead_first <= ahead_last ? (ahead_last - ahead_first + 1) * lines : 0;
    for (int64_t c0 = 0; c0 < PW; c0 += tile_cols) {
      const int64_t col = p * PW + c0;
      if (col >= n) break;
      const int64_t ncols = std::min(tile_cols, n - col);
      const float* b = nullptr;
      float bias_pad[PW];
      if (bias != nullptr) {
        std::fill_n(bias_pad, tile_cols, 0.f);
        std::memcpy(bias_pad, bias + col, ncols * sizeof(float));
        b = bias_pad;
      }
      // Rows split evenly over the fewest tiles (32 rows on AVX2: 6, 6, 5, 5, 5, 5, not
      // 6 x 5 + 2): a tile of few rows has too few accumulator chains to hide the FMA
      // latency, so it takes about as long per k step as a full one.
      const int64_t row_tiles = (rows + step_rows - 1) / step_rows;
      for (int64_t i = 0, r0 = 0, r = 0; i < row_tiles; ++i, r0 += r) {
        r = (rows - r0 + row_tiles - i - 1) / (row_tiles - i);
        const int64_t first = next_lines * t / tiles, last = next_lines * (t + 1) / tiles;
        ++t;
        const TileFn fn = tall ? kTall<Glu>[r] : kWide<Glu>[r];
        const int64_t ldy = Glu ? n / 2 : n;
        fn(x + (m0 + r0) * k, k, panel + c0, k, b, y + (m0 + r0) * ldy + (Glu ? col / 2 : col),
           ldy, ncols, next + first * kLineFloats, last - first);
      }
    }
  }
}
#endif

bool supported_cpu() {
#ifdef TETRI_LINEAR_SIMD
  return true;
#else
  return false;
#endif
}

// y = the rows of x through the packed weight (n columns before any GLU pairing), threads
// splitting the panels.
template <bool Glu>
void run(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n,
         at::Tensor& y) {
#ifdef TETRI_LINEAR_SIMD
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool tall = m <= g_tall_max_rows.load(std::memory_order_relaxed);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    int64_t block = m;
    if (!tall) {  // equal blocks of at most kBlockRows, whole wide tiles
      const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
      block = ((m + blocks - 1) / blocks + kWideRows - 1) / kWideRows * kWideRows;
    }
    for (int64_t m0 = 0; m0 < m; m0 += block) {
      run_panels<Glu>(xp, k, pp, bias, yp, n, m0, std::min(block, m - m0), p0, p1, panels,
                      tall);
    }
  });
#else
  (void)x, (void)packed, (void)bias, (void)n, (void)y;
  TORCH_CHECK(false, "packed_linear: this build has no kernel (neither AVX2 nor AVX-512)");
#endif
}

at::Tensor packed_linear_cpu(const at::Tensor& x_, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t n) {
  check_weight(x_, "packed_linear");
  check_weight(packed, "packed_linear");
  TORCH_CHECK(x_.dim() == 2, "packed_linear: x must be [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PW && packed.is_contiguous() &&
                  packed.size(1) == x_.size(1) && n > (packed.size(0) - 1) * PW &&
                  n <= packed.size(0) * PW,
              "packed_linear: the weight is not a pack_linear_weight of [", n, ", ", x_.size(1),
              "] for this build");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->is_contiguous() && bias->scalar_type() == at::kFloat),
              "packed_linear: bias must be a contiguous float32 [out] tensor");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  run<false>(x, packed, bias.has_value() ? bias->data_ptr<float>() : nullptr, n, y);
  return y;
}

at::Tensor packed_glu_cpu(const at::Tensor& x_, const at::Tensor& packed, int64_t inter) {
  check_weight(x_, "packed_glu");
  check_weight(packed, "packed_glu");
  TORCH_CHECK(x_.dim() == 2, "packed_glu: x must be [rows, in]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) * packed.size(3) == PW &&
                  packed.size(3) == V && packed.is_contiguous() &&
                  packed.size(1) == x_.size(1) && inter % V == 0 &&
                  packed.size(0) == (2 * inter + PW - 1) / PW,
              "packed_glu: the weight is not a pack_glu_weight of [2 * ", inter, ", ",
              x_.size(1), "] for this build");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty({x.size(0), inter}, x.options());
  run<true>(x, packed, nullptr, 2 * inter, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tetri, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("packed_linear_supported() -> bool");
  m.def("packed_linear_lanes() -> int");
  m.def("packed_linear_tall_rows() -> int");
  m.def("set_packed_linear_tall_rows(int rows) -> ()");
  m.def("pack_glu_weight(Tensor gate_up) -> Tensor");
  m.def("packed_glu(Tensor x, Tensor packed, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(tetri, CPU, m) {
  m.impl("pack_linear_weight", &pack_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("pack_glu_weight", &pack_glu_cpu);
  m.impl("packed_glu", &packed_glu_cpu);
}

TORCH_LIBRARY_IMPL(tetri, CatchAll, m) {
  m.impl("packed_linear_supported", &supported_cpu);
  m.impl("packed_linear_lanes", &lanes_cpu);
  m.impl("packed_linear_tall_rows", &tall_rows_cpu);
  m.impl("set_packed_linear_tall_rows", &set_tall_rows_cpu);
}
