#!/usr/bin/env bash
# GPU check of branch ctx29 (issue 29 item 3: the CUDA plugin's contexts carry the compiled plan).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. About 3 minutes.
set -u
export EPHOST_CACHE_DIR="$(mktemp -d)/cache"  # the tests and the bench start from empty caches
echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%H:%M:%S) UTC"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null || true
echo "== CPU-side tests of the plan format"
timeout 60 python3 -m pytest tests/plugin_cuda/test_saved_plan.py -q -p no:cacheprovider 2>&1 | tail -3
echo "== GPU: tests/plugin_cuda/test_epcontext.py"
timeout 75 python3 -m pytest tests/plugin_cuda/test_epcontext.py -m gpu -q -s -p no:cacheprovider --timeout=120 \
    2>&1 | grep -v "^$" | tail -40
echo "== GPU: what the NVRTC and algorithm caches touch (disk cache, cuDNN choices, per-signature plans)"
timeout 60 python3 -m pytest tests/plugin_cuda/test_plan.py -k "cache" tests/plugin_cuda/test_cudnn_gpu.py \
    "tests/plugin_cuda/test_dynamic_plans.py::test_each_new_shape_gets_a_plan_and_a_shape_seen_before_reuses_it" \
    -m gpu -q -p no:cacheprovider --timeout=120 2>&1 | grep -v "^$" | tail -25
echo "== bench/creation_gpu.py resnet50 (fresh process per measurement)"
EPHOST_BENCH_PROFILE=1 timeout 80 python3 bench/creation_gpu.py resnet50 --budget 70 2>&1 | grep -v Warning | tail -75
echo "== done $(date -u +%H:%M:%S) UTC"
