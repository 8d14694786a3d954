// The C ABI of the two quantized-linear kernels (quant_gemm.cpp: fp32 activations; quant_dot.cpp: int8
// activations), shared so both libraries export the same functions with the same arguments. Included at the end
// of each source, after its `linear<Q, S>` template and its Int4 / Int8 group types.
//
// x: [M, K] fp32 contiguous (K % 32 == 0); q: [P, K/32, 4, 64] bytes (int4) or [P, K/32, 8, 64] int8 (int8);
// scale (and minv for int4): [P, K/32, 16], fp32 or, with `half`, fp16 (converted exactly in registers);
// y: [M, N].
#pragma once
#include <stdint.h>

namespace {

// The scale dtype resolved once per call: the same template over fp16 or fp32 scale pointers.
template <class Q>
void linear_any(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* scale, const void* minv,
                int64_t N, const float* bias, float* y, int nthreads, int half) {
  if (half)
    linear<Q>(x, M, K, q, static_cast<const uint16_t*>(scale), static_cast<const uint16_t*>(minv), N, bias, y,
              nthreads);
  else
    linear<Q>(x, M, K, q, static_cast<const float*>(scale), static_cast<const float*>(minv), N, bias, y, nthreads);
}

}  // namespace

extern "C" {

int byblock_quant_group() { return GROUP; }
int byblock_quant_panel() { return W; }

void byblock_int4_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* scale,
                         const void* minv, int64_t N, const float* bias, float* y, int nthreads, int half) {
  linear_any<Int4>(x, M, K, q, scale, minv, N, bias, y, nthreads, half);
}

void byblock_int8_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const void* scale, int64_t N,
                         const float* bias, float* y, int nthreads, int half) {
  linear_any<Int8>(x, M, K, q, scale, nullptr, N, bias, y, nthreads, half);
}

}  // extern "C"
