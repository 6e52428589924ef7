#!/usr/bin/env bash
# GPU check of branch int8cuda (issue 27 item 1, CUDA EP part: quantized kernels on cuBLASLt int8 GEMMs).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Under 2 minutes.
set -u
echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%H:%M:%S) UTC"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null || true
echo "== CPU side: claims, NumPy mirrors of the zero-point math"
timeout 60 python3 -m pytest tests/plugin_cuda/test_quant_cpu.py -q -p no:cacheprovider 2>&1 | tail -3
echo "== GPU: tests/plugin_cuda/test_quant_gpu.py (every op against onnxruntime CPU, quantized models, capture)"
timeout 100 python3 -m pytest tests/plugin_cuda/test_quant_gpu.py -m gpu -q -s -rfE --tb=short -p no:cacheprovider \
    --timeout=120 2>&1 | grep -v "^$\|WARNING:root\|Please use QuantFormat" | tail -80
echo "== bench/quant_gpu.py: int8 GEMM vs float32; the quantized models on the CUDA EP vs onnxruntime CPU"
timeout 60 python3 -m bench.quant_gpu --sizes 256,1024,2048,4096 --iters 10 --models 2>&1 \
    | grep -v "WARNING:root\|Please use QuantFormat" | tail -16
echo "== planted bug: q_acc without its K * za * zb term (the MatMulInteger / QLinearMatMul tests must fail)"
cp plugin_cuda/kernels/quant_gemm.py /tmp/quant_gemm.py.orig
sed -i 's/return p - zb \* ra - za \* cb + k \* za \* zb;/return p - zb * ra - za * cb;/' plugin_cuda/kernels/quant_gemm.py
grep -c "return p - zb \* ra - za \* cb;" plugin_cuda/kernels/quant_gemm.py
timeout 60 python3 -m pytest tests/plugin_cuda/test_quant_gpu.py -m gpu -q -p no:cacheprovider --timeout=60 \
    -k "matmul_integer_with or qlinear_matmul" 2>&1 | tail -2
cp /tmp/quant_gemm.py.orig plugin_cuda/kernels/quant_gemm.py
echo "== done $(date -u +%H:%M:%S) UTC"
