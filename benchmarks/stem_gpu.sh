#!/usr/bin/env bash
# Stem's attention-only measurement on a lent GPU (an H200 through the `device` tool), in under 5 minutes.
#
#   bash benchmarks/stem_gpu.sh            # from the repository root on the GPU machine
#
# It makes a CUDA venv (the project's Makefile installs the CPU torch), then runs the attention-only part of
# benchmarks/stem_ttft.py on cuda: SDPA (flash) vs Stem scoring + flex_attention block-sparse kernel at
# 8K–128K tokens, sparsity 0.75 and 0.9, SmolLM2's head shape and a 32-head × 128 shape. Output: the markdown
# table on stdout and $OUT/stem-gpu.md when $OUT is set. Not run yet: no session so far has been lent a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv /tmp/gpuvenv
/tmp/gpuvenv/bin/pip install -q "torch>=2.6" "transformers>=5.24,<5.40" safetensors numpy tqdm
/tmp/gpuvenv/bin/pip install -q --no-deps -e .
for shape in "9 64" "32 128"; do
  set -- $shape
  /tmp/gpuvenv/bin/python benchmarks/stem_ttft.py --device cuda --heads "$1" --head-dim "$2" --lengths "" \
      --attn-lengths 8192,32768,131072 --sparsities 0.75,0.9 --repeats 5 | tee -a "${OUT:-/tmp}/stem-gpu.md"
done
