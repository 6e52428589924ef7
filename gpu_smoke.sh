#!/usr/bin/env bash
# GPU check of branch flashhalf (issue 24 item 2 / issue 25 item 2: flash attention inside float16 /
# bfloat16 compiled plans). Run from the repo root after `python3 build.py`, with
# PYTHONPATH=/tmp/site:$PWD. Under 4 minutes (each step has its own timeout).
set -u
echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%H:%M:%S) UTC"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null || true
python3 -c "import cupy, onnxruntime; print('cupy', cupy.__version__, 'onnxruntime', onnxruntime.__version__)" 2>&1 | tail -1
export HALF_PLANS_REPORT=/tmp/flashhalf_report.txt
rm -f "$HALF_PLANS_REPORT"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"

echo "== CPU side: tests/plugin_cuda/test_flash_half_plans_cpu.py (choice, wrapper, bf16 steps on the CPU shim)"
timeout 60 $PYTEST tests/plugin_cuda/test_flash_half_plans_cpu.py 2>&1 | tail -4

echo "== GPU: tests/plugin_cuda/test_flash_half_plans.py (BERT/Llama blocks, fp16/bf16, flash vs gemm vs onnxruntime)"
timeout 110 $PYTEST tests/plugin_cuda/test_flash_half_plans.py -m gpu -n 4 --timeout=100 2>&1 | tail -40
echo "-- report (max |diff| / max |ref|):"
sort "$HALF_PLANS_REPORT" 2>/dev/null | grep "^flash-half"
rm -f "$HALF_PLANS_REPORT"

echo "== GPU: the existing test_flash_attention.py and test_half_plans.py (half plans now take flash under auto)"
timeout 130 $PYTEST tests/plugin_cuda/test_flash_attention.py tests/plugin_cuda/test_half_plans.py -m gpu -n 6 \
    --timeout=120 2>&1 | tail -25

echo "== bench/flash_half_gpu.py: half plans, flash step vs two-GEMM chain (BERT-base-like b8, Llama-like b4)"
timeout 60 python3 -m bench.flash_half_gpu --seqs 128 512 --iters 30 2>&1 | tail -10

echo "== planted bug: the half mask read as float32 (the BERT flash-vs-gemm GPU test must fail)"
cp plugin_cuda/plan/flash_step.py /tmp/flash_step.py.orig
sed -i 's/mask_kind = MASK_KINDS\[prog.values\[op.inputs\[3\]\].dtype or F32\] if has_mask else 0/mask_kind = 2 if has_mask else 0/' \
    plugin_cuda/plan/flash_step.py
grep -c "mask_kind = 2 if has_mask" plugin_cuda/plan/flash_step.py
timeout 50 $PYTEST tests/plugin_cuda/test_flash_half_plans.py -m gpu -n 2 --timeout=45 -k "plan_flash and bert" 2>&1 | tail -2
cp /tmp/flash_step.py.orig plugin_cuda/plan/flash_step.py
echo "== done $(date -u +%H:%M:%S) UTC"
