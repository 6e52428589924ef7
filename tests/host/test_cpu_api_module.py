"""The CPU kernels' cffi API-mode module (build_info.compile_api_module): what load() opens when build.py
made it, the same results as the library through ABI mode, and the checks that keep a stale one out."""

from __future__ import annotations

import numpy as np
import pytest

from host.cpu_ep import native
from host.cpu_ep.native import build_info

F32 = np.float32


@pytest.fixture(scope="module")
def libs():
    """(the API module's lib, the library opened through ABI mode), or a failure saying what is missing."""
    if native.LIB is None or native.API_MODULE is None:
        pytest.fail(f"build.py makes the API module beside the library; loaded: {native.LOADED_FROM}, "
                    f"API module: {native.API_MODULE}, error: {native.LOAD_ERROR}")
    abi = native.load(native.LOADED_FROM)  # an explicit path opens the library itself
    native.load()  # back to the default (the module)
    assert abi is not None and abi is not native.LIB
    return native.LIB, abi


def test_load_opens_the_api_module_beside_the_library(libs):
    api, abi = libs
    assert native.API_MODULE == build_info.api_module_path(native.LOADED_FROM)
    assert type(api).__name__ == "Lib" and type(abi).__name__ != "Lib"  # cffi's compiled module vs dlopen
    assert native.ffi.string(api.ep_source_hash()).decode() == native.source_hash()


def _gemm(lib, a, b, bias, prog):
    y = np.empty((a.shape[0], b.shape[1]), F32)
    lib.ep_gemm(native.ptr(a), native.NULL, native.ptr(b), native.ptr(bias), 1, native.ptr(y), a.shape[0], a.shape[1],
                b.shape[1], prog, native.NULL, 0.0, 0.0)
    return y


def test_the_module_computes_what_the_library_does(libs):
    api, abi = libs
    rng = np.random.default_rng(3)
    a, b, bias = rng.standard_normal((16, 40)).astype(F32), rng.standard_normal((40, 70)).astype(F32), \
        rng.standard_normal(70).astype(F32)
    prog = native.program([native.GELU])
    got = _gemm(api, a, b, bias, prog)
    np.testing.assert_array_equal(got, _gemm(abi, a, b, bias, prog))
    x = a @ b + bias
    ref = 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_a_conv_geometry_crosses_to_both(libs):
    """The geometry is an int[14] of the loader's FFI: the module's functions take it as the library's do."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((3, 6, 6)).astype(F32), rng.standard_normal((3, 1, 3, 3)).astype(F32)
    geom = native.conv_geometry(C=3, H=6, W=6, M=3, KH=3, KW=3, SH=1, SW=1, PH=0, PW=0, DH=1, DW=1, OH=4, OW=4)
    outs = []
    for lib in libs:
        y = np.empty((3, 4, 4), F32)
        assert lib.ep_depthwise2d(native.ptr(x), native.ptr(w), native.NULL, native.ptr(y), geom, 0, native.NULL,
                                  0.0, 0.0) == 0
        outs.append(y)
    ref = np.array([[[np.sum(x[c, i:i + 3, j:j + 3] * w[c, 0]) for j in range(4)] for i in range(4)] for c in range(3)])
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_module_of_other_declarations_is_not_opened(libs, monkeypatch):
    """Its wrappers convert arguments as the declarations it was built with say: after the CDEF changed, the
    loader takes the library (ABI mode, which reads the CDEF of now) instead."""
    path = native.API_MODULE
    monkeypatch.setattr(build_info, "cdef_hash", lambda cdef: "0" * 16)
    lib, error = native._open_api(path)
    assert lib is None and error == (f"{path} was built from other declarations: reinstall ephost (`pip install .` "
                                      f"compiles them), or run `ephost build` or `python build.py`")
    lib = native.load()
    assert type(lib).__name__ != "Lib" and native.API_MODULE is None and native.LOADED_FROM in native.candidates()
    monkeypatch.undo()
    assert native.load() is not None and native.API_MODULE == path


def test_a_plain_library_earlier_in_the_search_does_not_hide_the_module(libs, monkeypatch, tmp_path):
    """An editable install compiles the plain library into the package, which load() searches before
    build/lib: the API module beside build/lib's library still wins (CI's clean clone found the package's
    library first and lost the module)."""
    native.load()
    plain, module = tmp_path / build_info.LIB_NAME, native.API_MODULE
    plain.write_bytes(native.LOADED_FROM.read_bytes())
    monkeypatch.setattr(native, "candidates", lambda: [plain, module.with_name(build_info.LIB_NAME)])
    assert type(native.load()).__name__ == "Lib" and native.API_MODULE == module
    monkeypatch.setattr(native, "candidates", lambda: [plain])
    assert type(native.load()).__name__ != "Lib" and native.API_MODULE is None and native.LOADED_FROM == plain
    monkeypatch.undo()
    assert native.load() is not None and native.API_MODULE == module
