#!/usr/bin/env bash
# GPU smoke of the half-precision compiled plans (issue 24 item 2), run by the lead on the GPU machine
# from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Prints one line per
# model (plan steps or compiled partitions, max relative error against float32, replay) and the
# pytest summary; under 3 minutes.
set -u
export HALF_PLANS_REPORT=${HALF_PLANS_REPORT:-/tmp/half_plans_report.txt}
rm -f "$HALF_PLANS_REPORT"
git log -1 --format='commit %h %s' 2>/dev/null || true
timeout 170 python3 -m pytest tests/plugin_cuda/test_half_plans.py -m gpu -q --timeout=120 -rfE -p no:cacheprovider 2>&1 | tail -60
rc=${PIPESTATUS[0]}
echo "---- per-model report ----"
cat "$HALF_PLANS_REPORT" 2>/dev/null || echo "(no report lines)"
echo "---- eager ms per run (session.run, NumPy feeds; median of 20): compiled plans vs per-node kernels ----"
timeout 120 python3 - <<'PY' 2>&1 | grep -v Warning | tail -12
import time
import numpy as np
from host.precision import convert_precision
from host.runtime.session import InferenceSession
from tests.models import load
from tests.plugin_cuda.test_half_plans import half_dtype, rounded
import onnx

import build
import host

env = host.Environment()
spec = build.PYTHON_PLUGINS["cuda"]
env.register_plugin("cuda", build.build_python_plugin("cuda", max(spec.versions)))
for name in ("bert_torchscript", "llama_dynamo"):
    path, feeds, _ = load(name)
    for precision in ("fp16", "bf16"):
        data = convert_precision(onnx.load(str(path)), precision).SerializeToString()
        half, _ = rounded(feeds, half_dtype(precision))
        line = []
        for plan in ("1", "0"):
            s = InferenceSession(data, providers=[("CUDAExecutionProvider", {"compiled_plan": plan})], env=env)
            for _ in range(3):
                s.run(None, half)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                s.run(None, half)
                times.append(time.perf_counter() - t0)
            line.append(f"compiled_plan={plan}: {np.median(times) * 1e3:.2f} ms")
            s.close()
        print(f"{name} {precision} {tuple(feeds[k].shape for k in feeds)}: " + ", ".join(line))
PY
exit "$rc"
