"""Fixtures for the CUDA plugin tests: GPU tests skip with a stated reason where there is no GPU."""

from __future__ import annotations

import contextlib

import pytest


def pytest_configure(config):
    # Declared here too so that this directory runs without warnings on its own; registering a
    # marker twice is harmless.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (CuPy and at least one GPU)")


@pytest.fixture(scope="session")
def cp():
    """The cupy module, or a skip: 'no CUDA device: cupy not importable / no GPU'."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install raising anything
        pytest.skip(f"no CUDA device: cupy not importable ({type(e).__name__}: {e})")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError when there is no driver or no device
        pytest.skip(f"no CUDA device: no GPU ({type(e).__name__}: {e})")
    if count == 0:
        pytest.skip("no CUDA device: no GPU (cupy.cuda.runtime.getDeviceCount() == 0)")
    return cupy


@pytest.fixture
def cublas_handle(cp):
    """A CublasHandle (TF32 on) bound to the current stream, closed after the test."""
    from plugin_cuda.device.cublas import CublasHandle

    handle = CublasHandle(cp.cuda.get_current_stream().ptr)
    yield handle
    handle.close()


@pytest.fixture
def cublas_handle_fp32(cp):
    """A CublasHandle with TF32 off (plain FP32 accumulate), for tight float32 comparisons."""
    from plugin_cuda.device.cublas import CublasHandle

    handle = CublasHandle(cp.cuda.get_current_stream().ptr, use_tf32=False)
    yield handle
    handle.close()


@pytest.fixture(autouse=True)
def close_sessions(monkeypatch):
    """Close every InferenceSession a test made, while the test's locals (a caller's CUDA stream
    borrowed by a session, bound buffers) are still alive, even when the test failed."""
    from host.runtime import session as session_module

    made = []
    original = session_module.InferenceSession.__init__

    def tracking_init(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(session_module.InferenceSession, "__init__", tracking_init)
    yield
    for s in reversed(made):
        with contextlib.suppress(Exception):
            s.close()


@pytest.fixture(scope="module")
def genv(cp, cuda_plugin_path):
    """An Environment with the CUDA plugin registered (skips without a GPU, through `cp`)."""
    import gc

    import host

    env = host.Environment()
    env.register_plugin("cuda", cuda_plugin_path)
    yield env
    gc.collect()
    with contextlib.suppress(host.PluginLoadError):  # a failed test's traceback may still hold a session
        env.close()
