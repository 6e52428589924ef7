#!/usr/bin/env bash
# ctx29b (issue 29): loading a saved CUDA context fast, and run 1 as fast as run 100.
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Under 4 minutes.
set -u
cd "$(dirname "$0")"
git log -1 --format='commit %h %s' 2>/dev/null
timeout 70 python3 -m pytest tests/plugin_cuda/test_first_run_gpu.py tests/plugin_cuda/test_epcontext.py -m gpu -q -x -s \
  --timeout=120 -p no:cacheprovider 2>&1 | grep -v "W:onnxruntime" | tail -40
# Creation from a context and run 1 against run 100, with where creation and run 1 spend their time.
EPHOST_BENCH_PROFILE=1 EPHOST_BENCH_PROFILE_ROWS=28 timeout 165 python3 bench/creation_gpu.py resnet50 bert --modes save context --budget 150 2>&1 \
  | grep -v "^\s*$" | tail -400
