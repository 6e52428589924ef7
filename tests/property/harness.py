"""Environments, sessions and references for the property tests.

Every Environment is made by `example_env`, which closes it (after a gc.collect(), because
sessions left to the garbage collector close in their finalizers). A plugin's Record is one per
process and per plugin version; tests clear it right before they act and read it right after.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

import build
from abi import sdk
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession, SessionOptions
from tests.conftest import built_plugin

EXAMPLE_EP = "ExampleEP"

# Float32 tolerances. Elementwise ops are correctly rounded everywhere, but Sigmoid's exp is
# not (NumPy, MLAS and the reference differ by an ulp), and an ulp of an intermediate of size
# S is an absolute error ~S*6e-8 after a cancelling Sub: atol scales with the largest
# intermediate magnitude `scale` (>= 1) of the graph.
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
# MatMul and reductions sum in different orders (pairwise NumPy, FMA in MLAS, float64
# accumulation in the host's CPU EP): ~k*eps relative error for k terms, k <= 64 here.
LOOSE = {"rtol": 1e-4, "atol": 1e-5}


def example_module(version: int) -> str:
    return build.module_name("example", version)


def record(version: int) -> sdk.Record | None:
    rt = sdk.runtimes().get(example_module(version))
    return rt.record if rt is not None else None


def clear_record(version: int) -> None:
    rec = record(version)
    if rec is not None:
        rec.clear()


@contextlib.contextmanager
def example_env(host_version: int, plugin_versions=(), clear: bool = True):
    """An Environment serving `host_version` with the example plugin(s) registered as exV."""
    gc.collect()  # stale sessions of an earlier example must not call slots during this one
    for v in plugin_versions:
        if clear:
            clear_record(v)
    env = Environment(api_version=host_version)
    try:
        for v in plugin_versions:
            env.register_plugin(f"ex{v}", built_plugin("example", v))
        yield env
    finally:
        gc.collect()
        env.close()


def session_options(profile_prefix: str | None = None, intra_op_threads: int = 0):
    """No graph optimization: the properties count kernel calls per node of the model as written
    (the optimizer's own equivalence is tests/host/optimizer's business). With `profile_prefix`,
    profiling on, its trace files starting with that prefix."""
    so = SessionOptions()
    so.graph_optimization_level = 0  # ORT_DISABLE_ALL
    so.intra_op_num_threads = intra_op_threads
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def session(case_or_model, env, opts: dict[str, str] | None = None, providers=None, profile_prefix=None,
            intra_op_threads: int = 0):
    model = getattr(case_or_model, "model", case_or_model)
    if providers is None:
        providers = [(EXAMPLE_EP, dict(opts or {}))]
    return InferenceSession(model, session_options(profile_prefix, intra_op_threads), providers=providers, env=env)


# ---- references ---------------------------------------------------------------------------------
class References:
    """Outputs of one Case from the ONNX reference evaluator and ONNX Runtime's CPU EP."""

    def __init__(self, case):
        self.case = case
        self._ref = ReferenceEvaluator(case.model)
        so = ort.SessionOptions()
        # No fusions (MatMul+Add -> Gemm changes rounding): compare kernel against kernel.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        self._ort = ort.InferenceSession(case.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in case.model.graph.output]
        self._memo: dict[tuple, object] = {}  # feeds -> outputs (scenarios check the same feeds often)

    def reference(self, feeds) -> tuple[list[np.ndarray], float]:
        """Reference outputs and the scale of the graph (largest |intermediate|, at least 1)."""
        key = tuple((k, v.tobytes()) for k, v in sorted(feeds.items()))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._reference(feeds)
        return hit

    def _reference(self, feeds) -> tuple[list[np.ndarray], float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            everything = self._ref.run(None, feeds, intermediate=True)
        scale = max([1.0] + [float(np.max(np.abs(v))) for v in everything.values()
                             if isinstance(v, np.ndarray) and v.size and v.dtype.kind == "f"])
        return [np.asarray(everything[n]) for n in self.names], scale

    def onnxruntime(self, feeds) -> list[np.ndarray]:
        key = ("ort",) + tuple((k, v.tobytes()) for k, v in sorted(feeds.items()))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._ort.run(None, feeds)
        return hit

    def tolerance(self, scale: float) -> dict[str, float]:
        tol = LOOSE if self.case.loose else TIGHT
        return {"rtol": tol["rtol"], "atol": tol["atol"] * scale}

    def check(self, got: list, feeds, what: str) -> None:
        """`got` equals both references within the stated tolerance, with the same shapes/dtypes."""
        ref, scale = self.reference(feeds)
        ortv = self.onnxruntime(feeds)
        tol = self.tolerance(scale)
        assert len(got) == len(ref), what
        for name, g, r, o in zip(self.names, got, ref, ortv):
            g = np.asarray(g)
            assert g.shape == r.shape == o.shape, f"{what}: output {name} shapes {g.shape} / ref {r.shape} / ort {o.shape}"
            assert g.dtype == np.float32, f"{what}: output {name} dtype {g.dtype}"
            np.testing.assert_allclose(g, r, err_msg=f"{what}: output {name} vs ReferenceEvaluator", **tol)
            np.testing.assert_allclose(g, o, err_msg=f"{what}: output {name} vs onnxruntime CPU EP", **tol)


def bind(sess, feeds: dict[str, np.ndarray], out_shapes: dict[str, tuple]):
    """An IOBinding over private copies of `feeds` and zeroed outputs: (binding, inputs, outputs)."""
    b = sess.io_binding()
    ins = {k: np.array(v, copy=True) for k, v in feeds.items()}
    outs = {k: np.zeros(s, np.float32) for k, s in out_shapes.items()}
    for k, v in ins.items():
        b.bind_input(k, v)
    for k, v in outs.items():
        b.bind_output(k, v)
    return b, ins, outs


def refill(buffers: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> None:
    """Copy new data into bound buffers (rebinding would move them)."""
    for k, v in feeds.items():
        buffers[k][...] = v


# ---- what the host should do with a given plugin -----------------------------------------------------
def capture_state(negotiated: int, null_slots, opts: dict[str, str]) -> str:
    """'off': no graph capture for this EP; 'never': enabled, but the EP has no OnRunStart/OnRunEnd
    to capture in, so the host gives up after MAX_INTERNAL_RUNS; 'on': captures and replays."""
    from tests.property.strategies import CAPTURE_SLOTS

    null = set(null_slots)
    if opts.get("enable_graph") != "1" or negotiated < 3 or CAPTURE_SLOTS & null:
        return "off"
    if {"OnRunStart", "OnRunEnd"} & null:
        return "never"
    return "on"


def concurrent(negotiated: int, null_slots, opts: dict[str, str]) -> bool:
    """Runs may proceed in parallel: the EP says so (v2 slot, present), and ExampleEP says no
    while graph capture is on."""
    return negotiated >= 2 and "IsConcurrentRunSupported" not in null_slots and opts.get("enable_graph") != "1"


def claimed_ops(opts: dict[str, str]) -> set[str]:
    from tests.property.strategies import EXAMPLE_EP_OPS

    return set(opts["ops"].split(",")) & set(EXAMPLE_EP_OPS) if opts.get("ops") else set(EXAMPLE_EP_OPS)


def with_null_slots(opts: dict[str, str], null_slots) -> dict[str, str]:
    return {**opts, "null_slots": ",".join(null_slots)} if null_slots else dict(opts)


class Sentinels:
    """Blocks of the sizes a graph's intermediates have, filled with a pattern. Made right after a
    capture, they likely take memory the capture run freed: a replay that writes into memory the
    graph does not own overwrites them (a use-after-free made visible)."""

    PATTERN = 0xAB

    def __init__(self, case, copies: int = 8):
        sizes = sorted({max(math.prod(shape) * 4, 1) for shape in case.intermediates.values()})
        self.blocks = [np.full(n, self.PATTERN, np.uint8) for n in sizes for _ in range(copies)]

    def overwritten(self) -> int:
        return sum(int((b != self.PATTERN).any()) for b in self.blocks)


def chain_case():
    """A fixed graph ExampleEP takes whole, Z = relu(X + Y) * X over (2, 3), as a strategies.Case
    (for explicit examples at the edges)."""
    from onnx import TensorProto, helper

    from tests.property.strategies import Case

    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ")
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    m = helper.make_model(helper.make_graph(nodes, "chain", [x, y], [z]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    rng = np.random.default_rng(7)
    feeds, feeds2 = ({k: rng.uniform(-1, 1, (2, 3)).astype(np.float32) for k in "XY"} for _ in range(2))
    return Case(m, feeds, feeds2, {"add": "Add", "relu": "Relu", "mul": "Mul"}, {"Z": (2, 3)}, 17,
                intermediates={"A": (2, 3), "B": (2, 3), "Z": (2, 3)})


def warned_at(filename: str, test_file: str) -> bool:
    """A warning's file is the test's own (the caller of ephost). Under mutmut every ephost function
    is reached through a trampoline frame, so there the first frame outside ephost is mutmut's."""
    return filename == test_file or "mutmut" in Path(filename).parts
