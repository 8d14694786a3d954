#!/usr/bin/env bash
# Stem's attention-only measurement on a lent GPU (an H200 through the `device` tool), in under 5 minutes.
#
#   bash benchmarks/stem_gpu.sh            # from the repository root on the GPU machine
#
# The GPU machine reaches no network; its image already holds a CUDA PyTorch (2.11+), so byblock runs from the
# source tree (PYTHONPATH=src, nothing installed). It runs the attention-only part of benchmarks/stem_ttft.py on
# cuda: SDPA (flash) vs Stem scoring + flex_attention block-sparse kernel at 8K–128K tokens, sparsity 0.75 and
# 0.9, SmolLM2's head shape and a 32-head × 128 shape. Output: the markdown tables on stdout and in
# $OUT/stem-gpu.md when $OUT is set. Not run yet: no session so far has been lent a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
for shape in "9 64" "32 128"; do
  set -- $shape
  timeout 140 python3 benchmarks/stem_ttft.py --device cuda --heads "$1" --head-dim "$2" --lengths "" \
      --attn-lengths 8192,32768,131072 --sparsities 0.75,0.9 --repeats 5 | tee -a "${OUT:-/tmp}/stem-gpu.md"
done
