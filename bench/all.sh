#!/usr/bin/env bash
# The GPU benchmarks behind docs/benchmarks.md, in one run on one GPU (PyTorch with CUDA for the
# comparisons): bash bench/all.sh > bench.txt
set -o pipefail
cd "$(dirname "$0")/.."
G="--set d=512 --set seq=256 --set heads=8 --set layers=6 --set batch=16 --set vocab=256"
fb() { local t=$1; shift; timeout "$t" python3 -m flowgrad bench "$@" 2>&1 | grep -v '^\s*$' | grep -v '%|'; }
echo "== tiny_gpt batch 1"; fb 60 --set batch=1 --compare torch --repeats 30
echo "== tiny_gpt batch 32"; fb 60 --compare torch --repeats 30
echo "== gpt_small f32"; fb 120 $G --compare torch --repeats 12
echo "== gpt_small mixed"; fb 90 $G --dtype mixed --compare torch --repeats 12
echo "== gpt2 (GPT-2 124M's shape, batch 8), f32 and mixed against PyTorch"; fb 900 gpt2
echo "== matmul f32, every tile"; fb 90 matmul --all
echo "== matmul f16"; fb 60 matmul --dtype f16
echo "== fusion, gpt_small"; timeout 90 python3 bench/fusion_bench.py --repeats 10 2>&1 | tail -14
echo "== attention"; timeout 120 python3 bench/attention_bench.py 2>&1 | tail -30
echo "== conv"; timeout 90 python3 bench/conv_bench.py 2>&1 | tail -20
