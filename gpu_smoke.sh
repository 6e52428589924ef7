#!/usr/bin/env bash
# GPU checks of the graphshape branch (issue 23 item 3: a CUDA graph per input shape and per bucket).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD (cffi installed).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader || true
export PYTHONUNBUFFERED=1
python3 -m pytest tests/plugin_cuda/test_shape_graphs_gpu.py tests/plugin_cuda/test_graphs.py -m gpu -q -rf -s -x \
    --timeout=120 -p no:cacheprovider 2>&1 | tail -40
timeout 150 python3 -m bench.bucket_bench --ep cuda --cuda-graph --batches 100 --max-batch-size 16 --hidden 1024
