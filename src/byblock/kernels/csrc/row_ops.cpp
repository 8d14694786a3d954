// Per-row elementwise ops of a decoder layer in one call each: RMSNorm, and RMSNorm + rotary embedding of heads.
//
// Why: torch's rms_norm is a composite on the CPU build byblock runs on (pow, mean, add, rsqrt, mul, mul: ~25 us a
// call for a handful of rows, almost all of it dispatch), and the rotary embedding is another five dispatches
// (slice, neg, cat, two muls, add). A drafter forward runs 17 norms and 9 rotations (dev/LOG.md, session 36).
//
// Each row is computed on its own, in one fixed order (the sum of squares in 8 lanes over k, lanes then added
// 0..7), so a row's result never depends on the other rows of the call: row-invariant, as the GEMMs are. Built
// with -ffp-contract=off: the same expression gives the same bits whatever the compiler fuses.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {

// 1 / sqrt(mean(x^2) + eps) of one row of K floats (K a multiple of 8).
inline float inv_rms(const float* x, int64_t K, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0.f;
  for (float l : lanes) s += l;
  return 1.f / sqrtf(s / static_cast<float>(K) + eps);
}

// y = w * (x * r) for one row (w may be null: no weight).
inline void scale_row(const float* x, int64_t K, float r, const float* w, float* y) {
  for (int64_t i = 0; i < K; ++i) y[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

// The half rotation of one head in place: y_i = y_i cos_i + rot(y)_i sin_i, rot(y) = (-y[K/2:], y[:K/2]).
inline void rotate_head(float* y, int64_t K, const float* cos, const float* sin) {
  const int64_t half = K / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = y[i], b = y[i + half];
    y[i] = a * cos[i] + (-b) * sin[i];
    y[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace

extern "C" {

// M rows of H heads of K floats: element (r, h, i) at x[r * ldx + h * K + i]; y [M, H, K] contiguous.
// norm: w null -> no RMSNorm (rotation only); else y = w * (x * inv_rms) per head, eps its epsilon.
// cos / sin null -> no rotation; else [M, K] contiguous (one position per row, shared by the row's heads).
void byblock_row_norm_rope(const float* x, int64_t M, int64_t H, int64_t K, int64_t ldx, const float* w, int norm,
                           float eps, const float* cos, const float* sin, float* y, int nthreads) {
  const int64_t items = M * H;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && items * K >= 65536)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it / H, h = it % H;
    const float* src = x + r * ldx + h * K;
    float* dst = y + it * K;
    scale_row(src, K, norm ? inv_rms(src, K, eps) : 1.f, norm ? w : nullptr, dst);
    if (cos) rotate_head(dst, K, cos + r * K, sin + r * K);
  }
}

}  // extern "C"
