#!/usr/bin/env bash
# GPU check of the packaged CUDA plugin (issue 28): compile the package's extensions in place, as an
# editable install does (setup.py: the CPU kernels and plugin_cuda/_ephost_cuda_v<N>_pkg<hash>.so),
# then, with no C compiler reachable (CC points nowhere, an empty cache), a session asking for CUDA
# must load that library (not build one) and match onnxruntime's CPU results.
# Run from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD.
set -euo pipefail
python3 setup.py -q build_ext --inplace 2>&1 | tail -5
ls -l plugin_cuda/_ephost_cuda_v*_pkg*.so
CACHE=$(mktemp -d)
CC=no-such-cc EPHOST_CACHE_DIR="$CACHE" python3 - <<'PY'
import os, numpy as np, onnxruntime as ort
import host
from host.cli import zoo
from host.plugins import builtin
path = builtin.find_builtin_plugin("CUDAExecutionProvider")
print("plugin:", path)
assert path == builtin.packaged_plugin("CUDAExecutionProvider"), path
model = zoo.mlp(layers=2, hidden=64, seed=1).SerializeToString()
x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
sess = host.InferenceSession(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
print("providers:", sess.get_providers())
assert sess.get_providers()[0] == "CUDAExecutionProvider", sess.get_providers()
feeds = {sess.get_inputs()[0].name: x}
want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
assert not [p for p in os.listdir(os.environ["EPHOST_CACHE_DIR"]) if p == "plugins"], "a plugin was built"
print("packaged CUDA plugin: OK")
PY
rm -f plugin_cuda/_ephost_cuda_v*_pkg*.so host/cpu_ep/native/_kernels*.so
