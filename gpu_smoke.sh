#!/usr/bin/env bash
# GPU checks of the rnncuda branch (issue 26: LSTM/GRU/RNN and control flow on the CUDA EP).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader || true
python3 -c "import cupy, torch, onnxruntime; print('cupy', cupy.__version__, 'torch', torch.__version__, 'ort', onnxruntime.__version__)"
log=$(mktemp)
python3 -m pytest tests/plugin_cuda/test_rnn_gpu.py tests/plugin_cuda/test_control_flow_gpu.py -m gpu -q -rf -s \
    --timeout=120 -p no:cacheprovider > "$log" 2>&1
echo "== per case (max abs error vs onnxruntime; where body nodes ran)"
grep -E "max abs error|off the CUDA|body|branches|EP calls" "$log" | cut -c1-400 | head -150
echo "== first error lines"
grep -E "^E " "$log" | cut -c1-300 | head -60
echo "== summary"
sed -n '/short test summary/,$p' "$log" | cut -c1-400 | head -80
tail -1 "$log"
# `ephost ops` with the CUDA EP: the summary line and the recurrent ops it now claims.
python3 -m host.cli ops --ep cuda 2>&1 | grep -E "CUDA|^  (GRU|LSTM|RNN) " | head -8
rm -f "$log"
