#!/usr/bin/env bash
# GPU checks of the halfcuda branch (issue 24, the per-node path: float16 and bfloat16 on the CUDA
# plugin's kernels). Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD
# (cffi installed). Every step prints and goes on: one failure must not hide the others.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader || true
python3 - <<'PY' || true
import cupy, ml_dtypes, numpy as np
print("cupy", cupy.__version__)
a = cupy.asarray(np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16))
try:
    print("bf16 CAI typestr", a.__cuda_array_interface__["typestr"])
except Exception as e:  # noqa: BLE001
    print("bf16 CAI error", type(e).__name__, e)
print("bf16 exp", cupy.exp(a).dtype, "sum f32", float(a.sum(dtype=cupy.float32)))
PY
echo "== half kernel tests (test_half_kernels.py: Cast, odd sizes, capture, converted transformers)"
timeout 150 python3 -m pytest tests/plugin_cuda/test_half_kernels.py -m gpu -q -rf --timeout=120 -n 8 \
  -p no:cacheprovider 2>&1 | tail -40
echo "== the per-op kernel tests in float16 and bfloat16 (the BOTH parameter)"
timeout 150 python3 -m pytest tests/plugin_cuda/test_kernels.py tests/plugin_cuda/test_kernels_fused.py \
  tests/plugin_cuda/test_kernels_math_logic.py tests/plugin_cuda/test_kernels_data_movement.py \
  -m gpu -k "bf16 or f16" -q -rf --timeout=120 -n 8 -p no:cacheprovider 2>&1 | tail -40
echo "== converted fixtures: assignment, accuracy vs onnxruntime float32, capture"
timeout 90 python3 bench/half_gpu.py check bert_torchscript llama_dynamo vit_dynamo 2>&1 | tail -12
echo "== BERT-base fp16 batch 8 seq 128: ephost per-node vs torch"
timeout 180 python3 bench/half_gpu.py bert --precision fp16 --iters 30 2>&1 | tail -5
