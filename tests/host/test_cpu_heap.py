"""host/cpu_ep/heap.py: glibc keeps the memory the CPU EP frees, so a run does not fault in fresh pages."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest
from onnx import TensorProto, helper

import host
from host.cpu_ep import heap

GLIBC = platform.libc_ver()[0] == "glibc"


def _tiny_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("arena", [True, False])
def test_session_sets_the_heap_thresholds_only_with_the_arena_option_on(monkeypatch, arena):
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    so = host.SessionOptions()
    so.enable_cpu_mem_arena = arena
    host.InferenceSession(_tiny_model(), sess_options=so, providers=["CPUExecutionProvider"])
    assert len(calls) == (1 if arena else 0)


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's mallopt; elsewhere nothing is set")
def test_freed_activations_are_reused_without_page_faults():
    assert heap.keep_freed_memory() is True
    # An 8 MiB block, above glibc's default mmap threshold: without the settings every allocation is a
    # fresh mapping, and filling it faults in 2,048 pages.
    np.ones(2 << 20, np.float32).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        np.ones(2 << 20, np.float32).sum()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 500, f"{faults} page faults in 10 allocations of 8 MiB (2,048 each when not reused)"




@pytest.mark.parametrize("answer", [None, "musl 1.2"])
def test_without_glibc_nothing_is_set(monkeypatch, answer):
    """The C library is told apart by confstr (None where the name is undefined), as platform does."""
    monkeypatch.setattr(heap.os, "confstr", lambda name: answer)
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda *a: pytest.fail("mallopt looked up without glibc"))
    assert heap._mallopt() is False


def test_glibc_is_found_as_platform_finds_it():
    assert heap._glibc() == GLIBC
