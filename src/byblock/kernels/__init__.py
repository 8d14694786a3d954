"""Compute kernels chosen by capability: the packed fp32 GEMM, row-invariant bf16, linear layouts, GQA SDPA."""
