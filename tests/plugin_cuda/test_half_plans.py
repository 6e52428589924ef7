"""Compiled plans in float16 and bfloat16 on a GPU (issue 24 item 2).

- Plans built directly (Plan.build) from the half versions of the plan test models
  (tests/plugin_cuda/half_models.py): every generated kernel kind, GEMMs as generated kernels
  (eager variant) and on cuBLAS (graph variant), Attention's batched GEMMs, a cuDNN convolution,
  and a float32 island between Casts; outputs of the value's own type, within 2e-2 (max |diff| /
  max |ref|) of the ONNX reference evaluator on the float32 model fed the same (half-rounded) inputs.
- Sessions (compiled_plan on): an MLP with Gelu, a transformer block (LayerNorm, attention), a CNN,
  a mixed-precision graph, and the checked-in HF fixtures converted with `ephost convert --precision`
  (host/precision.py): compiled partitions, no per-node CUDA step for the float ops of the small
  models, outputs of the declared type, close to onnxruntime CPU on the float32 model; captured
  with enable_cuda_graph=1 and replayed on new inputs; a dynamic-batch half model at two batch sizes.

Each test appends one line per model to $HALF_PLANS_REPORT when set (gpu_smoke.sh prints them).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from host.cli import zoo
from tests.plugin_cuda.attention_models import attention_feeds
from tests.plugin_cuda.half_models import (
    FLOAT_MODELS,
    HALVES,
    bits_differing,
    fused_chain,
    gelu_mlp,
    mixed_model,
    node_by_node,
    retyped,
    rms_function_body,
)

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
TOL = 2e-2  # issue 24's accuracy goal: max |got - want| / max |want|
PRECISIONS = list(HALVES)

# Plan-level cases (a subset of FLOAT_MODELS: every kernel kind at least once, in both types).
PLAN_CASES = ["mlp-gemv-b1", "mlp-tiled-b32", "mlp-gemm-b4", "mlp-cublas-b256", "gelu-mlp", "transformer",
              "conv-cudnn", "layout-conv-split-deep", "layout-residual-block", "layout-maxpool-3x3-stride2-pad1",
              "layout-avgpool-include-pad-ceil", "layout-global-average-pool", "layout-rotary-3d-partial-interleaved",
              "layout-split-middle-uneven", "layout-concat-axis1-with-constant", "layout-expand-heads",
              "attention-3d-bcast-mask", "attention-4d-gqa-causal-mask", "attention-4d-no-mask", "mixed"]
# Cases with GEMMs, also built as the graph variant (capture=True: cuBLAS for the larger GEMMs).
GEMM_CASES = {"mlp-tiled-b32", "mlp-cublas-b256", "gelu-mlp", "transformer", "attention-3d-bcast-mask", "mixed"}


def report(line: str) -> None:
    path = os.environ.get("HALF_PLANS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def half_dtype(precision: str) -> np.dtype:
    from abi.dtypes import to_numpy

    return to_numpy(HALVES[precision])


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), "non-finite entries differ"
    scale = max(float(np.abs(want[finite]).max(initial=0.0)), 1e-12)
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0) / scale)


def float_model(name: str) -> onnx.ModelProto:
    return mixed_model(TensorProto.FLOAT) if name == "mixed" else FLOAT_MODELS[name]()


def half_model(name: str, precision: str) -> onnx.ModelProto:
    elem = HALVES[precision]
    return mixed_model(elem) if name == "mixed" else retyped(FLOAT_MODELS[name](), elem)


def float_feeds(name: str, model: onnx.ModelProto, seed: int = 0) -> dict:
    if name.startswith("attention"):
        return attention_feeds(model, seed)
    rng = np.random.default_rng(seed)
    return {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
            for vi in model.graph.input}


def reference(model: onnx.ModelProto, feeds: dict) -> list:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def rounded(feeds: dict, dtype) -> tuple[dict, dict]:
    """(half feeds, the same values in float32): the reference sees exactly what the plan reads."""
    half = {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in feeds.items()}
    return half, {k: v.astype(np.float32) if v.dtype == dtype else v for k, v in half.items()}


def run_plan(cp, plan, feeds: list) -> list:
    stream = cp.cuda.Stream(non_blocking=True)
    ins = [cp.asarray(x) for x in feeds]
    # NaN-filled (an output the plan does not write fails the comparison); made in NumPy, which has
    # ml_dtypes' bfloat16, then uploaded.
    outs = [cp.asarray(np.full(plan.prog.values[v].shape, np.nan, plan.prog.values[v].dtype)) for v in plan.prog.outputs]
    cp.cuda.Device().synchronize()
    plan.run(stream.ptr, [a.data.ptr for a in ins], [o.data.ptr for o in outs])
    stream.synchronize()
    return [cp.asnumpy(o) for o in outs]


# ---------------------------------------------------------------------------------------------
# Plans built directly


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", PLAN_CASES)
def test_half_plan_matches_float32_reference(cp, name, precision):
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan

    dtype = half_dtype(precision)
    model32 = float_model(name)
    half, as_float = rounded(float_feeds(name, model32), dtype)
    want = reference(model32, as_float)
    errors = []
    for capture in ([None, True] if name in GEMM_CASES else [None]):
        with Plan.build(spec_from_onnx(half_model(name, precision)), use_tf32=False, capture=capture) as plan:
            got = run_plan(cp, plan, [half[n] for n in plan.input_names])
            kinds = sorted({s.kind for s in (plan.graph.steps if capture else plan.steps)})
        for g, w in zip(got, want):
            assert g.dtype == dtype, f"{name}: output {g.dtype}, declared {dtype}"
            errors.append(relative_error(g.astype(np.float32), w))
        report(f"plan {name} {precision} capture={capture}: steps {kinds} max rel err {max(errors):.2e}")
    assert max(errors) <= TOL, f"{name} {precision}: {errors}"
    if name == "conv-cudnn" and cudnn_usable():
        assert "cudnn_conv" in kinds, f"{name} {precision}: steps {kinds}; the convolution did not go to cuDNN"


def cudnn_usable() -> bool:
    from plugin_cuda.device import cudnn

    return cudnn.usable()


# ---------------------------------------------------------------------------------------------
# Sessions


def plan_counts(session) -> tuple[int, list]:
    """(compiled partitions, per-node CUDA steps with a float output: 'name (op)')."""
    from host.runtime.plan import Kind

    plan = session.plan
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    compiled = sum(1 for n in plan.nodes if n.kind == Kind.COMPILED)
    per_node = [f"{n.name} ({n.op_type})" for n in plan.nodes
                if n.kind == Kind.PLUGIN and any(plan.elem_types[v] in floats for v in n.outputs if v >= 0)]
    return compiled, per_node


SESSION_MODELS = {
    "gelu-mlp": gelu_mlp,
    "transformer": lambda: zoo.transformer_block(batch=2, seq=16, hidden=64, heads=4, ffn=128, opset=20),
    "cnn": lambda: zoo.cnn(batch=2),
}


def session_models(precision: str) -> dict:
    """name -> (float32 model, half model): `ephost convert` of the small models, and the mixed model."""
    from host.precision import convert_precision

    out = {name: (make(), convert_precision(make(), precision)) for name, make in SESSION_MODELS.items()}
    out["mixed"] = (mixed_model(TensorProto.FLOAT), mixed_model(HALVES[precision]))
    return out


def check_session(name, precision, model32, model, feeds, genv, whole: bool, options=None) -> None:
    """Run `model` (half) in a CUDA session with compiled plans and check it against onnxruntime CPU on
    `model32` with the same half-rounded inputs."""
    import onnxruntime

    from abi.dtypes import to_numpy
    from host.runtime.session import InferenceSession

    dtype = half_dtype(precision)
    half, as_float = rounded(feeds, dtype)
    ort = onnxruntime.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"])
    want = ort.run(None, as_float)
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"use_tf32": "0", **(options or {})})],
                               env=genv)
    half = {k: v for k, v in half.items() if k in {i.name for i in session.get_inputs()}}
    got = session.run(None, half)
    compiled, per_node = plan_counts(session)
    errors = []
    for out, g, w in zip(model.graph.output, got, want):
        declared = to_numpy(out.type.tensor_type.elem_type)
        assert g.dtype == declared, f"{name} {precision} {out.name}: {g.dtype}, declared {declared}"
        if np.asarray(w).dtype == np.float32:
            errors.append(relative_error(np.asarray(g, np.float32), w))
    report(f"session {name} {precision}: {compiled} compiled partitions, {len(per_node)} per-node float steps"
           f"{' ' + str(per_node[:6]) if per_node else ''}, max rel err {max(errors):.2e}")
    assert compiled >= 1, f"{name} {precision}: no compiled partition"
    if whole:
        assert per_node == [], f"{name} {precision}: per-node float steps {per_node}"
    assert max(errors) <= TOL, f"{name} {precision}: {errors}"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", [*SESSION_MODELS, "mixed"])
def test_half_session_runs_in_compiled_partitions(cp, genv, name, precision):
    model32, model = session_models(precision)[name]
    check_session(name, precision, model32, model, zoo.random_inputs(model32, seed=1), genv, whole=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_intermediates_round_as_the_nodes_would_on_the_gpu(cp, genv, precision):
    """One generated kernel for four half nodes gives the node-by-node bits (nvcc would contract
    x * a + b into one FMA without the rounding between them)."""
    from host.runtime.session import InferenceSession

    model = fused_chain(HALVES[precision])
    x = np.random.default_rng(3).uniform(-4, 4, (8, 16)).astype(half_dtype(precision))
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {})], env=genv)
    compiled, per_node = plan_counts(session)
    assert compiled == 1 and per_node == []
    (got,) = session.run(None, {"X": x})
    np.testing.assert_array_equal(got.view(np.uint16), node_by_node(model, x).view(np.uint16))


def rms_model(elem: int, scale: np.ndarray) -> onnx.ModelProto:
    node = onnx.helper.make_node("RMSNormalization", ["X", "S"], ["Y"], name="rms", epsilon=1e-5)
    graph = onnx.helper.make_graph([node], "rms", [onnx.helper.make_tensor_value_info("X", elem, [32, 256])],
                                   [onnx.helper.make_tensor_value_info("Y", elem, [32, 256])],
                                   [onnx.numpy_helper.from_array(scale, "S")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])


@pytest.mark.parametrize("compiled_plan", ["1", "0"], ids=["plan", "per-node"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_rms_normalization_rounds_the_normalised_value(cp, genv, precision, compiled_plan):
    """RMSNormalization's function body rounds x / rms to X's type before the scale, on both paths
    (one rounding instead changes ~25% of the elements' bits)."""
    from host.runtime.session import InferenceSession

    rng = np.random.default_rng(5)
    dtype = half_dtype(precision)
    x = rng.standard_normal((32, 256)).astype(dtype)
    scale = rng.uniform(0.5, 2, 256).astype(dtype)
    model = rms_model(HALVES[precision], scale)
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"compiled_plan": compiled_plan})],
                               env=genv)
    assert plan_counts(session) == ((1, []) if compiled_plan == "1" else (0, ["rms (RMSNormalization)"]))
    (got,) = session.run(None, {"X": x})
    assert got.dtype == dtype
    assert bits_differing(got, rms_function_body(x, scale, 1e-5)) <= 0.01


@pytest.mark.parametrize("compiled_plan", ["1", "0"], ids=["plan", "per-node"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_rotary_products_round_as_the_function_body_on_the_gpu(cp, genv, precision, compiled_plan):
    """RotaryEmbedding multiplies in X's type (its function body): the reference evaluator's bits."""
    from onnx.reference import ReferenceEvaluator

    from host.runtime.session import InferenceSession
    from tests.plugin_cuda.layout_models import CASES as LAYOUT_CASES
    from tests.plugin_cuda.layout_models import feeds

    dtype = half_dtype(precision)
    model = retyped(LAYOUT_CASES["rotary-4d"](), HALVES[precision])
    inputs = {k: v.astype(dtype) for k, v in feeds(model).items()}
    # A session's checker wants the output's shape, which the plan tests' one-node models leave out.
    model.graph.output[0].CopyFrom(onnx.helper.make_tensor_value_info("Y0", HALVES[precision], inputs["X"].shape))
    (want,) = ReferenceEvaluator(model).run(None, inputs)
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"compiled_plan": compiled_plan})],
                               env=genv)
    assert plan_counts(session)[0] == (1 if compiled_plan == "1" else 0)
    (got,) = session.run(None, inputs)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want, dtype).view(np.uint16))


HF_MODELS = ["bert_torchscript", "llama_dynamo"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", HF_MODELS)
def test_converted_fixture_runs_in_compiled_partitions(cp, genv, name, precision):
    from tests.plugin_cuda.test_half_kernels import converted

    path, model, feeds = converted(name, precision)
    check_session(name, precision, onnx.load(str(path)), model, feeds, genv, whole=False)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["transformer", "cnn", "bert_torchscript"])
def test_half_plans_capture_and_replay(cp, genv, name, precision):
    import onnxruntime

    from host.runtime.session import InferenceSession
    from tests.plugin_cuda.test_half_kernels import converted
    from tests.plugin_cuda.test_real_models import new_feeds

    dtype = half_dtype(precision)
    if name in SESSION_MODELS:
        model32, model = session_models(precision)[name]
        feeds = zoo.random_inputs(model32, seed=2)
    else:
        path, model, feeds = converted(name, precision)
        model32 = onnx.load(str(path))
    ort = onnxruntime.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"])
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"use_tf32": "0", "enable_cuda_graph": "1"})],
                               env=genv)
    names = [o.name for o in session.get_outputs()]
    binding = session.io_binding()
    first, first32 = rounded(feeds, dtype)
    ins = {k: cp.asarray(v) for k, v in first.items()}
    outs = None
    errors = []
    for half, as_float in [(first, first32), rounded(new_feeds(feeds, seed=3), dtype)]:
        want = ort.run(None, as_float)
        if outs is None:
            outs = [cp.zeros(w.shape, dtype if w.dtype == np.float32 else w.dtype) for w in want]
            for key, arr in ins.items():
                binding.bind_input(key, arr)
            for key, arr in zip(names, outs):
                binding.bind_output(key, arr)
        else:
            for key, v in half.items():
                ins[key][...] = cp.asarray(v)
        cp.cuda.get_current_stream().synchronize()
        session.run_with_iobinding(binding)
        cp.cuda.get_current_stream().synchronize()
        for got, w in zip(outs, want):
            if w.dtype == np.float32:
                errors.append(relative_error(cp.asnumpy(got).astype(np.float32), w))
    compiled, _ = plan_counts(session)
    captured = session.fallbacks["graph_captured"]
    report(f"replay {name} {precision}: {compiled} compiled partitions, captured {captured}, "
           f"max rel err (capture run, replay) {max(errors):.2e}")
    assert compiled >= 1 and captured == 1, f"{name} {precision}: {compiled} partitions, {dict(session.fallbacks)}"
    assert max(errors) <= TOL, f"{name} {precision}: {errors}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dynamic_batch_half_plan_at_two_shapes(cp, genv, precision):
    from host.precision import convert_precision

    model32 = zoo.mlp(layers=2, hidden=64, batch=1, dynamic_batch=True)
    model = convert_precision(model32, precision)
    for batch in (3, 10):
        feeds = zoo.random_inputs(model32, seed=batch, sizes={"batch": batch})
        check_session(f"mlp-dynamic-batch{batch}", precision, model32, model, feeds, genv, whole=True)
