"""CuPy's compiled per-node kernels carried in a context (plugin_cuda/cupy_cache.py), without a GPU: a
stand-in for cupy.cuda.compiler's kernel cache backend hook, the recording window of a warm-up, the
payloads a context hands in, the context section that carries them, and record()'s memory by recipe.
The GPU side (a context session on an empty CuPy cache compiles nothing) is in test_first_run_gpu.py."""

from __future__ import annotations

import threading
import types

import pytest

from abi import fused_blob
from plugin_cuda import cupy_cache, kernel_prefetch
from plugin_cuda.device import algo_cache, nvrtc
from plugin_cuda.plan import compute, saved
from tests.abi.test_fused_blob import sample


class _Disk:
    """CuPy's disk backend as the compiler sees it: load(name) -> payload or None; save(name, cubin, src)."""

    def __init__(self, entries=None):
        self.entries = dict(entries or {})
        self.loads: list[str] = []

    def load(self, name):
        self.loads.append(name)
        return self.entries.get(name)

    def save(self, name, cubin, source):
        self.entries[name] = cubin


def _compiler(backend):
    """A stand-in for cupy.cuda.compiler (CuPy >= 14.2): the global backend and its setter."""
    module = types.SimpleNamespace(_kernel_cache_backend=backend)
    module._set_kernel_cache_backend = lambda b: setattr(module, "_kernel_cache_backend", b)
    return module


def _compile(compiler, name, source="src"):
    """What CuPy's _compile_with_cache_cuda does with the backend: load, else compile and save."""
    backend = compiler._kernel_cache_backend
    payload = backend.load(name)
    if payload is None:
        payload = b"cubin of " + source.encode()
        backend.save(name, payload, source)
    return payload


@pytest.fixture
def compiler(monkeypatch):
    """The process wrapper reset and installed around a fresh stand-in backend."""
    monkeypatch.setattr(cupy_cache, "_wrapper", None)
    monkeypatch.setattr(cupy_cache, "stats", dict.fromkeys(cupy_cache.stats, 0))
    module = _compiler(_Disk({"old.cubin": b"on disk"}))
    assert cupy_cache.install(module) is module._kernel_cache_backend
    return module


def test_install_wraps_the_backend_once_and_passes_everything_through(compiler):
    wrapper = compiler._kernel_cache_backend
    disk = wrapper.inner
    assert isinstance(disk, _Disk) and cupy_cache.install(_compiler(_Disk())) is wrapper  # once per process
    assert _compile(compiler, "old.cubin") == b"on disk"
    assert _compile(compiler, "new.cubin", "k") == b"cubin of k" and disk.entries["new.cubin"] == b"cubin of k"
    assert disk.loads == ["old.cubin", "new.cubin"]


def test_a_cupy_without_the_backend_hook_leaves_it_off(monkeypatch):
    monkeypatch.setattr(cupy_cache, "_wrapper", None)
    assert cupy_cache.install(types.SimpleNamespace()) is None
    assert cupy_cache.provide({"x.cubin": b"1"}) == 0  # nothing held, nothing raised
    with cupy_cache.recording() as seen:
        pass
    assert seen == {}


def test_recording_notes_loads_and_compiles_in_its_own_thread_only(compiler):
    other: dict = {}

    def elsewhere():
        _compile(compiler, "thread.cubin", "t")

    with cupy_cache.recording() as seen:
        _compile(compiler, "old.cubin")
        _compile(compiler, "new.cubin", "k")
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    _compile(compiler, "after.cubin", "a")
    assert seen == {"old.cubin": b"on disk", "new.cubin": b"cubin of k"}, "another thread's or a later compile"
    assert other == {}
    with cupy_cache.recording() as outer:  # a nested window reports to the outer one too
        with cupy_cache.recording() as inner:
            _compile(compiler, "old.cubin")
    assert inner == outer == {"old.cubin": b"on disk"}


def test_provided_payloads_are_served_before_the_backend_and_never_compiled(compiler):
    disk = compiler._kernel_cache_backend.inner
    assert cupy_cache.provide({"ctx.cubin": memoryview(b"from the context")}) == 1
    assert cupy_cache.provide({"ctx.cubin": b"again"}) == 0  # the first payload stays
    assert _compile(compiler, "ctx.cubin") == b"from the context"
    assert "ctx.cubin" not in disk.loads and "ctx.cubin" not in disk.entries  # no compile, nothing saved
    assert cupy_cache.stats["served"] == 1 and cupy_cache.stats["provided"] == 1


def test_provided_payloads_stop_at_the_byte_bound(compiler, monkeypatch):
    monkeypatch.setattr(cupy_cache, "MAX_PROVIDED_BYTES", 10)
    assert cupy_cache.provide({"a": b"123456", "b": b"123456", "c": b"1234"}) == 2
    assert sorted(compiler._kernel_cache_backend.provided) == ["a", "c"]


def test_a_context_carries_the_payloads_and_hands_them_in_before_the_replay(compiler, monkeypatch):
    monkeypatch.setattr(nvrtc, "_provided", {})
    monkeypatch.setattr(algo_cache, "_choices", {})
    monkeypatch.setattr(algo_cache, "_state", {"versions": "", "loaded": True})
    payloads = {"k1.cubin": b"\x7fELF one", "k2.cubin": b"\x7fELF two" * 50}
    blob = saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90", cupy=payloads))
    back = saved.unpack(blob)
    assert back.cupy == payloads and back.format == saved.FORMAT
    assert saved.unpack(saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90"))).cupy == {}
    order = []
    ep = types.SimpleNamespace(factory=types.SimpleNamespace(compute_capability=lambda device_id: "90"), device_id=0,
                               prefetch=types.SimpleNamespace(
                                   start=lambda warm: order.append(sorted(compiler._kernel_cache_backend.provided))))
    compute.subgraph_from_context(ep, "CUDA_fused_0", blob)
    assert order == [["k1.cubin", "k2.cubin"]], "the payloads were not there when the replay started"


def test_a_damaged_payload_section_is_refused():
    from tests.plugin_cuda.test_saved_plan import _flip

    blob = saved.pack(saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90", cupy={"k.cubin": b"payload bytes"}))
    with pytest.raises(saved.PlanBlobError, match=r"section 'cupy' \(13 bytes\) does not match its CRC-32"):
        saved.unpack(_flip(blob, len(blob) - 2))


RECIPE = {"op": "Gather", "domain": "", "opset": 13, "name": "g0", "attrs": {"axis": 0},
          "inputs": [[[4, 2], "<f4"], [[3], "<i8"]], "constants": {}, "present": [True]}


def test_record_keeps_payloads_per_ep_and_remembers_them_by_recipe(monkeypatch):
    monkeypatch.setattr(kernel_prefetch, "_payloads_by_key", {})
    first = types.SimpleNamespace(warm_recipes={}, warm_payloads={})
    kernel_prefetch.record(first, dict(RECIPE), {"take.cubin": b"1"})
    assert first.warm_payloads == {"take.cubin": b"1"}
    # A later session of the process finds the kernel compiled in memory: its warm-up loads nothing,
    # and the payloads the first call recorded stand for it.
    second = types.SimpleNamespace(warm_recipes={}, warm_payloads={})
    kernel_prefetch.record(second, dict(RECIPE, name="other"), {})
    assert second.warm_payloads == {"take.cubin": b"1"} and len(second.warm_recipes) == 1
    third = types.SimpleNamespace(warm_recipes={}, warm_payloads={})
    kernel_prefetch.record(third, dict(RECIPE, attrs={"axis": 1}), {})  # another call: nothing known
    assert third.warm_payloads == {}
