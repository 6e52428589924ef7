"""Lifetimes on the GPU (marked gpu: the lead runs them on the device machine).

1,000 CUDA sessions created, run and closed leave device memory flat; CUDA sessions and device
outputs still referenced at interpreter exit are released in order and silently (the reported
"EpAllocator.Free called with an unknown EpAllocator pointer" lines, one per buffer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import build
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.hostile.driver import MAIN_MODEL, SHAPE, options

pytestmark = pytest.mark.gpu


def _cuda_env(cuda_plugin_path) -> Environment:
    env = Environment()
    env.register_plugin("cuda", cuda_plugin_path)
    if not env.plugin("cuda").factories[0].devices:
        env.close()
        pytest.skip("no CUDA device: the CUDA plugin reports none")
    return env


@pytest.mark.device_memory
def test_thousand_cuda_sessions_flat_device_memory(cuda_plugin_path):
    env = _cuda_env(cuda_plugin_path)
    import cupy  # present wherever the CUDA plugin reports a device
    x = {"X": np.linspace(-1, 1, 6, dtype=np.float32).reshape(SHAPE)}
    try:
        for _ in range(20):  # warm-up: pools, cuBLAS handles, kernel caches
            with InferenceSession(MAIN_MODEL, options(), providers=["CUDAExecutionProvider"], env=env) as s:
                s.run(None, x)
        cupy.cuda.runtime.deviceSynchronize()
        free_before = cupy.cuda.runtime.memGetInfo()[0]
        for _ in range(1000):
            with InferenceSession(MAIN_MODEL, options(), providers=["CUDAExecutionProvider"], env=env) as s:
                y = s.run(None, x)[0]
        cupy.cuda.runtime.deviceSynchronize()
        free_after = cupy.cuda.runtime.memGetInfo()[0]
        np.testing.assert_allclose(y, np.maximum(2 * x["X"], 0) * 2, rtol=1e-6)
        assert env.sessions() == []
    finally:
        env.close()
    grown = free_before - free_after
    print(f"\n1000 CUDA sessions: device memory in use grew by {grown / 2**20:.1f} MiB")
    assert grown < 64 << 20, f"device memory grew by {grown} bytes over 1,000 sessions"


def test_exit_with_unclosed_cuda_sessions_is_silent(cuda_plugin_path):
    env = _cuda_env(cuda_plugin_path)
    env.close()
    code = textwrap.dedent(f"""
        import numpy as np
        from host.plugins.environment import Environment
        from host.runtime.session import InferenceSession
        from tests.hostile.driver import MAIN_MODEL, GRAPH_MODEL, options
        env = Environment()
        env.register_plugin("cuda", {str(cuda_plugin_path)!r})
        keep = []
        for model in (MAIN_MODEL, GRAPH_MODEL):
            s = InferenceSession(model, options(), providers=["CUDAExecutionProvider"], env=env)
            b = s.io_binding()
            b.bind_input("X", np.ones((2, 3), np.float32))
            b.bind_output("Y")  # on the device, kept past exit
            s.run_with_iobinding(b)
            keep += [s, b, b.get_outputs()[0]]
        print("ran")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=build.ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(build.ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran\n"
    assert "unknown EpAllocator pointer" not in proc.stderr
    assert proc.stderr == ""
