"""Hypothesis strategies shared by the property tests: versions, NULL slots, provider and run
options, thread counts, and small random ONNX graphs with their feeds.

A generated graph is a `Case`: the model, two sets of feeds (the second one is copied into bound
buffers before a replay, so a replay that reuses stale data is caught), and what each node is,
so that a test knows which nodes ExampleEP can claim and which tolerance applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

import abi

VERSIONS = tuple(abi.SUPPORTED_VERSIONS)
versions = st.sampled_from(VERSIONS)

# Optional Ep slots a plugin may leave NULL (mandatory ones make registration fail by design).
OPTIONAL_EP_SLOTS = tuple(name for name, (_, required) in abi.since_table()["Ep"].items() if not required)
CAPTURE_SLOTS = frozenset({"IsGraphCaptureEnabled", "IsGraphCaptured", "ReplayGraph"})
null_slot_sets = st.lists(st.sampled_from(OPTIONAL_EP_SLOTS), unique=True, max_size=4).map(tuple)

# What ExampleEP (tests/plugins/example_ep.py) claims, for float32/float64 inputs.
EXAMPLE_EP_OPS = ("Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "MatMul", "Identity")
EXAMPLE_EP_OPTION_KEYS = ("ops", "fail_node", "enable_graph", "min_runs", "null_slots", "mock_device", "fuse",
                          "compile_fails", "scratch", "lie", "slow_replay", "context")

BINARY = ("Add", "Sub", "Mul", "Div")
UNARY = ("Relu", "Sigmoid")
REDUCE = ("ReduceSum", "ReduceMean")
SHAPE = ("Reshape", "Transpose")
ALL_OPS = BINARY + UNARY + ("MatMul",) + REDUCE + SHAPE
# Ops whose result depends on the order of a summation (pairwise in NumPy, FMA in MLAS,
# float64 accumulation in the host's CPU EP): these get the looser tolerance.
LOOSE_OPS = frozenset({"MatMul", "ReduceSum", "ReduceMean"})

thread_counts = st.integers(1, 4)


def budget(n_ci: int) -> int:
    """max_examples for an expensive test: `n_ci` under the ci profile, scaled for the others."""
    return max(1, settings.default.max_examples * n_ci // 25)


# ---- options ---------------------------------------------------------------------------------------
@st.composite
def example_ep_options(draw, *, graph: bool | None = None, ops_subset: bool = True) -> dict[str, str]:
    """A valid provider-option set for ExampleEP (no injected failure)."""
    opts: dict[str, str] = {}
    if ops_subset and draw(st.booleans()):
        chosen = draw(st.lists(st.sampled_from(EXAMPLE_EP_OPS), min_size=1, unique=True))
        opts["ops"] = ",".join(chosen)
    enable = draw(st.booleans()) if graph is None else graph
    if enable or draw(st.booleans()):
        opts["enable_graph"] = "1" if enable else "0"
    if draw(st.booleans()):
        opts["min_runs"] = str(draw(st.integers(0, 3)))
    if draw(st.booleans()):
        opts["mock_device"] = draw(st.sampled_from(["0", "1"]))
    return opts


_identifier = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.", min_size=1, max_size=12)
unknown_example_keys = _identifier.filter(lambda k: k not in EXAMPLE_EP_OPTION_KEYS)


# ---- run options --------------------------------------------------------------------------------
valid_graph_ids = st.sampled_from(["-1", "0", "1", "2", "3"])
malformed_graph_ids = st.one_of(
    st.sampled_from(["", "abc", "-2", "1.5", "0x1", " ", "1e3", "--1", "∞"]),
    st.integers(max_value=-2).map(str),
    st.text(max_size=4).filter(lambda s: not _is_int_ge_minus_one(s)),
)


def _is_int_ge_minus_one(s: str) -> bool:
    try:
        return int(s) >= -1
    except ValueError:
        return False


@dataclass(frozen=True)
class RunOpts:
    graph_id: str | None      # None: entry absent (graph 0)
    disable_sync: str | None  # None, "0" or "1"

    def make(self):
        from host.runtime.session import RunOptions

        ro = RunOptions()
        if self.graph_id is not None:
            ro.add_run_config_entry("gpu_graph_id", self.graph_id)
        if self.disable_sync is not None:
            ro.add_run_config_entry("disable_synchronize_execution_providers", self.disable_sync)
        return ro

    @property
    def gid(self) -> int:
        return 0 if self.graph_id is None else int(self.graph_id)

    @property
    def sync(self) -> bool:
        return self.disable_sync != "1"


run_options = st.builds(RunOpts, st.one_of(st.none(), valid_graph_ids), st.sampled_from([None, "0", "1"]))


# ---- CUDA provider options (plugin_cuda.options.parse_options) -------------------------------------
CUDA_PREFIXES = ("", "ep.cuda.", "ep.CUDAExecutionProvider.")
CUDA_BOOL_KEYS = ("do_copy_in_default_stream", "use_ep_level_unified_stream", "arena.use_cuda_mempool",
                  "use_tf32", "enable_cuda_graph", "debug_force_capture_failure")
CUDA_INT_KEYS = ("arena.max_mem", "min_num_runs_before_cuda_graph_capture")
CUDA_POINTER_KEYS = ("user_compute_stream", "gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache")
CUDA_KEYS = ("device_id",) + CUDA_BOOL_KEYS + CUDA_INT_KEYS + CUDA_POINTER_KEYS

valid_bools = st.sampled_from(["0", "1", "true", "false", "TRUE", "False", " 1 "])
malformed_bools = st.one_of(st.sampled_from(["yes", "no", "2", "-1", "on", "", "t", "1.0", "truee"]),
                            st.text(max_size=5).filter(lambda s: s.strip().lower() not in ("0", "1", "true", "false")))
malformed_ints = st.one_of(st.sampled_from(["1.5", "abc", "0x10", "", "1e3", "--1", "one"]),
                           st.integers(max_value=-1).map(str))
malformed_pointers = st.one_of(st.sampled_from(["0xZZ", "zz", "", "-1", "0x", "1.0", "0b101", "ptr"]),
                               st.integers(min_value=2**64, max_value=2**80).map(str),
                               st.integers(min_value=2**64, max_value=2**80).map(hex),
                               st.integers(max_value=-1).map(str))


def _pointer_text(v: int, style: str) -> str:
    return hex(v) if style == "hex" else hex(v).upper().replace("X", "x") if style == "HEX" else str(v)


@st.composite
def valid_cuda_options(draw, device_count: int = 1) -> tuple[dict[str, str], dict[str, object]]:
    """(raw options, expected parsed fields) for a valid CUDA option set."""
    raw: dict[str, str] = {}
    want: dict[str, object] = {}

    def key(name: str) -> str:
        return draw(st.sampled_from(CUDA_PREFIXES)) + name

    if draw(st.booleans()):
        d = draw(st.integers(0, max(device_count - 1, 0)))
        raw[key("device_id")], want["device_id"] = str(d), d
    for name in draw(st.lists(st.sampled_from(CUDA_BOOL_KEYS), unique=True, max_size=3)):
        text = draw(valid_bools)
        raw[key(name)], want[name.replace(".", "_")] = text, text.strip().lower() in ("1", "true")
    for name in draw(st.lists(st.sampled_from(CUDA_INT_KEYS), unique=True, max_size=2)):
        v = draw(st.integers(0, 2**40))
        raw[key(name)], want[name.replace(".", "_")] = str(v), v
    mode = draw(st.sampled_from(["none", "stream", "external"]))
    style = draw(st.sampled_from(["hex", "HEX", "dec"]))
    if mode == "stream":
        v = draw(st.integers(1, 2**64 - 1))
        raw[key("user_compute_stream")], want["user_compute_stream"] = _pointer_text(v, style), v
    elif mode == "external":
        a, f = draw(st.integers(1, 2**64 - 1)), draw(st.integers(1, 2**64 - 1))
        raw[key("gpu_external_alloc")], want["gpu_external_alloc"] = _pointer_text(a, style), a
        raw[key("gpu_external_free")], want["gpu_external_free"] = _pointer_text(f, style), f
        if draw(st.booleans()):
            e = draw(st.integers(1, 2**64 - 1))
            raw[key("gpu_external_empty_cache")], want["gpu_external_empty_cache"] = _pointer_text(e, style), e
        # The external allocator manages its own memory: no arena.* with it.
        for name in ("arena.use_cuda_mempool", "arena.max_mem"):
            for p in CUDA_PREFIXES:
                if raw.pop(p + name, None) is not None:
                    want.pop(name.replace(".", "_"), None)
    return raw, want


@dataclass(frozen=True)
class BadCuda:
    raw: dict[str, str]
    names: tuple[str, ...]   # the message must name at least one of these


@st.composite
def invalid_cuda_options(draw, device_count: int = 1) -> BadCuda:
    """One invalid CUDA option set and the option(s) its error must name."""
    base, _ = draw(valid_cuda_options(device_count))
    kind = draw(st.sampled_from(["unknown", "bool", "int", "pointer", "device", "duplicate", "half_external",
                                 "empty_cache_alone", "stream_and_external", "external_and_arena"]))
    prefix = draw(st.sampled_from(CUDA_PREFIXES))
    if kind == "unknown":
        k = draw(_identifier.filter(lambda s: _strip_cuda(s) not in CUDA_KEYS))
        return BadCuda({**base, k: "1"}, (k,))
    if kind == "bool":
        name = draw(st.sampled_from(CUDA_BOOL_KEYS))
        return BadCuda(_replace(base, name, prefix + name, draw(malformed_bools)), (name,))
    if kind == "int":
        name = draw(st.sampled_from(CUDA_INT_KEYS + ("device_id",)))
        return BadCuda(_replace(base, name, prefix + name, draw(malformed_ints)), (name,))
    if kind == "pointer":
        name = draw(st.sampled_from(CUDA_POINTER_KEYS))
        return BadCuda(_replace(base, name, prefix + name, draw(malformed_pointers)), (name,))
    if kind == "device":
        d = draw(st.integers(device_count, device_count + 8))
        return BadCuda(_replace(base, "device_id", prefix + "device_id", str(d)), ("device_id",))
    if kind == "duplicate":
        name = draw(st.sampled_from(CUDA_BOOL_KEYS))
        a, b = draw(st.lists(st.sampled_from(CUDA_PREFIXES), min_size=2, max_size=2, unique=True))
        raw = _replace(base, name, a + name, "1")
        raw[b + name] = "0"
        return BadCuda(raw, (name,))
    clean = {k: v for k, v in base.items()
             if _strip_cuda(k) not in CUDA_POINTER_KEYS and not _strip_cuda(k).startswith("arena.")}
    if kind == "half_external":
        name = draw(st.sampled_from(["gpu_external_alloc", "gpu_external_free"]))
        return BadCuda({**clean, prefix + name: "0x1000"}, (name,))
    if kind == "empty_cache_alone":
        return BadCuda({**clean, prefix + "gpu_external_empty_cache": "0x1000"}, ("gpu_external_empty_cache",))
    if kind == "stream_and_external":
        return BadCuda({**clean, prefix + "user_compute_stream": "0x10", "gpu_external_alloc": "0x20",
                        "gpu_external_free": "0x30"}, ("user_compute_stream", "gpu_external_alloc"))
    arena = draw(st.sampled_from([("arena.use_cuda_mempool", "1"), ("arena.max_mem", "1024")]))
    return BadCuda({**clean, "gpu_external_alloc": "0x20", "gpu_external_free": "0x30", prefix + arena[0]: arena[1]},
                   ("gpu_external_alloc", "arena."))


def _strip_cuda(key: str) -> str:
    for p in CUDA_PREFIXES[1:]:
        if key.startswith(p):
            return key[len(p):]
    return key


def _replace(raw: dict[str, str], name: str, key: str, value: str) -> dict[str, str]:
    out = {k: v for k, v in raw.items() if _strip_cuda(k) != name}
    out[key] = value
    return out


# ---- graphs ---------------------------------------------------------------------------------------
@dataclass
class Case:
    """A generated model with feeds; `nodes` maps node name -> op type."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    feeds2: dict[str, np.ndarray]
    nodes: dict[str, str]
    outputs: dict[str, tuple[int, ...]]
    opset: int
    description: list[str] = field(default_factory=list)
    intermediates: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node outputs and shapes

    @property
    def loose(self) -> bool:
        return any(op in LOOSE_OPS for op in self.nodes.values())

    def claimable_by(self, ops: set[str]) -> bool:
        return all(op in ops for op in self.nodes.values())

    def offending(self, ops: set[str]) -> list[str]:
        return [name for name, op in self.nodes.items() if op not in ops]

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        return (f"Case(opset={self.opset}, inputs={ {k: v.shape for k, v in self.feeds.items()} }, "
                f"nodes={self.description}, outputs={self.outputs})")


def _floats(lo: float, hi: float):
    return st.floats(lo, hi, width=32, allow_subnormal=False)


def _array(draw, shape: tuple[int, ...], lo=-1.0, hi=1.0) -> np.ndarray:
    return draw(hnp.arrays(np.float32, shape, elements=_floats(lo, hi)))


def _divisor(draw, shape: tuple[int, ...]) -> np.ndarray:
    """Values with 1 <= |v| <= 2: division never blows up nor depends on tiny denominators."""
    mag = _array(draw, shape, 1.0, 2.0)
    sign = draw(hnp.arrays(np.bool_, shape))
    return np.where(sign, -mag, mag).astype(np.float32)


def _shape(draw, min_rank=1, max_rank=3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 4), min_size=min_rank, max_size=max_rank)))


def _broadcast_partner(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape` (it may also expand size-1 dims and add leading ones)."""
    dims = [draw(st.integers(1, 3)) if d == 1 else draw(st.sampled_from([d, 1])) for d in shape]
    lead = draw(st.integers(0, max(0, 3 - len(shape))))
    dims = [draw(st.integers(1, 3)) for _ in range(lead)] + dims
    # Dropping leading dims of the partner is broadcasting too.
    drop = draw(st.integers(0, len(dims) - 1)) if dims else 0
    return tuple(dims[drop:])


def _factor_shape(draw, total: int) -> list[int]:
    primes, n, p = [], total, 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    rank = draw(st.integers(1, 3))
    dims = [1] * rank
    for q in primes:
        dims[draw(st.integers(0, rank - 1))] *= q
    if draw(st.booleans()):
        dims[draw(st.integers(0, rank - 1))] = -1
    return dims


@st.composite
def graphs(draw, ops: tuple[str, ...] = ALL_OPS, min_nodes: int = 1, max_nodes: int = 6) -> Case:
    """A small DAG of `ops` over one or two float32 inputs, values in [-1, 1]."""
    opset = draw(st.sampled_from([13, 17, 18]))
    x_shape = _shape(draw)
    n_inputs = draw(st.integers(1, 2))
    inputs = {"X": x_shape}
    if n_inputs == 2:
        inputs["Y"] = x_shape if draw(st.booleans()) else _broadcast_partner(draw, x_shape)
    values: dict[str, tuple[int, ...]] = dict(inputs)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    kinds: dict[str, str] = {}
    desc: list[str] = []
    produced: list[str] = []

    def const(arr: np.ndarray) -> str:
        name = f"c{len(inits)}"
        inits.append(numpy_helper.from_array(arr, name))
        return name

    n_nodes = draw(st.integers(min_nodes, max_nodes))
    for i in range(n_nodes):
        name, out = f"n{i}", f"v{i}"
        # Prefer recent values so that chains form, but any earlier value may be reused (a DAG).
        pool = list(values)
        a = draw(st.sampled_from(pool[-3:]) if draw(st.booleans()) else st.sampled_from(pool))
        sa = values[a]
        candidates = [op for op in ops if _applicable(op, sa)]
        op = draw(st.sampled_from(candidates))
        attrs: dict = {}
        if op in BINARY:
            if op == "Div":
                b = const(_divisor(draw, _broadcast_partner(draw, sa)))
                ins = [a, b]
            else:
                same = [v for v in values if values[v] == sa]
                if draw(st.booleans()):
                    b = draw(st.sampled_from(same))
                else:
                    b = const(_array(draw, _broadcast_partner(draw, sa)))
                ins = [a, b] if draw(st.booleans()) else [b, a]
            shape = tuple(np.broadcast_shapes(sa, _shape_of(b, values, inits)))
        elif op in UNARY:
            ins, shape = [a], sa
        elif op == "MatMul":
            if len(sa) >= 2 and draw(st.booleans()):
                m = draw(st.integers(1, 4))
                w = const(_array(draw, (m, sa[-2])))
                ins, shape = [w, a], sa[:-2] + (m, sa[-1])
            else:
                n = draw(st.integers(1, 4))
                w = const(_array(draw, (sa[-1], n)))
                ins, shape = [a, w], sa[:-1] + (n,)
        elif op in REDUCE:
            keep = draw(st.sampled_from([0, 1]))
            all_axes = draw(st.integers(0, 4)) == 0
            axes = None if all_axes else sorted(draw(st.lists(st.integers(0, len(sa) - 1), min_size=1,
                                                              max_size=len(sa), unique=True)))
            red = set(range(len(sa))) if axes is None else set(axes)
            shape = tuple((1 if d in red else n) for d, n in enumerate(sa) if keep or d not in red)
            if axes is not None and draw(st.booleans()):
                axes = [ax - len(sa) for ax in axes]  # negative axes count from the end
            attrs["keepdims"] = keep
            axes_as_input = (op == "ReduceSum" and opset >= 13) or (op == "ReduceMean" and opset >= 18)
            if axes is None:
                ins = [a]
            elif axes_as_input:
                ins = [a, const(np.array(axes, np.int64))]
            else:
                ins, attrs["axes"] = [a], axes
        elif op == "Reshape":
            dims = _factor_shape(draw, math.prod(sa))
            ins = [a, const(np.array(dims, np.int64))]
            total = math.prod(sa)
            known = math.prod(d for d in dims if d != -1)
            shape = tuple(total // known if d == -1 else d for d in dims)
        else:  # Transpose
            perm = draw(st.permutations(range(len(sa))))
            if draw(st.integers(0, 3)) == 0:
                perm = list(reversed(range(len(sa))))  # the default, written out or left out
                if draw(st.booleans()):
                    perm = None
            if perm is not None:
                attrs["perm"] = list(perm)
            ins = [a]
            p = perm if perm is not None else list(reversed(range(len(sa))))
            shape = tuple(sa[j] for j in p)
        nodes.append(helper.make_node(op, ins, [out], name=name, **attrs))
        kinds[name] = op
        desc.append(f"{name}={op}({', '.join(ins)}{', ' + str(attrs) if attrs else ''})->{list(shape)}")
        values[out] = shape
        produced.append(out)

    outs = [produced[-1]]
    extra = draw(st.lists(st.sampled_from(produced[:-1]), unique=True, max_size=2)) if len(produced) > 1 else []
    outs += extra
    model = helper.make_model(
        helper.make_graph(
            nodes, "prop",
            [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(s)) for k, s in inputs.items()],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(values[o])) for o in outs],
            initializer=inits),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # what onnxruntime accepts (the newest onnx writes a newer IR by default)
    feeds = {k: _array(draw, s) for k, s in inputs.items()}
    feeds2 = {k: _array(draw, s) for k, s in inputs.items()}
    return Case(model, feeds, feeds2, kinds, {o: values[o] for o in outs}, opset, desc,
                {v: values[v] for v in produced})


def _shape_of(name: str, values: dict, inits: list) -> tuple[int, ...]:
    if name in values:
        return values[name]
    t = next(t for t in inits if t.name == name)
    return tuple(t.dims)


def _applicable(op: str, shape: tuple[int, ...]) -> bool:
    if op == "MatMul" or op in REDUCE:
        return len(shape) >= 1
    if op == "Transpose":
        return len(shape) >= 1
    if op == "Reshape":
        return True
    return True


def elementwise_graphs(**kw):
    """Graphs ExampleEP can take whole (its default op set)."""
    return graphs(ops=BINARY + UNARY + ("MatMul",), **kw)
