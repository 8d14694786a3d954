// Attention for decode and verify rows, one (batch, head, query row) at a time over exactly its visible keys:
// out = softmax(scale * q K_vis^T) V_vis, with every reduction in an order fixed by the visible keys alone.
//
// Why: speculative decoding is lossless only if a verify forward gives each row bitwise what a plain decode
// step gives it. Torch's CPU SDPA blocks a call's query rows and keys by the call's shape, and a row's masked
// keys still enter its sums as zeros, so a row verified among k others and the same row decoded alone round
// differently (~1e-7 in the attention output). In fp32 with float activations that almost never flips a token;
// with int8 activations (quant_dot.cpp) such a difference can move a value across a rounding boundary of its
// group's quantization and change the logits by ~0.5: speculative output then differs from plain output on most
// prompts. Here a row's result depends only on q and its visible keys in slot order: decode (one row, all keys),
// a chain verify (causal rows) and a tree verify (mask rows: the past plus the row's ancestors, in slot order,
// which is the accepted path's order) compute the same bits. Masked keys are skipped, never summed as zeros.
//
// Per row: scores s_i = scale * dot(q, k_i) (8-lane FMAs over the head dim, one fixed horizontal sum), the
// exact max m, p_i = exp(s_i - m) by one vector exp (every element through the same code, the tail padded),
// l = sum p_i in 8 lanes by i mod 8 then one fixed horizontal sum, out = (sum_i p_i v_i) * (1 / l) with each
// output element accumulated over i in order. Compiled with -ffp-contract=off so the scalar tails never fuse.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  if (i + 8 <= d) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    i += 8;
  }
  float s = hsum8(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// hsum8 of four keys' lane sums side by side (dot4's last step): out[k] = hsum8(v_k), bitwise.
inline void finish4(__m256 v0, __m256 v1, __m256 v2, __m256 v3, float* out) {
  // u_k = v_k[0:4] + v_k[4:8]: keys 0 | 1 and 2 | 3 in the two 128-bit lanes
  const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
  const __m256 h = _mm256_hadd_ps(u01, u23);  // lane 0: u0 pairs, u2 pairs; lane 1: u1 pairs, u3 pairs
  const __m256 r = _mm256_hadd_ps(h, h);      // lane 0: key 0, key 2; lane 1: key 1, key 3
  alignas(32) float t[8];
  _mm256_store_ps(t, r);
  out[0] = t[0];
  out[1] = t[4];
  out[2] = t[1];
  out[3] = t[5];
}

// dot() of one q with four keys at once, bitwise dot()'s four results (D a multiple of 8): the same FMAs per
// key, and hsum8's additions ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)) done for the four keys side by
// side (lane halves added, then two horizontal pair-adds), so the shuffles are shared instead of serialised.
inline void dot4(const float* a, const float* b0, const float* b1, const float* b2, const float* b3, int64_t d,
                 float* out) {
  __m256 x0 = _mm256_setzero_ps(), y0 = _mm256_setzero_ps(), x1 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps();
  __m256 x2 = _mm256_setzero_ps(), y2 = _mm256_setzero_ps(), x3 = _mm256_setzero_ps(), y3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 lo = _mm256_loadu_ps(a + i), hi = _mm256_loadu_ps(a + i + 8);
    x0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b0 + i), x0);
    y0 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(b0 + i + 8), y0);
    x1 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b1 + i), x1);
    y1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(b1 + i + 8), y1);
    x2 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b2 + i), x2);
    y2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(b2 + i + 8), y2);
    x3 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b3 + i), x3);
    y3 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(b3 + i + 8), y3);
  }
  if (i + 8 <= d) {
    const __m256 lo = _mm256_loadu_ps(a + i);
    x0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b0 + i), x0);
    x1 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b1 + i), x1);
    x2 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b2 + i), x2);
    x3 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(b3 + i), x3);
  }
  finish4(_mm256_add_ps(x0, y0), _mm256_add_ps(x1, y1), _mm256_add_ps(x2, y2), _mm256_add_ps(x3, y3), out);
}

#ifdef __AVX512F__
// The AVX-512 build (D a multiple of 32): one 16-lane register holds what the AVX2 code keeps in two 8-lane ones
// (lanes 0-7 its first, 8-15 its second), so every lane's FMA sequence, and the folds after, are the AVX2 code's:
// both builds give the same bits, with half the instructions.
inline __m256 fold(__m512 z) {  // lanes 0-7 + lanes 8-15: the AVX2 code's acc0 + acc1
  return _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
}

inline float dot16(const float* a, const float* b, int64_t d) {  // dot(), d % 16 == 0
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return hsum8(fold(acc));
}
#endif

// Cephes' expf on 8 lanes (~1 ulp on the range softmax uses: x <= 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

constexpr int CHUNK = 32;  // output elements accumulated in registers per pass over the keys

// A row's visible keys into idx, in slot order; returns how many. row: its uint8 key-set row over S slots, or
// null for causal rows, which see slots 0 .. causal - 1.
inline int64_t visible_keys(const uint8_t* row, int64_t S, int64_t causal, int64_t* idx) {
  int64_t n = 0;
  if (row == nullptr) {
    for (; n < causal; ++n) idx[n] = n;
    return n;
  }
  for (int64_t j = 0; j < S; ++j)
    if (row[j]) idx[n++] = j;
  return n;
}

// exp(p_i - m) in place for the n scores of a row whose max is m (8 lanes, the tail padded, then zeroed),
// returns 1 / sum_i p_i (the sum in 8 lanes by i mod 8, then one fixed horizontal sum). p: n + 8 floats.
inline float softmax_weights(float* p, int64_t n, float m) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t i = n; i < padded; ++i) p[i] = m;
  const __m256 vm = _mm256_set1_ps(m);
  __m256 lsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&p[i]), vm));
    _mm256_storeu_ps(&p[i], e);
  }
  for (int64_t i = n; i < padded; ++i) p[i] = 0.0f;
  for (int64_t i = 0; i < padded; i += 8) lsum = _mm256_add_ps(lsum, _mm256_loadu_ps(&p[i]));
  return 1.0f / hsum8(lsum);
}

// One query row over its n visible keys idx[0..n) (slot order) of one KV head: o = softmax(scale q K^T) V.
// p: scratch of at least n + 8 floats. Every caller runs this same code (or attend_heads, its bitwise twin), so a
// row's bits depend only on q and its visible keys, never on which entry point or batch it came through.
inline void attend_row(const float* qr, const float* kr, const float* vr, int64_t ks, int64_t vs,
                       const int64_t* idx, int64_t n, int64_t D, float scale, float* p, float* o) {
  if (n <= 0) {  // no visible key: zeros (SDPA would give NaN; no caller builds such a row)
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    return;
  }
  float m = -INFINITY;
  int64_t scored = 0;
  if (D % 8 == 0)
    for (; scored + 4 <= n; scored += 4) {
      const int64_t* k4 = idx + scored;
      dot4(qr, kr + k4[0] * ks, kr + k4[1] * ks, kr + k4[2] * ks, kr + k4[3] * ks, D, &p[scored]);
      for (int64_t j = scored; j < scored + 4; ++j) {
        p[j] *= scale;
        m = p[j] > m ? p[j] : m;
      }
    }
  for (; scored < n; ++scored) {
    p[scored] = dot(qr, kr + idx[scored] * ks, D) * scale;
    m = p[scored] > m ? p[scored] : m;
  }
  const float inv = softmax_weights(p, n, m);
  for (int64_t d0 = 0; d0 < D; d0 += CHUNK) {
    const int64_t w = D - d0 < CHUNK ? D - d0 : CHUNK;
    if (w == CHUNK) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const float* vv = vr + idx[i] * vs + d0;
        const __m256 pi = _mm256_set1_ps(p[i]);
        a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vv), a0);
        a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vv + 8), a1);
        a2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vv + 16), a2);
        a3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vv + 24), a3);
      }
      const __m256 vi = _mm256_set1_ps(inv);
      _mm256_storeu_ps(o + d0, _mm256_mul_ps(a0, vi));
      _mm256_storeu_ps(o + d0 + 8, _mm256_mul_ps(a1, vi));
      _mm256_storeu_ps(o + d0 + 16, _mm256_mul_ps(a2, vi));
      _mm256_storeu_ps(o + d0 + 24, _mm256_mul_ps(a3, vi));
    } else {
      for (int64_t d = d0; d < d0 + w; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) acc += p[i] * vr[idx[i] * vs + d];
        o[d] = acc * inv;
      }
    }
  }
}

constexpr int MAX_GROUP_BLOCK = 4;  // query heads attend_heads takes at once (registers: 4 x 4 accumulators)

#ifdef __AVX512F__
// attend_row for G query heads of one KV head and one row (D a multiple of 32, n > 0), bitwise G calls of it: every
// head's FMA sequences are attend_row's, in 16-lane registers (see fold), but each key and value row is loaded
// once for the G heads, which gives the FMA units G independent chains. One head at a time, the chains over the
// keys are latency-bound (a 64-wide row costs ~4 cycles per key whatever the register width).
// Head g: query q + g * qh, scratch p + g * ps (n + 8 floats), output o + g * oh.
template <int G>
inline void attend_heads(const float* q, int64_t qh, const float* kr, const float* vr, int64_t ks, int64_t vs,
                         const int64_t* idx, int64_t n, int64_t D, float scale, float* p, int64_t ps, float* o,
                         int64_t oh) {
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  int64_t scored = 0;
  for (; scored + 4 <= n; scored += 4) {
    const float* b0 = kr + idx[scored] * ks;
    const float* b1 = kr + idx[scored + 1] * ks;
    const float* b2 = kr + idx[scored + 2] * ks;
    const float* b3 = kr + idx[scored + 3] * ks;
    __m512 z[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) z[g][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      const __m512 k0 = _mm512_loadu_ps(b0 + i), k1 = _mm512_loadu_ps(b1 + i);
      const __m512 k2 = _mm512_loadu_ps(b2 + i), k3 = _mm512_loadu_ps(b3 + i);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 x = _mm512_loadu_ps(q + g * qh + i);
        z[g][0] = _mm512_fmadd_ps(x, k0, z[g][0]);
        z[g][1] = _mm512_fmadd_ps(x, k1, z[g][1]);
        z[g][2] = _mm512_fmadd_ps(x, k2, z[g][2]);
        z[g][3] = _mm512_fmadd_ps(x, k3, z[g][3]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* pg = p + g * ps;
      finish4(fold(z[g][0]), fold(z[g][1]), fold(z[g][2]), fold(z[g][3]), &pg[scored]);
      for (int64_t j = scored; j < scored + 4; ++j) {
        pg[j] *= scale;
        m[g] = pg[j] > m[g] ? pg[j] : m[g];
      }
    }
  }
  for (; scored < n; ++scored)
    for (int g = 0; g < G; ++g) {
      float* pg = p + g * ps;
      pg[scored] = dot16(q + g * qh, kr + idx[scored] * ks, D) * scale;
      m[g] = pg[scored] > m[g] ? pg[scored] : m[g];
    }
  __m512 vi[G];
  for (int g = 0; g < G; ++g) vi[g] = _mm512_set1_ps(softmax_weights(p + g * ps, n, m[g]));
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int w = D - d0 >= 64 ? 4 : 2;  // 64 or 32 elements per pass; each one's FMAs over i in order
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
    if (w == 4)
      for (int64_t i = 0; i < n; ++i) {
        const float* vv = vr + idx[i] * vs + d0;
        const __m512 v0 = _mm512_loadu_ps(vv), v1 = _mm512_loadu_ps(vv + 16);
        const __m512 v2 = _mm512_loadu_ps(vv + 32), v3 = _mm512_loadu_ps(vv + 48);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m512 pi = _mm512_set1_ps(p[g * ps + i]);
          a[g][0] = _mm512_fmadd_ps(pi, v0, a[g][0]);
          a[g][1] = _mm512_fmadd_ps(pi, v1, a[g][1]);
          a[g][2] = _mm512_fmadd_ps(pi, v2, a[g][2]);
          a[g][3] = _mm512_fmadd_ps(pi, v3, a[g][3]);
        }
      }
    else
      for (int64_t i = 0; i < n; ++i) {
        const float* vv = vr + idx[i] * vs + d0;
        const __m512 v0 = _mm512_loadu_ps(vv), v1 = _mm512_loadu_ps(vv + 16);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m512 pi = _mm512_set1_ps(p[g * ps + i]);
          a[g][0] = _mm512_fmadd_ps(pi, v0, a[g][0]);
          a[g][1] = _mm512_fmadd_ps(pi, v1, a[g][1]);
        }
      }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < w; ++c) _mm512_storeu_ps(o + g * oh + d0 + 16 * c, _mm512_mul_ps(a[g][c], vi[g]));
  }
}
#endif

// Every query head of one KV head for one row: heads 0 .. group - 1 at q + g * qh, outputs at o + g * oh, over the
// same visible keys. p: scratch of MAX_GROUP_BLOCK * ps floats, ps >= n + 8.
inline void attend_kv_head(const float* q, int64_t qh, int64_t group, const float* kr, const float* vr, int64_t ks,
                           int64_t vs, const int64_t* idx, int64_t n, int64_t D, float scale, float* p, int64_t ps,
                           float* o, int64_t oh) {
#ifdef __AVX512F__
  if (D % 32 == 0 && n > 0) {
    int64_t g = 0;
    for (; g + MAX_GROUP_BLOCK <= group; g += MAX_GROUP_BLOCK)
      attend_heads<MAX_GROUP_BLOCK>(q + g * qh, qh, kr, vr, ks, vs, idx, n, D, scale, p, ps, o + g * oh, oh);
    const int64_t left = group - g;
    if (left == 3) attend_heads<3>(q + g * qh, qh, kr, vr, ks, vs, idx, n, D, scale, p, ps, o + g * oh, oh);
    if (left == 2) attend_heads<2>(q + g * qh, qh, kr, vr, ks, vs, idx, n, D, scale, p, ps, o + g * oh, oh);
    if (left == 1) attend_heads<1>(q + g * qh, qh, kr, vr, ks, vs, idx, n, D, scale, p, ps, o + g * oh, oh);
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) attend_row(q + g * qh, kr, vr, ks, vs, idx, n, D, scale, p, o + g * oh);
}

}  // namespace

extern "C" {

// q: [B, H, T, D] at strides (qb, qh, qt), unit stride over D; k, v: [B, Hkv, S, D] at strides (kb, kh, ks) and
// (vb, vh, vs); visible: null (causal: row t sees keys 0 .. S - T + t) or uint8 [Bm, Hm, T, S] contiguous, Bm = 1
// or B, Hm = 1 or Hkv (per-KV-head key sets: sparse decode) (nonzero: visible); out: [B, T, H, D] contiguous. H
// must be a multiple of Hkv (grouped-query heads).
void byblock_row_attention(const float* q, int64_t B, int64_t H, int64_t T, int64_t D, int64_t qb, int64_t qh,
                           int64_t qt, const float* k, const float* v, int64_t Hkv, int64_t S, int64_t kb,
                           int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs, const uint8_t* visible,
                           int64_t mask_batches, int64_t mask_heads, float scale, float* out, int threads) {
  const int64_t group = H / Hkv;
  const int64_t items = B * Hkv * T;  // (batch, KV head, row): its query heads share the keys (attend_kv_head)
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(MAX_GROUP_BLOCK * (S + 8));
    std::vector<int64_t> idx(S);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (Hkv * T), kvh = (item / T) % Hkv, t = item % T;
      const float* qr = q + b * qb + kvh * group * qh + t * qt;
      const float* kr = k + b * kb + kvh * kh;
      const float* vr = v + b * vb + kvh * vh;
      float* o = out + ((b * T + t) * H + kvh * group) * D;
      const int64_t mb = mask_batches == 1 ? 0 : b, mh = mask_heads == 1 ? 0 : kvh;
      const uint8_t* row = visible ? visible + ((mb * mask_heads + mh) * T + t) * S : nullptr;
      const int64_t n = visible_keys(row, S, S - T + t + 1, idx.data());
      attend_kv_head(qr, qh, group, kr, vr, ks, vs, idx.data(), n, D, scale, p.data(), S + 8, o, D);
    }
  }
}

// A packed forward's decode / verify segments in one call (kernels/ragged.py): each segment's new K/V rows are
// written into its own cache buffers, then each of its query rows attends over that cache as
// byblock_row_attention would for the segment alone (the same attend_row, the same key sets).
// q: [H, R, D] at strides (qh, qt), the packed rows; knew / vnew: [Hkv, R, D] at strides (nkh, nkt) / (nvh, nvt);
// unit stride over D everywhere. seg: n_seg records of SEG_FIELDS int64:
//   start, end      the segment's packed rows [start, end)
//   past            slots already cached (its new rows go to slots past .. past + end - start)
//   kbuf, vbuf      its cache buffers of this layer: [Hkv, capacity, D] at strides (kh, ks) / (vh, vs)
//   kh, ks, vh, vs
//   mask            0 (causal: row t sees slots 0 .. past + t) or a uint8 [Hm, T, past + T] contiguous key set
//   mask_heads      Hm: 1 or Hkv
// out: [R, H, D] contiguous (rows of other segments left as they are).
constexpr int SEG_FIELDS = 11;

void byblock_packed_row_attention(const float* q, int64_t H, int64_t D, int64_t qh, int64_t qt, const float* knew,
                                  int64_t nkh, int64_t nkt, const float* vnew, int64_t nvh, int64_t nvt,
                                  int64_t Hkv, const int64_t* seg, int64_t n_seg, float scale, float* out,
                                  int threads) {
  const int64_t group = H / Hkv;
  // Jobs: (segment, KV head, a run of its rows). A KV head's keys and values come from memory once per job and
  // stay in that core's caches for the job's other rows, so a segment's rows run together, split only as far as
  // the cores need work (a lone verify segment has Hkv jobs per run of rows). Every row is computed exactly as
  // alone, whatever job holds it.
  int64_t widest = 0, items = 0;
  for (int64_t s = 0; s < n_seg; ++s) {
    const int64_t* f = seg + s * SEG_FIELDS;
    widest = f[2] + f[1] - f[0] > widest ? f[2] + f[1] - f[0] : widest;
    items += Hkv * (f[1] - f[0]);
  }
  const int64_t want = 4 * static_cast<int64_t>(threads > 0 ? threads : 1);  // jobs for balance
  const int64_t run = items > want ? (items + want - 1) / want : 1;          // rows per job, at most
  std::vector<int64_t> jobs;  // (segment, KV head, first row, end row) x n
  for (int64_t s = 0; s < n_seg; ++s) {
    const int64_t* f = seg + s * SEG_FIELDS;
    const int64_t T = f[1] - f[0];
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t0 = 0; t0 < T; t0 += run) jobs.insert(jobs.end(), {s, h, t0, t0 + run < T ? t0 + run : T});
  }
  const int64_t n_jobs = static_cast<int64_t>(jobs.size()) / 4;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < n_seg * Hkv; ++job) {  // the appends: plain copies
      const int64_t* f = seg + (job / Hkv) * SEG_FIELDS;
      const int64_t h = job % Hkv;
      float* kb = reinterpret_cast<float*>(f[3]) + h * f[5] + f[2] * f[6];
      float* vb = reinterpret_cast<float*>(f[4]) + h * f[7] + f[2] * f[8];
      for (int64_t r = f[0]; r < f[1]; ++r) {
        memcpy(kb + (r - f[0]) * f[6], knew + h * nkh + r * nkt, D * sizeof(float));
        memcpy(vb + (r - f[0]) * f[8], vnew + h * nvh + r * nvt, D * sizeof(float));
      }
    }
    std::vector<float> p(MAX_GROUP_BLOCK * (widest + 8));
    std::vector<int64_t> idx(widest);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n_jobs; ++j) {
      const int64_t* job = jobs.data() + 4 * j;
      const int64_t* f = seg + job[0] * SEG_FIELDS;
      const int64_t T = f[1] - f[0], S = f[2] + T, kvh = job[1];
      const int64_t mh = f[10] == 1 ? 0 : kvh;
      for (int64_t t = job[2]; t < job[3]; ++t) {
        const uint8_t* row = f[9] ? reinterpret_cast<const uint8_t*>(f[9]) + (mh * T + t) * S : nullptr;
        const int64_t n = visible_keys(row, S, f[2] + t + 1, idx.data());
        attend_kv_head(q + kvh * group * qh + (f[0] + t) * qt, qh, group,
                       reinterpret_cast<const float*>(f[3]) + kvh * f[5],
                       reinterpret_cast<const float*>(f[4]) + kvh * f[7], f[6], f[8], idx.data(), n, D, scale,
                       p.data(), widest + 8, out + ((f[0] + t) * H + kvh * group) * D, D);
      }
    }
  }
}

}  // extern "C"
