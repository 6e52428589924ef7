#!/usr/bin/env bash
# GPU checks of the cudnn branch (issue 25 item 1: convolutions through cuDNN).
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD (cffi installed).
set -u
nvidia-smi --query-gpu=name --format=csv,noheader || true
python3 -c "import cupy, torch, onnxruntime, nvidia.cudnn; print('cupy', cupy.__version__, 'torch', torch.__version__, 'ort', onnxruntime.__version__, 'torch cudnn', torch.backends.cudnn.version())"
export PYTHONUNBUFFERED=1
timeout 60 python3 bench/conv_gpu.py check
python3 -m pytest tests/plugin_cuda/test_cudnn_gpu.py -m gpu -q -rf --timeout=120 -p no:cacheprovider 2>&1 | tail -40
timeout 120 python3 bench/conv_gpu.py resnet50 --iters 20
timeout 80 python3 bench/conv_gpu.py layers --layer "3x3 64 @56" --layer "depthwise 3x3 96 @56" \
    --layer "depthwise 3x3 576 @7 b1" --layer "tiny 3x3 8 @8 b1" --layer "1x1 16->64 @112 b1" \
    --layer "3x3 64 @28 b1" --layer "3x3 64 @56 b1"
