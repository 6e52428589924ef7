"""abi/outofline.py: the ABI's declarations as an out-of-line cffi module, written once into the cache and
imported after; the same layouts as the in-line FFI; a damaged or unwritable module falls back to None (the
caller's in-line FFI)."""

from __future__ import annotations

import cffi
import pytest

import abi
from abi import outofline
from abi.header import cdef, header


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path))
    return tmp_path


def _inline(version: int):
    ffi = cffi.FFI()
    ffi.cdef(cdef(version))
    return ffi


@pytest.mark.parametrize("version", list(abi.SUPPORTED_VERSIONS))
def test_the_module_has_the_inline_layouts(cache, version):
    ffi = outofline.load(f"_t_abi_v{version}", cdef(version))
    assert ffi is not None and type(ffi).__module__ == "_cffi_backend"  # parses type strings in C
    inline = _inline(version)
    for s in header().structs:
        if not s.exists_at(version):
            continue
        assert ffi.sizeof(s.name) == inline.sizeof(s.name), s.name
        for m in s.members:
            if m.since <= version:
                assert ffi.offsetof(s.name, m.name) == inline.offsetof(s.name, m.name), (s.name, m.name)


def test_written_once_then_imported(cache):
    text = cdef(abi.ABI_VERSION)
    path = outofline.module_path("_t_once", text)
    assert not path.exists()
    assert outofline.load("_t_once", text) is not None and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert outofline.load("_t_once", text) is not None
    assert path.stat().st_mtime_ns == stamp  # read, not written again
    assert outofline.module_path("_t_once", text + "\n/* another */") != path  # the name carries the declarations


def test_a_damaged_module_gives_none_and_is_written_again(cache):
    text = cdef(abi.ABI_VERSION)
    path = outofline.module_path("_t_damaged", text)
    assert outofline.load("_t_damaged", text) is not None
    path.write_text(path.read_text()[: len(path.read_text()) // 2])  # truncated
    assert outofline.load("_t_damaged", text) is None
    assert not path.exists()
    assert outofline.load("_t_damaged", text) is not None


def test_an_unwritable_cache_gives_none(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(blocker))  # a file where the folder would be
    assert outofline.load("_t_unwritable", cdef(abi.ABI_VERSION)) is None


@pytest.mark.parametrize("switch, want", [("0", "cffi.api"), ("1", "_cffi_backend")])
def test_the_environment_switch(tmp_path, switch, want):
    from tests.abi.conftest import last_json, run_python

    proc = run_python("import abi, json; print(json.dumps({'module': type(abi.ffi_for()).__module__}))",
                      EPHOST_CFFI_MODULES=switch, EPHOST_CACHE_DIR=str(tmp_path))
    assert last_json(proc)["module"] == want


def test_the_package_modules_include_the_cuda_plugins_libraries(tmp_path, monkeypatch):
    """write_package_modules writes the ABI's modules and `extra`'s (the CUDA plugin's library declarations,
    plugin_cuda/device/cdefs.py); each reads back with the in-line FFI's layouts, and the plugin's device
    modules use them (no pycparser at their import)."""
    from plugin_cuda.device import cdefs, cublas, cublaslt, cudnn, driver

    paths = outofline.write_package_modules(tmp_path, cdefs.MODULES)
    names = {p.name.rsplit("_", 1)[0] for p in paths}
    assert names == {*(f"_ephost_abi_v{v}" for v in abi.SUPPORTED_VERSIONS), *cdefs.MODULES}, names
    monkeypatch.setattr(outofline, "PACKAGE_DIR", tmp_path)
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path / "empty-cache"))
    for name, text in cdefs.MODULES.items():
        ffi = outofline.ffi_of(name, text)
        assert type(ffi).__module__ == "_cffi_backend", name
        assert not (tmp_path / "empty-cache").exists(), "read from the package folder, not written to the cache"
    lt = outofline.ffi_of("_ephost_cublaslt", cdefs.CUBLASLT)
    inline = cffi.FFI()
    inline.cdef(cdefs.CUBLASLT)
    for struct in ("cublasLtMatmulAlgo_t", "cublasLtMatmulHeuristicResult_t"):
        assert lt.sizeof(struct) == inline.sizeof(struct) == cublaslt.ffi.sizeof(struct), struct
    for module in (cublas, cublaslt, cudnn, driver):
        assert type(module.ffi).__module__ == "_cffi_backend", module.__name__
