// y = x W^T (+ b) in fp32 for few rows, with weights packed once into 16-column panels.
//
// Why (dev/LOG.md, session 11): on an AVX2 CPU, library GEMMs with 2..32 rows read each weight from memory
// and then compute, one after the other: a 17-token verify of SmolLM2-135M cost 2.3 plain steps. Here each
// panel P[p] = W[16p : 16p+16, :]^T is one contiguous [K, 16] stream; a micro-kernel keeps MR <= 6 rows x 16
// columns of sums in 12 AVX registers while it prefetches the next panel, so the memory stream overlaps the
// arithmetic. Session 12: more rows go in balanced passes (9 = 5 + 4) that each prefetch a share of the next
// panel (the stream no longer idles after the first pass), and 2-3 rows take two panels at once (enough
// independent FMA chains); a 17-token forward went from 2.17 to 1.68 plain steps (benchmarks/packed_gemm_ab.py).
//
// Row invariance: every output element is one FMA chain over k = 0..K-1 in order, whatever MR or the number
// of rows in the call. A token's logits are therefore bit-identical in a plain step and in a k-token verify.
//
// Session 26: many rows (a prefill) on an AVX-512 build take `many_rows_512`: one 16-lane register per panel
// row, up to 12 rows x 2 panels per pass, rows in blocks that stay in L2 while every panel streams past them
// (the AVX2 path re-read all of x once per panel). Each output is still the same FMA chain over k in order
// (an FMA rounds once per lane whatever the register width), so the two builds and both paths agree bit for bit.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int NR = 16;  // columns per panel: two 8-float AVX registers

inline void store_row(__m256 lo, __m256 hi, float* y, int ncols, const float* bias) {
  alignas(32) float t[NR];
  _mm256_store_ps(t, lo);
  _mm256_store_ps(t + 8, hi);
  if (bias)
    for (int j = 0; j < ncols; ++j) t[j] += bias[j];
  memcpy(y, t, ncols * sizeof(float));
}

// MR rows x one panel. Named accumulators (not an array) keep GCC from spilling them to the stack.
#define BYBLOCK_ROW(i)                                                         \
  if (MR > i) {                                                                \
    __m256 s = _mm256_broadcast_ss(x + i * K + k);                             \
    c##i##0 = _mm256_fmadd_ps(s, w0, c##i##0);                                 \
    c##i##1 = _mm256_fmadd_ps(s, w1, c##i##1);                                 \
  }
#define BYBLOCK_OUT(i) \
  if (MR > i) store_row(c##i##0, c##i##1, y + i * ldy, ncols, bias);

// Prefetch plan for one pass over a panel: lines [first, first + K / every) of the next panel, one every `every`
// k steps. A panel row of 16 floats is one 64-byte cache line.
struct Prefetch {
  const float* next;  // the next panel, or null
  int64_t first;
  int every;
};

// SPREAD: the pass is one of several over this panel and prefetches only its share (a countdown); otherwise it
// prefetches the whole next panel, one line per k step, without the countdown's branch.
template <int MR, bool SPREAD>
void rows_x_panel(const float* __restrict x, const float* __restrict panel, int64_t K, float* y, int64_t ldy,
                  int ncols, const float* bias, Prefetch pf) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  int64_t line = pf.first;
  int countdown = pf.every;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * NR), w1 = _mm256_load_ps(panel + k * NR + 8);
    if (!SPREAD) {
      if (pf.next) _mm_prefetch(reinterpret_cast<const char*>(pf.next + k * NR), _MM_HINT_T0);
    } else if (--countdown == 0) {
      countdown = pf.every;
      if (line < K) _mm_prefetch(reinterpret_cast<const char*>(pf.next + line * NR), _MM_HINT_T0);
      ++line;
    }
    BYBLOCK_ROW(0) BYBLOCK_ROW(1) BYBLOCK_ROW(2) BYBLOCK_ROW(3) BYBLOCK_ROW(4) BYBLOCK_ROW(5)
  }
  BYBLOCK_OUT(0) BYBLOCK_OUT(1) BYBLOCK_OUT(2) BYBLOCK_OUT(3) BYBLOCK_OUT(4) BYBLOCK_OUT(5)
}

// One row x four panels: eight independent FMA chains hide the FMA latency that one row x one panel (two
// chains) would expose; each element's order over k is unchanged. No software prefetch: for one row the
// hardware prefetcher streams the four panels faster (measured).
void row_x_4panels(const float* __restrict x, const float* __restrict p, int64_t K, float* y, const float* bias) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, a1 = z, b0 = z, b1 = z, c0 = z, c1 = z, d0 = z, d1 = z;
  const float *pa = p, *pb = p + K * NR, *pc = p + 2 * K * NR, *pd = p + 3 * K * NR;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 s = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(s, _mm256_load_ps(pa + k * NR), a0);
    a1 = _mm256_fmadd_ps(s, _mm256_load_ps(pa + k * NR + 8), a1);
    b0 = _mm256_fmadd_ps(s, _mm256_load_ps(pb + k * NR), b0);
    b1 = _mm256_fmadd_ps(s, _mm256_load_ps(pb + k * NR + 8), b1);
    c0 = _mm256_fmadd_ps(s, _mm256_load_ps(pc + k * NR), c0);
    c1 = _mm256_fmadd_ps(s, _mm256_load_ps(pc + k * NR + 8), c1);
    d0 = _mm256_fmadd_ps(s, _mm256_load_ps(pd + k * NR), d0);
    d1 = _mm256_fmadd_ps(s, _mm256_load_ps(pd + k * NR + 8), d1);
  }
  store_row(a0, a1, y, NR, bias);
  store_row(b0, b1, y + NR, NR, bias ? bias + NR : nullptr);
  store_row(c0, c1, y + 2 * NR, NR, bias ? bias + 2 * NR : nullptr);
  store_row(d0, d1, y + 3 * NR, NR, bias ? bias + 3 * NR : nullptr);
}

// Two or three rows x two panels: 8 or 12 independent FMA chains where one panel would give 4 or 6, too few to
// hide the FMA latency (a 2-row forward cost more than a 6-row one). Prefetches the next pair of panels.
#define BYBLOCK_ROW2(i)                                           \
  if (MR > i) {                                                   \
    __m256 s = _mm256_broadcast_ss(x + i * K + k);                \
    c##i##0 = _mm256_fmadd_ps(s, wa0, c##i##0);                   \
    c##i##1 = _mm256_fmadd_ps(s, wa1, c##i##1);                   \
    c##i##2 = _mm256_fmadd_ps(s, wb0, c##i##2);                   \
    c##i##3 = _mm256_fmadd_ps(s, wb1, c##i##3);                   \
  }
#define BYBLOCK_OUT2(i)                                                        \
  if (MR > i) {                                                                \
    store_row(c##i##0, c##i##1, y + i * ldy, NR, bias);                        \
    store_row(c##i##2, c##i##3, y + i * ldy + NR, NR, bias ? bias + NR : nullptr); \
  }

template <int MR>
void rows_x_2panels(const float* __restrict x, const float* __restrict pa, int64_t K, float* y, int64_t ldy,
                    const float* bias, const float* next) {
  static_assert(MR >= 1 && MR <= 3, "12 accumulators at most");
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z, c23 = z;
  const float* pb = pa + K * NR;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 wa0 = _mm256_load_ps(pa + k * NR), wa1 = _mm256_load_ps(pa + k * NR + 8);
    const __m256 wb0 = _mm256_load_ps(pb + k * NR), wb1 = _mm256_load_ps(pb + k * NR + 8);
    if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + (K + k) * NR), _MM_HINT_T0);
    }
    BYBLOCK_ROW2(0) BYBLOCK_ROW2(1) BYBLOCK_ROW2(2)
  }
  BYBLOCK_OUT2(0) BYBLOCK_OUT2(1) BYBLOCK_OUT2(2)
}

template <bool SPREAD>
void rows_pass(int64_t rows, const float* x, const float* panel, int64_t K, float* y, int64_t ldy, int ncols,
               const float* bias, Prefetch pf) {
  switch (rows) {
    case 1: rows_x_panel<1, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
    case 2: rows_x_panel<2, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
    case 3: rows_x_panel<3, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
    case 4: rows_x_panel<4, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
    case 5: rows_x_panel<5, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
    default: rows_x_panel<6, SPREAD>(x, panel, K, y, ldy, ncols, bias, pf); break;
  }
}

#ifdef __AVX512F__
constexpr int MR512 = 12;  // rows per pass: 24 accumulators + 2 weight registers + 1 broadcast of 32
constexpr int64_t ROW_BLOCK = 96;  // rows whose x stays in L2 while the panels stream past them
constexpr int64_t MANY_ROWS = 16;  // from here on the AVX-512 path; fewer rows stay on the AVX2 passes, whose prefetching
                                    // streams a weight from memory faster (the 49152-row LM head at 4-8 rows)

inline void store512(__m512 c, float* y, int ncols, const float* bias) {
  alignas(64) float t[NR];
  _mm512_store_ps(t, c);
  if (bias)
    for (int j = 0; j < ncols; ++j) t[j] += bias[j];
  memcpy(y, t, ncols * sizeof(float));
}

#define BYBLOCK_R512(i)                                        \
  if (MR > i) {                                                \
    const __m512 s = _mm512_set1_ps(x[i * K + k]);             \
    a##i = _mm512_fmadd_ps(s, wa, a##i);                       \
    if (TWO) b##i = _mm512_fmadd_ps(s, wb, b##i);              \
  }
#define BYBLOCK_S512(i)                                                                     \
  if (MR > i) {                                                                             \
    store512(a##i, y + i * ldy, TWO ? NR : ncols, bias);                                    \
    if (TWO) store512(b##i, y + i * ldy + NR, NR, bias ? bias + NR : nullptr);              \
  }

// MR rows x one panel (TWO = false; ncols <= 16) or two full panels (TWO = true).
template <int MR, bool TWO>
void rows_x_panels_512(const float* __restrict x, const float* __restrict pa, int64_t K, float* y, int64_t ldy,
                       int ncols, const float* bias) {
  const __m512 z = _mm512_setzero_ps();
  __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, a8 = z, a9 = z, a10 = z, a11 = z;
  __m512 b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z, b6 = z, b7 = z, b8 = z, b9 = z, b10 = z, b11 = z;
  const float* pb = pa + K * NR;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wa = _mm512_loadu_ps(pa + k * NR);
    const __m512 wb = TWO ? _mm512_loadu_ps(pb + k * NR) : z;
    BYBLOCK_R512(0) BYBLOCK_R512(1) BYBLOCK_R512(2) BYBLOCK_R512(3) BYBLOCK_R512(4) BYBLOCK_R512(5)
    BYBLOCK_R512(6) BYBLOCK_R512(7) BYBLOCK_R512(8) BYBLOCK_R512(9) BYBLOCK_R512(10) BYBLOCK_R512(11)
  }
  BYBLOCK_S512(0) BYBLOCK_S512(1) BYBLOCK_S512(2) BYBLOCK_S512(3) BYBLOCK_S512(4) BYBLOCK_S512(5)
  BYBLOCK_S512(6) BYBLOCK_S512(7) BYBLOCK_S512(8) BYBLOCK_S512(9) BYBLOCK_S512(10) BYBLOCK_S512(11)
}

template <bool TWO>
void pass_512(int64_t rows, const float* x, const float* pa, int64_t K, float* y, int64_t ldy, int ncols,
              const float* bias) {
  switch (rows) {
    case 1: rows_x_panels_512<1, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 2: rows_x_panels_512<2, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 3: rows_x_panels_512<3, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 4: rows_x_panels_512<4, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 5: rows_x_panels_512<5, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 6: rows_x_panels_512<6, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 7: rows_x_panels_512<7, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 8: rows_x_panels_512<8, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 9: rows_x_panels_512<9, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 10: rows_x_panels_512<10, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    case 11: rows_x_panels_512<11, TWO>(x, pa, K, y, ldy, ncols, bias); break;
    default: rows_x_panels_512<12, TWO>(x, pa, K, y, ldy, ncols, bias); break;
  }
}

// Row blocks outside, pairs of panels inside (split between the threads), passes of <= 12 rows innermost.
void many_rows_512(const float* x, int64_t M, int64_t K, const float* P, int64_t N, const float* bias, float* y,
                   int nthreads) {
  const int64_t np = (N + NR - 1) / NR;
  const int64_t units = (np + 1) / 2;  // unit u: panels 2u and 2u + 1 (the last may be single or partial)
  for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
    const int64_t rb = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t p = 2 * u;
      const float* pa = P + p * K * NR;
      const bool two = p + 1 < np && N - (p + 1) * NR >= NR;  // both panels full
      const float* b = bias ? bias + p * NR : nullptr;
      for (int64_t r = 0; r < rb; r += MR512) {
        const int64_t rows = rb - r < MR512 ? rb - r : MR512;
        const float* xr = x + (r0 + r) * K;
        float* yr = y + (r0 + r) * N + p * NR;
        if (two) {
          pass_512<true>(rows, xr, pa, K, yr, N, NR, b);
        } else {
          const int nc = static_cast<int>(N - p * NR < NR ? N - p * NR : NR);
          pass_512<false>(rows, xr, pa, K, yr, N, nc, b);
          if (p + 1 < np) {  // a full panel then a partial one
            const int nc2 = static_cast<int>(N - (p + 1) * NR < NR ? N - (p + 1) * NR : NR);
            pass_512<false>(rows, xr, pa + K * NR, K, yr + NR, N, nc2, bias ? b + NR : nullptr);
          }
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

int byblock_packed_isa() {
#ifdef __AVX512F__
  return 512;
#else
  return 256;
#endif
}

int byblock_panel_width() { return NR; }

// W: [N, K] row-major -> P: [ceil(N/NR), K, NR], columns past N zero.
void byblock_pack(const float* W, int64_t N, int64_t K, float* P) {
  const int64_t np = (N + NR - 1) / NR;
  for (int64_t p = 0; p < np; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        P[(p * K + k) * NR + j] = n < N ? W[n * K + k] : 0.f;
      }
}

// x: [M, K] contiguous, P: packed (32-byte aligned), bias: [N] or null, y: [M, N] contiguous.
void byblock_packed_linear(const float* x, int64_t M, int64_t K, const float* P, int64_t N, const float* bias,
                           float* y, int nthreads) {
  const int64_t np = (N + NR - 1) / NR;
  const int64_t full = N / NR;  // panels with NR real columns
  if (M == 1) {
    const int64_t groups = full / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t g = 0; g < groups; ++g)
      row_x_4panels(x, P + g * 4 * K * NR, K, y + g * 4 * NR, bias ? bias + g * 4 * NR : nullptr);
    for (int64_t p = groups * 4; p < np; ++p) {
      const int ncols = static_cast<int>(N - p * NR < NR ? N - p * NR : NR);
      rows_x_panel<1, false>(x, P + p * K * NR, K, y + p * NR, N, ncols, bias ? bias + p * NR : nullptr,
                             {nullptr, 0, 1});
    }
    return;
  }
  if (M <= 3) {
    const int64_t pairs = full / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t g = 0; g < pairs; ++g) {
      const float* pa = P + 2 * g * K * NR;
      const float* next = g + 1 < pairs ? pa + 2 * K * NR : nullptr;
      const float* b = bias ? bias + 2 * g * NR : nullptr;
      if (M == 2)
        rows_x_2panels<2>(x, pa, K, y + 2 * g * NR, N, b, next);
      else
        rows_x_2panels<3>(x, pa, K, y + 2 * g * NR, N, b, next);
    }
    for (int64_t p = pairs * 2; p < np; ++p) {
      const int ncols = static_cast<int>(N - p * NR < NR ? N - p * NR : NR);
      rows_pass<false>(M, x, P + p * K * NR, K, y + p * NR, N, ncols, bias ? bias + p * NR : nullptr,
                       {nullptr, 0, 1});
    }
    return;
  }
#ifdef __AVX512F__
  if (M >= MANY_ROWS) {
    many_rows_512(x, M, K, P, N, bias, y, nthreads);
    return;
  }
#endif
  // Rows go in passes of up to 6 over each panel; the first pass streams the panel from memory, later ones
  // re-read it from cache. Each pass prefetches its share of the next panel, so memory keeps streaming during
  // all of them instead of idling after the first.
  const int passes = static_cast<int>((M + 5) / 6);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const float* panel = P + p * K * NR;
    const float* next = p + 1 < np ? panel + K * NR : nullptr;
    const int ncols = static_cast<int>(N - p * NR < NR ? N - p * NR : NR);
    const float* b = bias ? bias + p * NR : nullptr;
    float* yp = y + p * NR;
    int64_t r = 0;
    for (int pass = 0; r < M; ++pass) {
      const Prefetch pf{next, pass * K / passes, passes};
      const int64_t rows = (M - r + passes - pass - 1) / (passes - pass);  // balanced: 8 = 4 + 4, not 6 + 2
      if (passes > 1 && next)
        rows_pass<true>(rows, x + r * K, panel, K, yp + r * N, N, ncols, b, pf);
      else
        rows_pass<false>(rows, x + r * K, panel, K, yp + r * N, N, ncols, b, pf);
      r += rows;
    }
  }
}

}  // extern "C"
