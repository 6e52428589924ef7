#!/usr/bin/env bash
# GPU check of branch flash (issue 25 item 2: attention as one fused kernel).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Under 3 minutes.
set -u
echo "== commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%H:%M:%S) UTC"
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null || true
LOG=$(mktemp)
echo "== GPU tests: tests/plugin_cuda/test_flash_attention.py"
timeout 200 python3 -m pytest tests/plugin_cuda/test_flash_attention.py -m gpu -q -s --timeout=120 -rfE \
    -p no:cacheprovider >"$LOG" 2>&1
echo "(exit $?)"
grep -E "max abs error" "$LOG" | sed "s/^[.FEs]*//" | head -150
grep -vE "max abs error" "$LOG" | grep -v "^$" | tail -60
echo "== bench/attention_gpu.py (B=8 H=12 D=64)"
timeout 120 python3 bench/attention_gpu.py --seqs 128 512 1024 2048 2>&1 | tail -120
timeout 60 python3 bench/attention_gpu.py --seqs 2048 --causal --dtypes float16 float32 2>&1 | tail -20
echo "== planted bugs: each must make the tests fail"
plant() {  # file, sed expression, -k selection
  cp "$1" "$LOG.orig"
  sed -i "$2" "$1"
  if cmp -s "$1" "$LOG.orig"; then echo "plant '$2': did not apply"; return; fi
  timeout 120 python3 -m pytest tests/plugin_cuda/test_flash_attention.py -m gpu -q -p no:cacheprovider -k "$3" \
      2>&1 | tail -1 | sed "s|^|plant '$2': |"
  cp "$LOG.orig" "$1"
}
plant plugin_cuda/kernels/flash_source.py 's/qs, q0, sq, scale);/qs, q0, sq, scale * 1.01f);/' \
    "sdpa and float32-simt and (gqa-bcast-mask or bool-mask)"
plant plugin_cuda/kernels/flash_source.py 's/(fa_i64)min(i, sq - 1) \* mi;/(fa_i64)min(i + 1, sq - 1) * mi;/' \
    "sdpa and float32-simt and (gqa-bcast-mask or bool-mask)"
plant plugin_cuda/kernels/flash_source.py 's/float val = s\[n\]\[x\] \* scale;/float val = s[n][x] * scale * 1.02f;/' \
    "sdpa and float16-mma and (gqa-bcast-mask or 4d-plain)"
echo "== done $(date -u +%H:%M:%S) UTC"
