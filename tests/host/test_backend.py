"""onnx's backend node tests through host.runtime.backend.EphostBackend, for every op the CPU EP registers.

Where the data comes from: this onnx (1.23) ships no node test data files
(onnx/backend/test/data/node does not exist); `onnx.backend.test.loader.load_model_tests(kind="node")`
collects the node test cases in memory instead (onnx.backend.test.case.node: model, inputs and expected
outputs), and BackendTest runs them from memory (`prepare(model).run(inputs)`), so nothing is generated
on disk. Outputs are compared by onnx's runner (dtype, shape, then np.testing.assert_allclose) with each
case's own tolerances: onnx's default rtol 1e-3 / atol 1e-7, looser where a case says so.

Which tests run: `include` patterns `^test_<prefix>_` built from `host.cpu_ep.supported_ops()` (op types
mapped to onnx's snake_case test names, TEST_PREFIXES), minus EXCLUDED, each pattern with its reason;
only the CPU device (`_cpu`) variants are kept. Models whose default opset is outside ephost's window
(7..23) are excluded from BackendTest; those whose ops have the same schema at the nearest opset of the
window (same inputs, outputs, attributes and documentation; only type lists differ) are run again by
`test_node_retargeted`, with the opset import moved into the window.

`python -m tests.host.test_backend` prints the summary (counts by reason and per op).
"""

from __future__ import annotations

import gc
import re
import warnings
from collections import Counter
from functools import lru_cache

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx import TensorProto, helper
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

import host
from host import cpu_ep
from host.errors import InvalidArgument
from host.runtime.backend import EphostBackend, EphostBackendRep
from host.runtime.model import MAX_OPSET, MIN_OPSET

# ---- which node tests belong to which op ---------------------------------------------------------------
# onnx names a node test test_<name>_<variant>; <name> is the op type in lower case unless listed here.
TEST_PREFIXES: dict[str, tuple[str, ...]] = {
    "And": ("and", r"and\dd"),           # test_and2d, test_and_bcast3v1d, ...
    "Or": ("or", r"or\dd"),
    "Xor": ("xor", r"xor\dd"),
    "BatchNormalization": ("batchnorm",),
    "Conv": ("conv", "basic_conv"),      # test_basic_conv_with_padding, test_conv_with_strides_padding, ...
    "Dropout": ("dropout", "training_dropout"),
    "GreaterOrEqual": ("greater_equal",),
    "LessOrEqual": ("less_equal",),
    "LayerNormalization": ("layer_normalization",),
    "Pad": ("constant_pad", "edge_pad", "reflect_pad", "wrap_pad"),
    "Trilu": ("tril", "triu"),
    "GatherElements": ("gather_elements",),
    "GatherND": ("gathernd",),
    "ScatterND": ("scatternd",),
    "ScatterElements": ("scatter_elements",),
    "TopK": ("top_k",),
    "RMSNormalization": ("rms_normalization",),
    "RotaryEmbedding": ("rotary_embedding",),
    "Loop": (r"loop\d+",),                 # test_loop11, test_loop13_seq, test_loop16_seq_none
    "Scan": ("scan", r"scan\d+"),           # test_scan_sum (Scan-8), test_scan9_sum
    "OptionalGetElement": ("optional_get_element",),
    "OptionalHasElement": ("optional_has_element",),
    "SequenceInsert": ("sequence_insert",),
    "SequenceMap": ("sequence_map",),
    "SplitToSequence": ("split_to_sequence",),
}
# Registered ops that onnx has no node test of their own for (covered by tests/host/test_sequences.py).
NO_NODE_TESTS = {"ConcatFromSequence", "Optional", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
                 "SequenceLength"}


def prefixes_of(op_type: str) -> tuple[str, ...]:
    if op_type in TEST_PREFIXES:
        return TEST_PREFIXES[op_type]
    if op_type.startswith("Reduce"):  # ReduceSumSquare -> reduce_sum_square
        return (re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op_type).lower(),)
    return (op_type.lower(),)


SUPPORTED_OPS = [op for domain, op in cpu_ep.supported_ops() if domain == ""]
_PREFIX_RE = {op: [re.compile(rf"^test_{p}_") for p in prefixes_of(op)] for op in SUPPORTED_OPS}


def op_of(test_name: str) -> str | None:
    """The registered op a node test belongs to: the one with the longest matching prefix."""
    best, best_len = None, -1
    for op, pats in _PREFIX_RE.items():
        for pat in pats:
            m = pat.match(test_name)
            if m and m.end() > best_len:
                best, best_len = op, m.end()
    return best


# ---- exclusions: (pattern, reason); the first matching pattern gives a test's reason ------------------
STRINGS = "string tensors: ephost has no string element type"
BOTH_FAIL = ("fails on onnxruntime too: onnx's runner compares the expected sequence of differently shaped "
             "tensors through np.array and raises 'Unable to compare expected type'")
NOT_REGISTERED = "an op the CPU EP does not register, whose test name starts with a registered op's prefix"
NARROW_TYPES = "bfloat16 / float8 / float4 / int4 / int2 element types: not in ephost's dtype table (abi/dtypes.py)"
FP16_BODY = ("float16 function body: each float16 intermediate rounds differently from the float32 reference, "
             "beyond onnx's rtol 1e-3 (the fused Attention kernel passes its float16 test)")
OPSET = f"model's default opset is outside ephost's window {MIN_OPSET}..{MAX_OPSET} (host/runtime/model.py)"

EXCLUDED: list[tuple[str, str]] = [
    (r"^test_equal_string", STRINGS),                         # Equal on string tensors
    (r"^test_loop16_seq_none", BOTH_FAIL),                    # a ragged sequence output
    # Cast/CastLike to or from BFLOAT16, FLOAT8E4M3FN(UZ), FLOAT8E5M2(FNUZ), FLOAT8E8M0, FLOAT4E2M1, (U)INT4, (U)INT2
    (r"^test_cast(like)?_.*(BFLOAT16|FLOAT8E|FLOAT4E2M1|INT4|INT2)", NARROW_TYPES),
    (r"^test_range_bfloat16_", NARROW_TYPES),                 # Range on bfloat16
    (r"^test_attention_.*bf16", NARROW_TYPES),                # Attention on bfloat16
    (r"^test_(einsum|onehot)_.*bfloat16", NARROW_TYPES),      # Einsum, OneHot on bfloat16
    (r"^test_attention_4d_causal_fp16_expanded_", FP16_BODY),  # Attention's function body in float16
    # Every remaining test below uses a default opset past 23 (or, for Not, opset 1) in this onnx:
    (r"^test_cast_", OPSET),                                  # Cast-28
    (r"^test_castlike_", OPSET),                              # CastLike-25 (expanded: Cast-25)
    (r"^test_optional_", OPSET),                              # OptionalHasElement / OptionalGetElement at 28
    (r"^test_split_to_sequence_", OPSET),                     # SplitToSequence-24
    (r"^test_identity_sequence_", OPSET),                     # Identity-25
    (r"^test_constant_(cpu|cuda)$", OPSET),                   # Constant-25
    (r"^test_constantofshape_", OPSET),                       # ConstantOfShape-25
    (r"^test_(constant|edge|reflect|wrap)_pad_", OPSET),      # Pad-25
    (r"^test_flatten_", OPSET),                               # Flatten-25
    (r"^test_identity_(cpu|cuda)$", OPSET),                   # Identity-25
    (r"^test_not_", OPSET),                                   # Not at opset 1 (below the window)
    (r"^test_top_k_", OPSET),                                 # TopK-24
    (r"^test_einsum_", OPSET),                                # Einsum-28
    (r"^test_mod_", OPSET),                                   # Mod-28
    (r"^test_onehot_", OPSET),                                # OneHot-28
    # Attention-24 (nonpad_kv_seqlen, causal with a KV cache) and Attention-25 (sliding windows):
    (r"^test_attention_(24_|causal_boolmask|(3d_)?local_window|bidirectional_window)", OPSET),
    (r"^test_attention_4d_.*(padded_kv|nonpad|causal_with_past_and_present)", OPSET),
    (r"^test_range_", OPSET),                                 # Range-27 (expanded: Cast-25 and Loop)
    (r"^test_reduce_log_sum_", OPSET),                        # ReduceLogSum-28, ReduceLogSumExp-28
    (r"^test_reshape_", OPSET),                               # Reshape-25
    (r"^test_shape_", OPSET),                                 # Shape-25
    (r"^test_size_", OPSET),                                  # Size-25
    (r"^test_squeeze_", OPSET),                               # Squeeze-25
    (r"^test_transpose_", OPSET),                             # Transpose-25
    (r"^test_unsqueeze_", OPSET),                             # Unsqueeze-25
]

def _as_array(x) -> np.ndarray:
    """A case's input or output as an array (cases hold arrays, NumPy scalars or TensorProtos); a
    sequence (list) or an empty optional (None) stays as it is."""
    if x is None or isinstance(x, list):
        return x
    return onnx.numpy_helper.to_array(x) if isinstance(x, TensorProto) else np.asarray(x)




def exclusion_reason(test_name: str) -> str | None:
    for pattern, reason in EXCLUDED:
        if re.search(pattern, test_name):
            return reason
    return None


# ---- the onnx backend test suite ----------------------------------------------------------------------
with warnings.catch_warnings():  # collecting the cases runs their numpy generators (overflow warnings)
    warnings.simplefilter("ignore", RuntimeWarning)
    NODE_CASES = {tc.name + "_cpu": tc for tc in load_model_tests(kind="node")}
    backend_test = onnx.backend.test.BackendTest(EphostBackend, __name__)

for _op in SUPPORTED_OPS:
    for _p in prefixes_of(_op):
        backend_test.include(rf"^test_{_p}_")
for _pattern, _reason in EXCLUDED:
    backend_test.exclude(_pattern)  # the reason is the pattern's entry in EXCLUDED

INCLUDED = sorted(name for name in NODE_CASES if op_of(name) is not None)
RUN = [name for name in INCLUDED if exclusion_reason(name) is None]

OnnxBackendNodeModelTest = backend_test.test_cases["OnnxBackendNodeModelTest"]
# Keep the CPU variants of the included tests (excluded ones stay, reported as skipped with their pattern);
# drop the rest (other ops, and the _cuda variants, which this backend skips).
for _name in [n for n in vars(OnnxBackendNodeModelTest) if n.startswith("test_")]:
    if _name not in INCLUDED:
        delattr(OnnxBackendNodeModelTest, _name)
globals().update({"OnnxBackendNodeModelTest": OnnxBackendNodeModelTest})


# ---- opset-excluded tests whose ops are unchanged at the nearest opset of the window --------------------
def _signature(schema) -> tuple:
    attrs = sorted((k, a.type, a.required, a.default_value.SerializeToString()) for k, a in schema.attributes.items())
    return (attrs, [(i.name, i.option, i.type_str) for i in schema.inputs],
            [(o.name, o.option, o.type_str) for o in schema.outputs], schema.doc)


def retargeted(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """`model` with its default opset moved into the window, or None when any op's schema differs there
    in more than its type lists (signature or documentation)."""
    version = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    target = min(max(version, MIN_OPSET), MAX_OPSET)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            return None
        try:
            a = onnx.defs.get_schema(node.op_type, version, "")
            b = onnx.defs.get_schema(node.op_type, target, "")
        except onnx.defs.SchemaError:
            return None
        if a.since_version != b.since_version and _signature(a) != _signature(b):
            return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = target
    return out


@lru_cache(maxsize=1)
def retargetable() -> tuple[str, ...]:
    return tuple(name for name in INCLUDED
                 if exclusion_reason(name) == OPSET and retargeted(NODE_CASES[name].model) is not None)


def run_case(name: str, model: onnx.ModelProto | None = None, **prepare_kwargs) -> EphostBackendRep:
    """Runs node test `name` (optionally on another model) and compares as onnx's runner does."""
    tc = NODE_CASES[name]
    rep = EphostBackend.prepare(model if model is not None else tc.model, **prepare_kwargs)
    for inputs, ref_outputs in tc.data_sets:
        outputs = rep.run([_as_array(x) for x in inputs])
        Runner.assert_similar_outputs([_as_array(x) for x in ref_outputs], outputs, rtol=tc.rtol, atol=tc.atol)
    return rep


@pytest.mark.parametrize("name", retargetable())
def test_node_retargeted(name):
    run_case(name, retargeted(NODE_CASES[name].model))


# ---- the summary ------------------------------------------------------------------------------------
def summary() -> dict:
    excluded = Counter(exclusion_reason(n) for n in INCLUDED if exclusion_reason(n))
    covered = {op_of(n) for n in (*RUN, *retargetable())}
    return {
        "ops": len(SUPPORTED_OPS),
        "included": len(INCLUDED),
        "run": len(RUN),
        "expanded": sum(n.endswith("_expanded_cpu") for n in RUN),
        "excluded": dict(excluded),
        "retargeted": len(retargetable()),
        "ops_covered": len(covered),
        "ops_without_test": sorted(set(SUPPORTED_OPS) - covered),
        "per_op": dict(sorted(Counter(op_of(n) for n in RUN).items())),
    }


def format_summary() -> str:
    s = summary()
    lines = [f"onnx {onnx.__version__} node tests for the {s['ops']} ops of the CPU EP: {s['included']} tests "
             f"match their prefixes; {s['run']} run through BackendTest ({s['expanded']} of them *_expanded "
             f"function bodies), all expected to pass;",
             f"{sum(s['excluded'].values())} excluded:"]
    lines += [f"  {count:4d}  {reason}" for reason, count in s["excluded"].items()]
    lines.append(f"{s['retargeted']} of the opset-excluded ones run again with their opset moved into the window "
                 "(test_node_retargeted).")
    lines.append(f"Ops with at least one running node test: {s['ops_covered']} of {s['ops']}; without: "
                 + ", ".join(s["ops_without_test"]))
    return "\n".join(lines)


def test_conformance_summary():
    s = summary()
    print("\n" + format_summary())
    assert s["run"] > 0 and s["ops_covered"] > 0


def test_every_registered_op_has_node_tests():
    """Each registered op matches at least one onnx node test (the prefix table is right)."""
    names = set(NODE_CASES)
    missing = [op for op in SUPPORTED_OPS if op not in NO_NODE_TESTS and not any(op_of(n) == op for n in names)]
    assert not missing, f"no onnx node test name matches {missing}; fix TEST_PREFIXES"


def test_included_tests_use_their_op():
    """A test attributed to an op contains that op (function-expanded variants run its body instead)."""
    wrong = []
    for name in INCLUDED:
        if "_expanded" in name or exclusion_reason(name) == NOT_REGISTERED:
            continue
        if op_of(name) not in {n.op_type for n in NODE_CASES[name].model.graph.node}:
            wrong.append((name, op_of(name)))
    assert not wrong, wrong


def test_every_exclusion_is_used():
    """No stale pattern: each exclusion is the first match of at least one included test."""
    firsts = Counter(next(p for p, _ in EXCLUDED if re.search(p, n)) for n in INCLUDED if exclusion_reason(n))
    assert set(firsts) == {p for p, _ in EXCLUDED}


def test_opset_exclusions_are_outside_the_window():
    for name in INCLUDED:
        if exclusion_reason(name) == OPSET:
            version = next(o.version for o in NODE_CASES[name].model.opset_import if o.domain in ("", "ai.onnx"))
            assert not MIN_OPSET <= version <= MAX_OPSET, name


# ---- the backend API itself ------------------------------------------------------------------------------
def _add_relu_model(opset: int = 17) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3])
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["x", "y"], ["s"], name="add"), helper.make_node("Relu", ["s"], ["r"], name="relu")]
    return helper.make_model(helper.make_graph(nodes, "add_relu", [x, y], [s, r]),
                             opset_imports=[helper.make_opsetid("", opset)])


@pytest.fixture
def xy():
    rng = np.random.default_rng(7)
    return rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)


@pytest.mark.parametrize("form", ["proto", "bytes", "path"])
def test_prepare_accepts_proto_bytes_and_path(form, xy, tmp_path):
    model = _add_relu_model()
    if form == "bytes":
        model = model.SerializeToString()
    elif form == "path":
        onnx.save(model, tmp_path / "m.onnx")
        model = str(tmp_path / "m.onnx")
    rep = EphostBackend.prepare(model)
    x, y = xy
    out = rep.run([x, y])
    np.testing.assert_array_equal(out[0], x + y)
    np.testing.assert_array_equal(out["r"], np.maximum(x + y, 0))
    np.testing.assert_array_equal(out.s, x + y)
    assert rep.input_names == ["x", "y"] and rep.output_names == ["s", "r"]


def test_rep_run_by_name_and_subset(xy):
    x, y = xy
    rep = EphostBackend.prepare(_add_relu_model())
    out = rep.run({"y": y, "x": x}, output_names=["r"])
    assert len(out) == 1
    np.testing.assert_array_equal(out[0], np.maximum(x + y, 0))


def test_rep_run_wrong_input_count(xy):
    rep = EphostBackend.prepare(_add_relu_model())
    with pytest.raises(InvalidArgument, match="2 input"):
        rep.run([xy[0]])


def test_run_model_and_run_node(xy):
    x, y = xy
    out = EphostBackend.run_model(_add_relu_model(), [x, y])
    np.testing.assert_array_equal(out[1], np.maximum(x + y, 0))
    node = helper.make_node("Gemm", ["a", "b"], ["c"], transB=1)
    a, b = np.ones((2, 3), np.float32), np.arange(12, dtype=np.float32).reshape(4, 3)
    (c,) = EphostBackend.run_node(node, [a, b])
    np.testing.assert_allclose(c, a @ b.T)
    (c,) = EphostBackend.run_node(node, {"a": a, "b": b}, opset_version=11, outputs_info=[(np.float32, (2, 4))])
    np.testing.assert_allclose(c, a @ b.T)


def test_run_node_checks_the_node():
    with pytest.raises(onnx.checker.ValidationError):
        EphostBackend.run_node(helper.make_node("Add", ["a"], ["c"]), [np.ones(2, np.float32)])


def test_devices_and_compatibility():
    assert EphostBackend.supports_device("CPU")
    assert not EphostBackend.supports_device("CUDA")
    assert not EphostBackend.supports_device("TPU")
    assert EphostBackend.is_compatible(_add_relu_model(17))
    assert not EphostBackend.is_compatible(_add_relu_model(17), device="CUDA")
    assert not EphostBackend.is_compatible(_add_relu_model(MAX_OPSET + 1))
    with pytest.raises(InvalidArgument, match="device 'CUDA'"):
        EphostBackend.prepare(_add_relu_model(), device="CUDA")


def test_providers_are_passed_to_the_session(xy):
    rep = EphostBackend.prepare(_add_relu_model(), providers=["CPUExecutionProvider"])
    assert rep.session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(InvalidArgument, match="not registered"):
        EphostBackend.prepare(_add_relu_model(), providers=["NoSuchExecutionProvider"])


# ---- node tests through a plugin EP (the example plugin claims float Add/Sub/Mul/Div/Relu/Sigmoid/MatMul) ----
PLUGIN_OPS = {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "MatMul"}
_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)
PLUGIN_CASES = [n for n in RUN if op_of(n) in PLUGIN_OPS and "_expanded" not in n
                and all(i.type.tensor_type.elem_type in _FLOATS for i in NODE_CASES[n].model.graph.input)]


@pytest.fixture(scope="module")
def example_env(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(5))
    yield env
    gc.collect()
    env.close()


@pytest.mark.parametrize("name", PLUGIN_CASES)
def test_node_through_plugin(name, example_env):
    rep = run_case(name, providers=["ExampleEP"], env=example_env)
    assert set(rep.session.node_assignment().values()) == {"ExampleEP"}
    rep.close()


def test_backend_rep_through_plugin(example_env, xy):
    x, y = xy
    rep = EphostBackend.prepare(_add_relu_model(), providers=[("ExampleEP", {"ops": "Relu"})], env=example_env)
    assert rep.session.node_assignment() == {"add": "CPUExecutionProvider", "relu": "ExampleEP"}
    np.testing.assert_array_equal(rep.run([x, y]).r, np.maximum(x + y, 0))
    rep.close()


if __name__ == "__main__":
    print(format_summary())


def test_a_0d_feed_keeps_its_rank():
    """A rank-0 input takes a 0-d array and gives 0-d outputs (np.ascontiguousarray would make it (1,))."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    (out,) = EphostBackend.prepare(model).run([np.array(1.5, np.float32)])
    assert out.shape == () and out == np.float32(-1.5)
