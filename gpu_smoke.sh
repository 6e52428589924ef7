#!/usr/bin/env bash
# GPU checks of branch gpt2part (issue 23: the dynamo GPT-2's computed Reshape targets inside compiled
# partitions). From the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Under 4 minutes.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
echo "== GPU tests: dynamo-form graph and a 2-layer dynamo GPT-2 against onnxruntime, partition count"
timeout 90 python3 -m pytest tests/plugin_cuda/test_dynamo_reshapes_gpu.py -m gpu -q -x --timeout=80 -s \
    -p no:cacheprovider 2>&1 | grep -v "^\[torch.onnx\]\|^\[transformers\]" | tail -12
echo "== bench: GPT-2 small (12 layers) dynamo export, eager and CUDA-graph replay, IOBinding (plan line = partitions)"
timeout 150 python3 bench/dynamic_gpu.py --model gpt2_dynamo --graph --iters 10 --shapes 1x16,8x128,3x50,8x128,1x16 \
    2>&1 | grep -v "^\[torch.onnx\]\|^\[transformers\]\|Warning\|return cls" | tail -10
left=$((230 - SECONDS))  # the whole script stays under 4 minutes
if [ "$left" -gt 20 ]; then
    echo "== regression: symbolic plans on the BERT-like encoder (${left}s left)"
    timeout "$left" python3 -m pytest tests/plugin_cuda/test_dynamic_plans.py -m gpu -q -x --timeout="$left" \
        -p no:cacheprovider 2>&1 | tail -4
fi
echo "== done in ${SECONDS}s"
