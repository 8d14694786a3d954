// y = x W^T (+ b) with W kept quantized (weight-only int4 / int8 in groups of 32 along K), x and y in fp32.
//
// Why: decoding a small model on a CPU streams every weight once per forward. fp32 weights are 4 bytes each;
// the GGUF the user gave us is 0.56-1.06 bytes. Keeping the file's blocks (Q4_0, Q4_1, Q4_K, Q8_0) streams
// 4-7x fewer bytes, and a small model's weights then fit in L3.
//
// Layout (shared with quant_dot.cpp): outputs in panels of 16; per panel and group of 32 inputs, chunks of 64
// bytes, byte 4j + b of a chunk belonging to output j (so one 64-byte load is 16 lanes of 4 bytes, the shape of an
// integer dot-product instruction):
//   int4: 4 chunks; chunk c holds inputs 4c + b in the low nibbles and 16 + 4c + b in the high ones;
//   int8: 8 chunks; chunk t holds inputs 4t + b as int8;
//   scale (and for int4 min) per output and group: w = scale * q + min (int4, q in 0..15), w = scale * q
//   (int8, q in -128..127). Q4_0 (min = -8 d), Q4_1, Q4_K (scale = d * sc, min = -dmin * m) and Q8_0 map onto
//   it with the exact values the GGUF de-quantizer gives. Scales are fp16 where every value is one (the file's
//   own d and m for Q4_0 / Q4_1 / Q8_0: 20 bytes a group of int4 instead of 24, the bytes llama.cpp streams) and
//   fp32 otherwise (Q4_K's products); the loads convert fp16 exactly, so both give the same bits.
//
// The sum is factored per group, as llama.cpp's is: sum_k x_k (s q_k + m) = s (sum_k x_k q_k) + m (sum_k x_k).
// The inner loop is then one FMA per weight and row on the integer code converted to float; the scale, the min
// and the row's group sum (computed once per row, in order) enter once per group. That is a different rounding
// from de-quantizing each weight first, so the result matches the de-quantized reference to fp32 tolerance,
// not bitwise (tests/test_quant_gemm.py); what losslessness needs is the next property.
//
// Row invariance, as in packed_gemm.cpp: each output lane sums over k in order in two FMA chains per group
// (even k, odd k), added and folded into the total group by group, whatever the number of rows or the tile that
// computes it. Lanes never mix, so the AVX2 and AVX-512 builds give bitwise the same result too (built with
// -ffp-contract=off, so the scalar group sums are the same code in both). More rows share each converted weight
// vector (up to 8 rows per pass), which is what makes a k-token verify cheap.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int W = 16;  // outputs per panel

#ifdef __AVX512F__
constexpr int HALVES = 1;  // registers per panel
constexpr int MAX_ROWS = 8;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline void vstore(float* y, const V* t, const float* bias, int n) {
  V s = t[0];
  if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), bias));
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << n) - 1), s);
}
using VI = __m512i;
inline VI iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
// The 4-bit code at `bit` of each lane, and the int8 at `bit`, as floats.
inline V codes4(VI v, int bit) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, bit), _mm512_set1_epi32(0x0F)));
}
inline V codes8(VI v, int bit) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - bit), 24)); }
#else
constexpr int HALVES = 2;
constexpr int MAX_ROWS = 2;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline void vstore8(float* y, V s, const float* bias, int n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  for (int j = 0; j < n; ++j) y[j] = t[j] + (bias ? bias[j] : 0.f);
}
inline void vstore(float* y, const V* t, const float* bias, int n) {
  vstore8(y, t[0], bias, n < 8 ? n : 8);
  if (n > 8) vstore8(y + 8, t[1], bias ? bias + 8 : nullptr, n - 8);
}
using VI = __m256i;
inline VI iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V codes4(VI v, int bit) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, bit), _mm256_set1_epi32(0x0F)));
}
inline V codes8(VI v, int bit) { return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - bit), 24)); }
#endif
constexpr int LANES = W / HALVES;
constexpr int64_t ROW_BLOCK = 128;  // rows per block of a many-rows call (their x stays in L2)

// The integer codes of inputs 2i and 2i + 1 of a group, for one panel, as floats. A chunk's 4 bytes per output
// sit in one 32-bit lane, so a code is a shift and a mask (int4) or a sign-extending shift pair (int8) away.
struct Int4 {
  static constexpr int GROUP_BYTES = 4 * 64;
  static constexpr bool HAS_MIN = true;
  static inline void pair(const uint8_t* group, int i, V* even, V* odd) {
    const int nibble = i < 8 ? 0 : 4, c = (i % 8) / 2, b = 2 * (i % 2);
    for (int h = 0; h < HALVES; ++h) {
      const VI lanes = iload(group + c * 64 + h * (64 / HALVES));
      even[h] = codes4(lanes, 8 * b + nibble);
      odd[h] = codes4(lanes, 8 * (b + 1) + nibble);
    }
  }
};

struct Int8 {
  static constexpr int GROUP_BYTES = 8 * 64;
  static constexpr bool HAS_MIN = false;
  static inline void pair(const uint8_t* group, int i, V* even, V* odd) {
    const int t = i / 2, b = 2 * (i % 2);
    for (int h = 0; h < HALVES; ++h) {
      const VI lanes = iload(group + t * 64 + h * (64 / HALVES));
      even[h] = codes8(lanes, 8 * b);
      odd[h] = codes8(lanes, 8 * (b + 1));
    }
  }
};

// MR rows x NP panels over all K. Per group, acc[r][p][0] sums x q over even inputs, acc[r][p][1] over odd ones
// (HALVES registers each); tot[r][p] takes s * (even + odd) + m * xsum at the group's end.
template <class Q, class S, int MR, int NP>
void tile(const float* __restrict x, int64_t K, const float* __restrict xsum, const uint8_t* __restrict q,
          const S* __restrict scale, const S* __restrict minv, int64_t panel_stride, float* y, int64_t ldy,
          const float* bias, int64_t n_left) {
  const int64_t G = K / GROUP;
  V tot[MR][NP][HALVES];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) tot[r][p][h] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    V acc[MR][NP][2][HALVES];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < HALVES; ++h) acc[r][p][0][h] = acc[r][p][1][h] = vzero();
#pragma GCC unroll 16
    for (int i = 0; i < GROUP / 2; ++i) {
      const int64_t k = g * GROUP + 2 * i;
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        V even[HALVES], odd[HALVES];
        Q::pair(q + p * panel_stride + g * Q::GROUP_BYTES, i, even, odd);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const V xe = vbcast(x + r * K + k), xo = vbcast(x + r * K + k + 1);
#pragma GCC unroll 2
          for (int h = 0; h < HALVES; ++h) {
            acc[r][p][0][h] = vfma(xe, even[h], acc[r][p][0][h]);
            acc[r][p][1][h] = vfma(xo, odd[h], acc[r][p][1][h]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) {
        const V s = vload(scale + p * G * W + g * W + h * LANES);
        const V m = Q::HAS_MIN ? vload(minv + p * G * W + g * W + h * LANES) : vzero();
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          tot[r][p][h] = vfma(vadd(acc[r][p][0][h], acc[r][p][1][h]), s, tot[r][p][h]);
          if constexpr (Q::HAS_MIN) tot[r][p][h] = vfma(m, vbcast(xsum + r * G + g), tot[r][p][h]);
        }
      }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const int64_t left = n_left - p * W;
      if (left <= 0) break;
      const int n = static_cast<int>(left < W ? left : W);
      vstore(y + r * ldy + p * W, tot[r][p], bias ? bias + p * W : nullptr, n);
    }
}

template <class Q, class S, int MR>
void rows_pass(const float* x, int64_t K, const float* xsum, const uint8_t* q, const S* scale, const S* minv,
               int64_t stride, float* y, int64_t ldy, const float* bias, int64_t n_left, int64_t rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_pass<Q, S, MR - 1>(x, K, xsum, q, scale, minv, stride, y, ldy, bias, n_left, rows);
  }
  tile<Q, S, MR, 1>(x, K, xsum, q, scale, minv, stride, y, ldy, bias, n_left);
}

template <class Q, class S>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minv,
            int64_t N, const float* bias, float* y, int nthreads) {
  const int64_t G = K / GROUP;
  const int64_t P = (N + W - 1) / W;
  const int64_t stride = G * Q::GROUP_BYTES;  // one panel's bytes
  constexpr int NP1 = 4 / HALVES;  // panels per tile for one row: eight FMA chains
  // Each row's sum per group, in order (the same scalar code in every build and for every row count).
  std::vector<float> sums(Q::HAS_MIN ? M * G : 0);
  if (Q::HAS_MIN)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float t = 0.f;
        for (int k = 0; k < GROUP; ++k) t += x[r * K + g * GROUP + k];
        sums[r * G + g] = t;
      }
  const float* xs = sums.data();
  if (M == 1) {
    const int64_t tiles = (P + NP1 - 1) / NP1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t p = t * NP1;
      const uint8_t* qp = q + p * stride;
      const S* sp = scale + p * G * W;
      const S* mp = minv ? minv + p * G * W : nullptr;
      const float* bp = bias ? bias + p * W : nullptr;
      if (p + NP1 <= P)
        tile<Q, S, 1, NP1>(x, K, xs, qp, sp, mp, stride, y + p * W, N, bp, N - p * W);
      else
        for (int64_t e = p; e < P; ++e)
          tile<Q, S, 1, 1>(x, K, xs, q + e * stride, scale + e * G * W, minv ? minv + e * G * W : nullptr, stride,
                        y + e * W, N, bias ? bias + e * W : nullptr, N - e * W);
    }
    return;
  }
  // Rows in blocks of ROW_BLOCK (a prefill's x would otherwise be re-read from L3 once per panel), and within a
  // block in balanced passes of up to MAX_ROWS over each panel: the panel comes from memory or L2 once per
  // block, later passes re-read it from L1 (one panel's int4 weights: 8 K bytes). A row's outputs are the same
  // chains whichever block or pass computes them.
  for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
    const int64_t rb = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
    const int64_t passes = (rb + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t p = 0; p < P; ++p) {
      int64_t r = r0;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t rows = (r0 + rb - r + passes - pass - 1) / (passes - pass);
        rows_pass<Q, S, MAX_ROWS>(x + r * K, K, xs + (Q::HAS_MIN ? r * G : 0), q + p * stride, scale + p * G * W,
                               minv ? minv + p * G * W : nullptr, stride, y + r * N + p * W, N,
                               bias ? bias + p * W : nullptr, N - p * W, rows);
        r += rows;
      }
    }
  }
}

}  // namespace

#include "quant_abi.h"
