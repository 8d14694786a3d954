// y = x W^T (+ b) in fp32 for few rows, with weights packed once into 16-column panels.
//
// Why (dev/LOG.md, session 11): on an AVX2 CPU, library GEMMs with 2..32 rows read each weight from memory
// and then compute, one after the other: a 17-token verify of SmolLM2-135M cost 2.3 plain steps. Here each
// panel P[p] = W[16p : 16p+16, :]^T is one contiguous [K, 16] stream; a micro-kernel keeps MR <= 6 rows x 16
// columns of sums in 12 AVX registers, and while the first rows of a panel run it prefetches the next panel,
// so the memory stream overlaps the arithmetic.
//
// Row invariance: every output element is one FMA chain over k = 0..K-1 in order, whatever MR or the number
// of rows in the call. A token's logits are therefore bit-identical in a plain step and in a k-token verify.
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

template <int MR>
void rows_x_panel(const float* __restrict x, const float* __restrict panel, int64_t K, float* y, int64_t ldy,
                  int ncols, const float* bias, const float* next_panel) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * NR), w1 = _mm256_load_ps(panel + k * NR + 8);
    if (next_panel) _mm_prefetch(reinterpret_cast<const char*>(next_panel + k * NR), _MM_HINT_T0);
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

}  // namespace

extern "C" {

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
      rows_x_panel<1>(x, P + p * K * NR, K, y + p * NR, N, ncols, bias ? bias + p * NR : nullptr, nullptr);
    }
    return;
  }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const float* panel = P + p * K * NR;
    const float* next = p + 1 < np ? panel + K * NR : nullptr;
    const int ncols = static_cast<int>(N - p * NR < NR ? N - p * NR : NR);
    const float* b = bias ? bias + p * NR : nullptr;
    float* yp = y + p * NR;
    int64_t r = 0;
    for (; r + 6 <= M; r += 6)
      rows_x_panel<6>(x + r * K, panel, K, yp + r * N, N, ncols, b, r == 0 ? next : nullptr);
    const float* pf = r == 0 ? next : nullptr;
    switch (M - r) {
      case 1: rows_x_panel<1>(x + r * K, panel, K, yp + r * N, N, ncols, b, pf); break;
      case 2: rows_x_panel<2>(x + r * K, panel, K, yp + r * N, N, ncols, b, pf); break;
      case 3: rows_x_panel<3>(x + r * K, panel, K, yp + r * N, N, ncols, b, pf); break;
      case 4: rows_x_panel<4>(x + r * K, panel, K, yp + r * N, N, ncols, b, pf); break;
      case 5: rows_x_panel<5>(x + r * K, panel, K, yp + r * N, N, ncols, b, pf); break;
      default: break;
    }
  }
}

}  // extern "C"
