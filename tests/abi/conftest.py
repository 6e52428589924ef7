"""Fixtures and helpers of the ABI tests.

The plugins are built once per process with build.py through the suite-wide `built_plugin` of
tests/conftest.py (into build/lib). Every test of one process must load them from that one
place: a library is dlopened once per process and its cffi module name is global, so two copies
of the same plugin (say one in a tmp dir, one in build/lib) must never meet in one process.

Helpers that stand in for the session API (a graph view, a kernel context, a raw EP) are plain
functions here so that the tests drive the C tables directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ABI_DIR = ROOT / "abi"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import abi  # noqa: E402
import build  # noqa: E402
from abi.dtypes import to_onnx  # noqa: E402
from host.errors import EpError  # noqa: E402
from host.plugins import hostapi  # noqa: E402
from host.plugins.hostapi import ffi  # noqa: E402
from host.plugins.loader import Slots, negotiate  # noqa: E402
from tests.conftest import built_plugin  # noqa: E402  (the one build cache of the process)

NO_CC_REASON = "no C compiler ($CC or cc on PATH): the plugins (cffi shims and the C plugin) cannot be built"


def c_compiler() -> str | None:
    """The compiler build.py and cffi will use ($CC, else cc), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


@dataclass(frozen=True)
class Plugins:
    """Paths of the plugins built for this test session."""

    out_dir: Path
    example: dict[int, Path]
    c_plugin: Path

    def example_module(self, version: int) -> str:
        return build.module_name("example", version)


@pytest.fixture(scope="session")
def cc() -> str:
    path = c_compiler()
    if path is None:
        pytest.skip(NO_CC_REASON)
    return path


@pytest.fixture(scope="session")
def plugins(cc) -> Plugins:
    example = {v: built_plugin("example", v) for v in abi.SUPPORTED_VERSIONS}
    c_path = built_plugin("example_c")
    return Plugins(c_path.parent, example, c_path)


@pytest.fixture(scope="session")
def c_plugin(plugins) -> Path:
    return plugins.c_plugin


# ---- subprocesses ----------------------------------------------------------------------------

def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EPHOST_TEST_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run_python(code: str, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Run `code` with `args` in a fresh interpreter at the repository root (a plugin is dlopened
    once per process); `env` entries are added to this process's environment."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The last stdout line of a subprocess as JSON; fails with its output when there is none."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"subprocess exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return json.loads(lines[-1])


# ---- a raw EP, a graph view and a kernel context ------------------------------------------------

@contextlib.contextmanager
def raw_ep(reg, factory, options: dict[str, str] | None = None):
    """An Ep created through the factory's CreateEp slot on its first device; released on exit."""
    options = options or {}
    keep = []
    kv = ffi.new("EpKeyValue[]", max(len(options), 1))
    for i, (k, v) in enumerate(options.items()):
        keep += [ffi.new("char[]", k.encode()), ffi.new("char[]", v.encode())]
        kv[i].key, kv[i].value = keep[-2], keep[-1]
    out = ffi.new("Ep**")
    status = factory.slots.CreateEp(factory.ptr, factory.device_structs, 1, kv, len(options), ffi.NULL,
                                    reg.logger, out)
    hostapi.check(status, f"{factory.name}: CreateEp", EpError)
    try:
        yield negotiate("Ep", out[0], reg.env.api_version, f"EP of {reg.name}")
    finally:
        factory.slots.ReleaseEp(factory.ptr, out[0])


@dataclass
class Value:
    name: str
    elem_type: int = 1
    shape: tuple | None = (2, 3)


@dataclass
class Node:
    name: str
    op_type: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    domain: str = ""


class GraphView:
    """An EpGraphView built from plain values and nodes; owns every C object it points to."""

    def __init__(self, values: list[Value], nodes: list[Node]):
        self._keep: list = []
        self.ptr = ffi.new("EpGraphView*")
        self.ptr.struct_size, self.ptr.version = ffi.sizeof("EpGraphView"), abi.ABI_VERSION
        self.ptr.name = self._str("test-graph")
        vals = ffi.new("EpValueInfo[]", max(len(values), 1))
        for i, v in enumerate(values):
            vals[i].name, vals[i].elem_type = self._str(v.name), v.elem_type
            vals[i].ndim = -1 if v.shape is None else len(v.shape)
            if v.shape is not None:
                vals[i].shape = self._keep_new("int64_t[]", list(v.shape) or [0])
        nds = ffi.new("EpNodeView[]", max(len(nodes), 1))
        for i, n in enumerate(nodes):
            c = nds[i]
            c.name, c.op_type, c.domain = self._str(n.name), self._str(n.op_type), self._str(n.domain)
            c.opset = 17
            c.num_inputs, c.inputs = len(n.inputs), self._keep_new("int32_t[]", list(n.inputs) or [0])
            c.num_outputs, c.outputs = len(n.outputs), self._keep_new("int32_t[]", list(n.outputs) or [0])
        self._keep += [vals, nds]
        self.ptr.num_values, self.ptr.values = len(values), vals
        self.ptr.num_nodes, self.ptr.nodes = len(nodes), nds
        self.num_nodes = len(nodes)

    def _keep_new(self, ctype: str, init):
        c = ffi.new(ctype, init)
        self._keep.append(c)
        return c

    def _str(self, s: str):
        return self._keep_new("char[]", s.encode())


def add_graph(shape_a=(2, 3), shape_b=(2, 3), elem_type: int = 1, domain: str = "") -> GraphView:
    """One node `c = Add(a, b)`; the output has a's shape."""
    values = [Value("a", elem_type, shape_a), Value("b", elem_type, shape_b), Value("c", elem_type, shape_a)]
    return GraphView(values, [Node("add0", "Add", (0, 1), (2,), domain)])


class KernelContext:
    """What the host's kernel-context callbacks (KernelContext_GetIO/GetOutput/GetSyncStream) read."""

    def __init__(self, inputs: list[np.ndarray], stream=None):
        self.arrays = [np.ascontiguousarray(a) for a in inputs]
        self._keep: list = []
        tensors = ffi.new("EpTensor[]", max(len(self.arrays), 1))
        for t, a in zip(tensors, self.arrays):
            self._fill(t, a)
        self.io = ffi.new("EpKernelIO*")
        self.io.struct_size, self.io.version = ffi.sizeof("EpKernelIO"), abi.ABI_VERSION
        self.io.num_inputs, self.io.num_outputs, self.io.inputs = len(self.arrays), 1, tensors
        self._keep.append(tensors)
        self._stream = ffi.NULL if stream is None else stream
        self.sync_stream_calls = 0
        self.outputs: dict[int, np.ndarray] = {}

    def _fill(self, t, a: np.ndarray) -> None:
        shape = ffi.new("int64_t[]", list(a.shape) or [0])
        self._keep.append(shape)
        t.data, t.shape, t.ndim = ffi.cast("void*", a.ctypes.data), shape, a.ndim
        t.elem_type, t.device_type, t.device_id, t.nbytes = to_onnx(a.dtype), abi.DEVICE_CPU, 0, a.nbytes

    @property
    def sync_stream(self):
        self.sync_stream_calls += 1
        return self._stream

    def get_output(self, index: int, dims: tuple):
        out = np.zeros(dims, self.arrays[0].dtype)
        self.outputs[index] = out
        t = ffi.new("EpTensor*")
        self._keep.append(t)
        self._fill(t, out)
        return t

    def __enter__(self):
        self.ptr = hostapi.CONTEXTS.add(self)
        return self

    def __exit__(self, *exc) -> None:
        hostapi.CONTEXTS.remove(self.ptr)


def claimed_nodes(ep: Slots, graph: GraphView) -> list[int]:
    claimed = ffi.new("uint8_t[]", max(graph.num_nodes, 1))
    hostapi.check(ep.GetCapability(ep.ptr, graph.ptr, claimed), "GetCapability", EpError)
    return [i for i in range(graph.num_nodes) if claimed[i]]


@contextlib.contextmanager
def kernel(ep: Slots, graph: GraphView, node: int):
    out = ffi.new("EpKernel**")
    hostapi.check(ep.CreateKernel(ep.ptr, graph.ptr, node, out), "CreateKernel", EpError)
    slots = negotiate("EpKernel", out[0], ep.negotiated, "kernel")
    try:
        yield slots
    finally:
        slots.Release(slots.ptr)


def compute(k: Slots, ctx: KernelContext) -> None:
    hostapi.check(k.Compute(k.ptr, ctx.ptr), "Compute", EpError)
