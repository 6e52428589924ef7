"""Runs hostile-plugin cases in this process and prints one JSON line per case.

    python -m tests.hostile.driver LIBRARY CASE_JSON...

Each CASE_JSON is {"name", "spec", "scenarios"}: the plugin is configured with `spec`
(Hostile_Configure), registered in a fresh Environment, and each scenario runs against it:
"main" (Add on the plugin, Relu on the CPU EP, Add on the plugin: copies both ways, streams,
notifications), "graph" (one Add, bound device buffers, capture then replay), "fuse" (the main
model with each Add compiled through ABI v6: Compile, compute infos, call frames) and "context" (ABI
v7: the fused main model saved with its contexts, then loaded through CompileFromContext). A line is
printed (and flushed) after each case, so a crash names the case it happened in. At the end the
same process runs a CPU-only session and the plugin with no fault: the host survived.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import tempfile
import warnings

import cffi
import numpy as np
from onnx import TensorProto, helper

from host.errors import EphostError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession, RunOptions, SessionOptions

SHAPE = [2, 3]
_FFI = cffi.FFI()
_FFI.cdef("""
void Hostile_Configure(const char* spec);
int Hostile_Live(void);
int Hostile_Orphans(void);
const char* Hostile_LiveReport(void);
int Hostile_Calls(const char* slot);
""")


class WrongResult(AssertionError):
    """The session ran and produced numbers that differ from NumPy's."""


def _model(nodes) -> bytes:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, SHAPE)
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, SHAPE)
    graph = helper.make_graph(nodes, "hostile", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


MAIN_MODEL = _model([helper.make_node("Add", ["X", "X"], ["A"], name="add0"),
                     helper.make_node("Relu", ["A"], ["B"], name="relu"),
                     helper.make_node("Add", ["B", "B"], ["Y"], name="add1")])
GRAPH_MODEL = _model([helper.make_node("Add", ["X", "X"], ["Y"], name="add0")])
CPU_MODEL = _model([helper.make_node("Relu", ["X"], ["Y"], name="relu")])


def options() -> SessionOptions:
    """No graph optimization: these models have nothing to optimize, and the optimizer is most of
    a session's creation time (the suite creates hundreds)."""
    so = SessionOptions()
    so.graph_optimization_level = 0  # ORT_DISABLE_ALL
    so.add_session_config_entry("hostile.entry", "a value longer than two bytes")
    return so


def _expect(got, want) -> None:
    if not np.allclose(got, want):
        raise WrongResult(f"expected {want.tolist()}, got {np.asarray(got).tolist()}")


def scenario_main(env: Environment, rng) -> None:
    with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
        for _ in range(2):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            _expect(s.run(None, {"X": x})[0], np.maximum(2 * x, 0) * 2)


def scenario_graph(env: Environment, rng) -> None:
    with InferenceSession(GRAPH_MODEL, options(), providers=[("HostileEP", {"graph": "1"})], env=env) as s:
        x = np.zeros(SHAPE, np.float32)
        y = np.zeros(SHAPE, np.float32)
        b = s.io_binding()
        # The mock device's memory is host memory: bind NumPy buffers as "device" pointers.
        b.bind_input("X", element_type=np.float32, shape=SHAPE, buffer_ptr=x.ctypes.data, device_type="cuda")
        b.bind_output("Y", element_type=np.float32, shape=SHAPE, buffer_ptr=y.ctypes.data, device_type="cuda")
        ro = RunOptions()
        ro.add_run_config_entry("gpu_graph_id", "1")
        for _ in range(4):
            x[...] = rng.standard_normal(SHAPE)
            s.run_with_iobinding(b, ro)
            _expect(y, 2 * x)


def scenario_fuse(env: Environment, rng) -> None:
    """ABI v6: each Add is offered for compilation and runs as a compiled partition (call frames)."""
    with InferenceSession(MAIN_MODEL, options(), providers=[("HostileEP", {"fuse": "1"})], env=env) as s:
        for _ in range(2):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            _expect(s.run(None, {"X": x})[0], np.maximum(2 * x, 0) * 2)


def scenario_context(env: Environment, rng) -> None:
    """ABI v7: the main model compiled and saved with its contexts (EPContext nodes), then loaded and run."""
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "main.onnx"), os.path.join(tmp, "main_ctx.onnx")
        with open(source, "wb") as f:
            f.write(MAIN_MODEL)
        so = options()
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", target)
        with InferenceSession(source, so, providers=[("HostileEP", {"fuse": "1"})], env=env):
            pass
        with InferenceSession(target, options(), providers=[("HostileEP", {"fuse": "1"})], env=env) as s:
            for _ in range(2):
                x = rng.standard_normal(SHAPE).astype(np.float32)
                _expect(s.run(None, {"X": x})[0], np.maximum(2 * x, 0) * 2)


SCENARIOS = {"main": scenario_main, "graph": scenario_graph, "fuse": scenario_fuse, "context": scenario_context}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def run_case(lib, path: str, case: dict, rng) -> dict:
    lib.Hostile_Configure(case["spec"].encode())
    live0, orphans0, statuses0 = lib.Hostile_Live(), lib.Hostile_Orphans(), len(hostapi.STATUSES)
    handler = _Collect()
    logging.getLogger("ephost").addHandler(handler)
    result = {"name": case["name"], "outcome": "ok", "message": ""}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Environment() as env:
                env.register_plugin("hostile", path)
                for name in case["scenarios"]:
                    SCENARIOS[name](env, rng)
        result["warnings"] = [str(w.message) for w in caught]
    except EphostError as exc:
        result["outcome"], result["message"] = type(exc).__name__, str(exc)
    except WrongResult as exc:
        result["outcome"], result["message"] = "WrongResult", str(exc)
    except BaseException as exc:  # noqa: BLE001 - a raw error is what the test reports
        result["outcome"], result["message"] = f"raw:{type(exc).__name__}", str(exc)
    finally:
        logging.getLogger("ephost").removeHandler(handler)
    gc.collect()
    result["logged"] = handler.messages
    result["live"] = lib.Hostile_Live() - live0
    result["orphans"] = lib.Hostile_Orphans() - orphans0
    result["report"] = _FFI.string(lib.Hostile_LiveReport()).decode()
    result["statuses"] = len(hostapi.STATUSES) - statuses0
    result["calls"] = {slot: lib.Hostile_Calls(slot.encode()) for slot in case.get("count", [])}
    lib.Hostile_Configure(b"")
    return result


def survivor(lib, path: str, rng) -> dict:
    """After every case: a CPU-only session and the plugin without faults both still work."""
    out = {"name": "<survivor>", "outcome": "ok", "message": ""}
    try:
        x = rng.standard_normal(SHAPE).astype(np.float32)
        with InferenceSession(CPU_MODEL, options(), providers=["CPUExecutionProvider"], env=Environment()) as s:
            _expect(s.run(None, {"X": x})[0], np.maximum(x, 0))
        live0 = lib.Hostile_Live() if path.endswith("libephost_hostile.so") else 0
        with Environment() as env:
            env.register_plugin("hostile", path)
            scenario_main(env, rng)
            scenario_graph(env, rng)
            scenario_fuse(env, rng)
        if path.endswith("libephost_hostile.so") and lib is not None:
            out["live"] = lib.Hostile_Live() - live0
    except BaseException as exc:  # noqa: BLE001
        out["outcome"], out["message"] = f"raw:{type(exc).__name__}", str(exc)
    return out


def main(argv: list[str]) -> int:
    path, cases = argv[0], [json.loads(a) for a in argv[1:]]
    lib = _FFI.dlopen(path)  # the same library the host loads (one dlopen per process): shared counters
    rng = np.random.default_rng(0)
    for case in cases:
        print(json.dumps(run_case(lib, path, case, rng)), flush=True)
    print(json.dumps(survivor(lib, os.environ.get("HOSTILE_SURVIVOR_LIB", path), rng)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
