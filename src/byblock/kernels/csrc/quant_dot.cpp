// y = x W^T (+ b) with W in quant_gemm.cpp's int4 / int8 layout and x quantized to int8 per row and group of 32:
// integer dot products, llama.cpp's recipe for its Q4_0 / Q4_1 / Q8_0 x Q8 dot products.
//
// Why: quant_gemm.cpp converts every weight to float and spends one fp32 FMA per weight and row. That is cheap
// for one row (memory-bound), but a 16-row verify or a prefill is then compute-bound at 16 multiply-adds per
// instruction. With the activations as int8 too, one VNNI instruction (vpdpbusd) does 64 of them: a k-row
// verify costs little more than one row for longer, and prefill runs several times faster.
//
// Activations: per row and group of 32, d = max|x| / 127, q = round-half-even(x * (1 / d)) in [-127, 127] (the
// same fp32 operations as `quantize_activations` in quant_gemm.py, so a reference can reproduce q bit for bit).
// Then per group, exactly in int32:
//   int4 (codes u in 0..15, w = s u + m):  sum_k x_k w_k ~ (s d) * sum_k u_k q_k + m * (d sum_k q_k)
//   int8 (codes v in -128..127, w = s v):  sum_k x_k w_k ~ (s d) * sum_k v_k q_k
// vpdpbusd multiplies unsigned by signed bytes: int4 codes are the unsigned side; for int8 the activations are,
// offset by 128, and sum_k v_k (q_k + 128) - 128 sum_k v_k removes the offset exactly (sum_k v_k: a second dot
// product against bytes of 1, shared by all rows).
//
// Row invariance: the integer sums are exact, so any order or tiling gives the same group sums; the fp32 part is
// one fixed sequence per output lane and group (convert, multiply by s d, add; then the min term), the same in
// every tile, for every number of rows, and in both builds (an AVX2 build emulates vpdpbusd exactly with
// vpmaddubsw / vpmaddwd, splitting the 0..255 side into nibbles where vpmaddubsw could saturate). So speculative
// decoding stays bitwise lossless on it, and the two builds agree bitwise.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int W = 16;  // outputs per panel

#ifdef __AVX512VNNI__
constexpr int HALVES = 1;  // registers per panel
constexpr int MAX_ROWS = 12;
using VI = __m512i;
using VF = __m512;
inline VI izero() { return _mm512_setzero_si512(); }
inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI bcast4(const uint8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
inline VI lo4(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline VI hi4(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
// acc += per 32-bit lane, sum of 4 products u8(u) * s8(s).
inline VI dot_small(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }  // u in 0..15
inline VI dot_byte(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }   // u in 0..255
inline VI ones8() { return _mm512_set1_epi8(1); }
inline VI isub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI shl7(VI a) { return _mm512_slli_epi32(a, 7); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline VF fload(const float* p) { return _mm512_loadu_ps(p); }
inline VF fload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF fbcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF tofloat(VI a) { return _mm512_cvtepi32_ps(a); }
inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF ffma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline void fstore(float* y, const VF* t, const float* bias, int n) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  VF s = t[0];
  if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, s);
}
#else
constexpr int HALVES = 2;
constexpr int MAX_ROWS = 2;
using VI = __m256i;
using VF = __m256;
inline VI izero() { return _mm256_setzero_si256(); }
inline VI load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI bcast4(const uint8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
inline VI lo4(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline VI hi4(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
// Exact while a pair's products fit int16: 2 * 15 * 128 does.
inline VI dot_small(VI acc, VI u, VI s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// 2 * 255 * 128 does not: u = 16 hi + lo, each side exact.
inline VI dot_byte(VI acc, VI u, VI s) {
  const VI lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo4(u), s), _mm256_set1_epi16(1));
  const VI hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi4(u), s), _mm256_set1_epi16(16));
  return _mm256_add_epi32(acc, _mm256_add_epi32(lo, hi));
}
inline VI ones8() { return _mm256_set1_epi8(1); }
inline VI isub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI shl7(VI a) { return _mm256_slli_epi32(a, 7); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VF fload(const float* p) { return _mm256_loadu_ps(p); }
inline VF fload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF fbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline VF tofloat(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF ffma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline void fstore8(float* y, VF s, const float* bias, int n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  for (int j = 0; j < n; ++j) y[j] = t[j] + (bias ? bias[j] : 0.f);
}
inline void fstore(float* y, const VF* t, const float* bias, int n) {
  fstore8(y, t[0], bias, n < 8 ? n : 8);
  if (n > 8) fstore8(y + 8, t[1], bias ? bias + 8 : nullptr, n - 8);
}
#endif
constexpr int LANES = W / HALVES;
constexpr int CHUNK = 64 / HALVES;  // bytes of a chunk one register holds
constexpr int64_t ROW_BLOCK = 128;
#ifndef BYBLOCK_PREFETCH
#define BYBLOCK_PREFETCH 16
#endif
// Groups ahead whose weight and scale lines a tile asks for: a tile reads NP panels (and their scales) as
// separate streams, more than the hardware prefetchers follow, so a decode step stalled on memory at a third
// of the bandwidth a plain read gets (dev/LOG.md, session 39). Prefetches never fault, past the end either.
constexpr int64_t PREFETCH = BYBLOCK_PREFETCH;  // rows per block of a many-rows call (their codes stay in L2)

// One group of one panel into acc[r][h] (int32, exact). `x` points at the group's 32 activation bytes of row 0.
struct Int4 {
  static constexpr int GROUP_BYTES = 4 * 64;
  static constexpr bool HAS_MIN = true;
  static constexpr bool OFFSET = false;  // activations as int8
  template <int MR>
  static inline void group(const uint8_t* q, const uint8_t* x, int64_t K, VI (*acc)[HALVES], VI*) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) {
        const VI v = load(q + c * 64 + h * CHUNK);
        const VI low = lo4(v), high = hi4(v);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
          acc[r][h] = dot_small(acc[r][h], low, bcast4(x + r * K + 4 * c));
          acc[r][h] = dot_small(acc[r][h], high, bcast4(x + r * K + 16 + 4 * c));
        }
      }
  }
};

struct Int8 {
  static constexpr int GROUP_BYTES = 8 * 64;
  static constexpr bool HAS_MIN = false;
  static constexpr bool OFFSET = true;  // activations as q + 128 (the unsigned side)
  template <int MR>
  static inline void group(const uint8_t* q, const uint8_t* x, int64_t K, VI (*acc)[HALVES], VI* wsum) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t)
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) {
        const VI v = load(q + t * 64 + h * CHUNK);
        wsum[h] = dot_small(wsum[h], ones8(), v);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) acc[r][h] = dot_byte(acc[r][h], bcast4(x + r * K + 4 * t), v);
      }
  }
};

// MR rows x NP panels over all K; xq: MR rows of K activation bytes; dx, xs: per row and group (G of them).
template <class Q, class S, int MR, int NP>
void tile(const uint8_t* __restrict xq, int64_t K, const float* __restrict dx, const float* __restrict xs,
          const uint8_t* __restrict q, const S* __restrict scale, const S* __restrict minv,
          int64_t panel_stride, float* y, int64_t ldy, const float* bias, int64_t n_left) {
  const int64_t G = K / GROUP;
  VF tot[MR][NP][HALVES];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < HALVES; ++h) tot[r][p][h] = fzero();
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      if constexpr (PREFETCH > 0) {  // the panel's bytes PREFETCH groups ahead (see PREFETCH)
        const char* ahead = reinterpret_cast<const char*>(q + p * panel_stride + (g + PREFETCH) * Q::GROUP_BYTES);
#pragma GCC unroll 8
        for (int l = 0; l < Q::GROUP_BYTES; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(scale + p * G * W + (g + PREFETCH) * W), _MM_HINT_T0);
        if constexpr (Q::HAS_MIN)
          _mm_prefetch(reinterpret_cast<const char*>(minv + p * G * W + (g + PREFETCH) * W), _MM_HINT_T0);
      }
      VI acc[MR][HALVES], wsum[HALVES];
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HALVES; ++h) acc[r][h] = izero();
      for (int h = 0; h < HALVES; ++h) wsum[h] = izero();
      Q::template group<MR>(q + p * panel_stride + g * Q::GROUP_BYTES, xq + g * GROUP, K, acc, wsum);
#pragma GCC unroll 2
      for (int h = 0; h < HALVES; ++h) {
        const VF s = fload(scale + p * G * W + g * W + h * LANES);
        const VF m = Q::HAS_MIN ? fload(minv + p * G * W + g * W + h * LANES) : fzero();
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
          const VI a = Q::OFFSET ? isub(acc[r][h], shl7(wsum[h])) : acc[r][h];
          tot[r][p][h] = ffma(tofloat(a), fmul(s, fbcast(dx + r * G + g)), tot[r][p][h]);
          if constexpr (Q::HAS_MIN) tot[r][p][h] = ffma(m, fbcast(xs + r * G + g), tot[r][p][h]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) {
      const int64_t left = n_left - p * W;
      if (left <= 0) break;
      const int n = static_cast<int>(left < W ? left : W);
      fstore(y + r * ldy + p * W, tot[r][p], bias ? bias + p * W : nullptr, n);
    }
}

template <class Q, class S, int MR>
void rows_pass(const uint8_t* xq, int64_t K, const float* dx, const float* xs, const uint8_t* q, const S* scale,
               const S* minv, int64_t stride, float* y, int64_t ldy, const float* bias, int64_t n_left,
               int64_t rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_pass<Q, S, MR - 1>(xq, K, dx, xs, q, scale, minv, stride, y, ldy, bias, n_left, rows);
  }
  tile<Q, S, MR, 1>(xq, K, dx, xs, q, scale, minv, stride, y, ldy, bias, n_left);
}

// Rows [r0, r1) of x as int8 codes (or codes + 128), per group d and d * sum(q). The fp32 operations of
// quant_gemm.py's reference, in 8-lane AVX2 in both builds: |x|, max (exact in any order), d = amax / 127 and
// 1 / d as scalars, x * (1 / d), rounded half to even (like torch.round), clamped; the code sum is exact.
void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K, bool offset, uint8_t* xq, float* dx,
                   float* xs) {
  const int64_t G = K / GROUP;
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + r * K + g * GROUP;
      __m256 vals[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        vals[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, vals[i]));  // a NaN lane is dropped, as fmaxf does
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      float amax = 0.f;
      for (float l : lanes) amax = fmaxf(amax, l);
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m256 scale = _mm256_set1_ps(id);
      __m256i sum = _mm256_setzero_si256(), codes[4];
      for (int i = 0; i < 4; ++i) {
        __m256 t = _mm256_round_ps(_mm256_mul_ps(vals[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q));  // NaN -> 0, never an undefined conversion
        codes[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
        sum = _mm256_add_epi32(sum, codes[i]);
      }
      // int32 x 32 -> int8 x 32 in input order (packs interleave 128-bit lanes; the permute undoes it).
      const __m256i w01 = _mm256_packs_epi32(codes[0], codes[1]), w23 = _mm256_packs_epi32(codes[2], codes[3]);
      __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      if (offset) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + g * GROUP), bytes);
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
      int total = 0;
      for (int p : parts) total += p;
      dx[r * G + g] = d;
      xs[r * G + g] = d * static_cast<float>(total);
    }
}

template <class Q, class S>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const S* scale, const S* minv,
            int64_t N, const float* bias, float* y, int nthreads) {
  const int64_t G = K / GROUP;
  const int64_t P = (N + W - 1) / W;
  const int64_t stride = G * Q::GROUP_BYTES;  // one panel's bytes
  std::vector<uint8_t> codes(M * K);
  std::vector<float> dx(M * G), xs(M * G);
  const int64_t per = (M + nthreads - 1) / nthreads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && M * K >= 16384)
  for (int64_t t = 0; t < nthreads; ++t) {
    const int64_t r0 = t * per, r1 = r0 + per < M ? r0 + per : M;
    if (r0 < r1) quantize_rows(x, r0, r1, K, Q::OFFSET, codes.data(), dx.data(), xs.data());
  }
  const uint8_t* xq = codes.data();
  // As in quant_gemm.cpp: rows in blocks of ROW_BLOCK, within a block balanced passes of up to MAX_ROWS over
  // each panel (the panel's bytes come from memory once per block, then from L1). One row takes this path too:
  // a one-row tile over 4 panels at once (12 weight / scale / min streams per thread) ran the model's 120
  // linears from memory at 15 GB/s, one panel per tile at 22 (4.1 -> 2.9 ms, dev/LOG.md session 40).
  for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
    const int64_t rb = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
    const int64_t passes = (rb + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t p = 0; p < P; ++p) {
      int64_t r = r0;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t rows = (r0 + rb - r + passes - pass - 1) / (passes - pass);
        rows_pass<Q, S, MAX_ROWS>(xq + r * K, K, dx.data() + r * G, xs.data() + r * G, q + p * stride,
                               scale + p * G * W, minv ? minv + p * G * W : nullptr, stride, y + r * N + p * W, N,
                               bias ? bias + p * W : nullptr, N - p * W, rows);
        r += rows;
      }
    }
  }
}

}  // namespace

#include "quant_abi.h"

extern "C" {

// The activation quantization alone (tests): codes [M, K] int8, d and d * sum(codes) [M, K/32].
void byblock_quantize_activations(const float* x, int64_t M, int64_t K, int8_t* codes, float* d, float* dsum) {
  quantize_rows(x, 0, M, K, false, reinterpret_cast<uint8_t*>(codes), d, dsum);
}

}  // extern "C"
