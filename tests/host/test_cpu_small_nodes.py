"""Issue 23's per-node cost on the CPU EP at small shapes: the chains and fast paths added for it, each
against onnxruntime, with and without the compiled kernels."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import helper

from host.cpu_ep import native
from host.runtime.session import InferenceSession
from tests.host.test_cpu_speed_paths import _chains, _ephost, _kernels, _model, _ort

F32 = np.float32
TOL = {"rtol": 1e-4, "atol": 1e-5}
LIB = native.LIB


class _Spy:
    """Stands for the library and counts calls per function."""

    def __init__(self, lib):
        self._lib = lib
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


@pytest.fixture(params=["compiled", "numpy"])
def kernels(request):
    """The spy over the compiled kernels, or None with the NumPy paths everywhere."""
    if request.param == "numpy":
        native.use(None)
        yield None
    else:
        if LIB is None:
            pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
        spy = _Spy(LIB)
        native.use(spy)
        yield spy
    native.use(LIB)


def _gelu_mlp(approximate: str, outputs=("y",)):
    """x @ W1 -> Gelu -> @ W2: GPT-2's MLP as the dynamo exporter writes it (opset 20 Gelu)."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((1, 16, 24)).astype(F32)
    weights = {"w1": rng.standard_normal((24, 40)).astype(F32), "w2": rng.standard_normal((40, 24)).astype(F32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc"),
             helper.make_node("Gelu", ["h"], ["g"], approximate=approximate, name="gelu"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="proj")]
    return _model(nodes, {"x": x}, list(outputs), weights, opset=20), {"x": x}


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_matmul_then_gelu_runs_as_one_gemm(kernels, approximate):
    model, feeds = _gelu_mlp(approximate)
    sess = _ephost(model)
    got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)
    assert _chains(sess) == [("_EpilogueChain", ("fc", "gelu"))]
    if kernels is not None:  # the Gelu is the GEMM's epilogue step: no call of its own
        assert kernels.calls == {"ep_gemm": 2}, dict(kernels.calls)


def test_a_gelu_input_that_is_a_graph_output_is_not_joined(kernels):
    model, feeds = _gelu_mlp("tanh", outputs=("y", "h"))
    sess = _ephost(model)
    for got, want in zip(sess.run(None, feeds), _ort(model, feeds)):
        np.testing.assert_allclose(got, want, **TOL)
    assert _chains(sess) == []


# -- memos by shape: a later call of the same shape that the memo does not serve -----------------------


def _run_twice(model, feeds_list, kernels):
    sess = _ephost(model)
    for feeds in feeds_list:
        for got, want in zip(sess.run(None, feeds), _ort(model, feeds)):
            np.testing.assert_allclose(got, want, **TOL)
    return sess


def test_slice_bounds_fed_at_run_time_are_memoized_by_value(kernels):
    """Same input shape, other bounds each run (values repeat, as the shape program's do per signature):
    the memo keys by the bounds' contents, so each run slices where its own bounds say."""
    x = np.arange(4 * 30, dtype=F32).reshape(4, 30)
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    bounds = [(2, 25, 1, 3), (-10, 1000, 1, 1), (2, 25, 1, 3), (29, 0, 1, -2), (1, 3, 0, 1)]
    feeds_list = [{"x": x, "starts": np.array([s], np.int64), "ends": np.array([e], np.int64),
                   "axes": np.array([a], np.int64), "steps": np.array([st], np.int64)} for s, e, a, st in bounds]
    model = _model([node], feeds_list[0], ["y"], {})
    _run_twice(model, feeds_list, kernels)


def test_reshape_targets_fed_at_run_time_are_memoized_by_value(kernels):
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)
    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    targets = [[6, 4], [4, -1], [0, 12], [6, 4], [-1, 8], [3, 8]]
    feeds_list = [{"x": x, "shape": np.array(t, np.int64)} for t in targets]
    model = _model([node], {"x": x, "shape": np.array([6, 4], np.int64)}, ["y"], {})
    sess = _ephost(model)
    for feeds in feeds_list:
        got = sess.run(None, feeds)[0]
        want = _ort(model, feeds)[0]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_layernorm_and_softmax_shapes_seen_before_with_other_operands(kernels):
    """A shape with its compiled call made: then a strided view of that shape (Transpose), and the same
    through the NumPy path, each against onnxruntime."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 8, 8)).astype(F32)
    scale, bias = rng.standard_normal(8).astype(F32), rng.standard_normal(8).astype(F32)
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["ln"]),
             helper.make_node("Softmax", ["x"], ["sm"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("LayerNormalization", ["xt", "scale", "bias"], ["lnt"]),
             helper.make_node("Softmax", ["xt"], ["smt"])]
    model = _model(nodes, {"x": x}, ["ln", "sm", "lnt", "smt"], {"scale": scale, "bias": bias})
    _run_twice(model, [{"x": x}, {"x": rng.standard_normal((2, 8, 8)).astype(F32)}], kernels)


def test_a_matmul_weight_fed_at_run_time_after_the_bound_one(kernels):
    """FusedMatMul's per-shape call is for its bound weight: the same a-shape times a fed weight (another
    node of the same kernel class) and a non-contiguous a compute their own products."""
    rng = np.random.default_rng(23)
    x = rng.standard_normal((1, 16, 16)).astype(F32)
    w = rng.standard_normal((16, 16)).astype(F32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="bound"),
             helper.make_node("MatMul", ["x", "wf"], ["b"], name="fed"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["xt", "w"], ["c"], name="strided")]
    wf = rng.standard_normal((16, 16)).astype(F32)
    model = _model(nodes, {"x": x, "wf": wf}, ["a", "b", "c"], {"w": w})
    _run_twice(model, [{"x": x, "wf": wf}, {"x": x, "wf": rng.standard_normal((16, 16)).astype(F32)}], kernels)


_STRIDED_CASES = {  # op: (input shape, initializers, attributes)
    "MatMul": ((1, 16, 16), {"w": (16, 16)}, {}),
    "LayerNormalization": ((1, 16, 16), {"w": (16,)}, {}),
    "Softmax": ((1, 16, 16), {}, {}),
    "Gemm": ((16, 16), {"w": (24, 16), "c": (24,)}, {"transB": 1}),
    "Conv": ((1, 3, 8, 8), {"w": (4, 3, 2, 2), "c": (4,)}, {"strides": [2, 2]}),  # the patch embedding's path
    "Conv-3x3": ((1, 3, 8, 8), {"w": (4, 3, 3, 3), "c": (4,)}, {}),  # ep_conv2d's
}


@pytest.mark.parametrize("op", sorted(_STRIDED_CASES))
def test_a_strided_input_of_a_shape_seen_before(kernels, op):
    """The per-shape compiled call was made for a C-contiguous input: a strided view of the same shape next
    (feeds arrive dense, so the kernel is called directly) takes the general path, read through its strides."""
    rng = np.random.default_rng(24)
    shape, init_shapes, attrs = _STRIDED_CASES[op]
    op = op.split("-")[0]
    x = rng.standard_normal(shape).astype(F32)
    inits = {name: rng.standard_normal(s).astype(F32) for name, s in init_shapes.items()}
    model = _model([helper.make_node(op, ["x", *inits], ["y"], **attrs)], {"x": x}, ["y"], inits)
    sess = _ephost(model)
    (kernel,) = _kernels(sess, op)
    strided = np.ascontiguousarray(rng.standard_normal(shape[::-1]).astype(F32)).T
    assert not strided.flags.c_contiguous and strided.shape == shape
    bound = [sess.plan.constants[v] for v in sess.plan.nodes[0].inputs[1:]]  # the arrays the kernel bound
    for arg in (x, strided, x):
        got = kernel._run(arg, *bound)[0]
        np.testing.assert_allclose(got, _ort(model, {"x": np.ascontiguousarray(arg)})[0], **TOL)


def test_split_sizes_fed_at_run_time_are_memoized_by_value(kernels):
    x = np.arange(2 * 12, dtype=F32).reshape(2, 12)
    node = helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=1)
    sizes = [(4, 4, 4), (1, 2, 9), (4, 4, 4), (0, 12, 0)]
    feeds_list = [{"x": x, "split": np.array(s, np.int64)} for s in sizes]
    model = _model([node], feeds_list[0], ["a", "b", "c"], {})
    sess = _ephost(model)
    for feeds in feeds_list:
        got, want = sess.run(None, feeds), _ort(model, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_stacked_products_over_views(kernels, dtype):
    """Attention's q k^T and p v as GPT-2 exports them (Transpose views of a split projection), at a size
    NumPy's loop takes straight from the views."""
    rng = np.random.default_rng(25)
    qkv = rng.standard_normal((2, 16, 3, 2, 8)).astype(dtype)
    nodes = [helper.make_node("Split", ["qkv"], ["q5", "k5", "v5"], axis=2, num_outputs=3),
             helper.make_node("Transpose", ["q5"], ["q"], perm=[0, 2, 3, 1, 4]),
             helper.make_node("Transpose", ["k5"], ["kt"], perm=[0, 2, 3, 4, 1]),
             helper.make_node("Transpose", ["v5"], ["v"], perm=[0, 2, 3, 1, 4]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("MatMul", ["s", "v"], ["y"])]
    model = _model(nodes, {"qkv": qkv}, ["y", "s"], {})
    sess = _ephost(model)
    for got, want in zip(sess.run(None, {"qkv": qkv}), _ort(model, {"qkv": qkv})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bias", "no-bias", "relu", "residual", "uneven", "end-padding", "overlap", "images",
                                  "images-residual"])
def test_patch_embedding_convolutions(kernels, case):
    """Windows that tile the image (kernel = stride: ViT's patch embedding) run as one copy and one GEMM;
    an image the windows do not cover exactly, end padding and overlapping windows keep the general path."""
    rng = np.random.default_rng(26)
    size = 30 if case == "uneven" else 32
    x = rng.standard_normal((3 if case.startswith("images") else 1, 3, size, size)).astype(F32)
    inits = {"w": rng.standard_normal((40, 3, 8, 8)).astype(F32)}
    if case != "no-bias":
        inits["b"] = rng.standard_normal(40).astype(F32)
    attrs = {"strides": [4, 4] if case == "overlap" else [8, 8]}
    if case == "end-padding":
        attrs["pads"] = [0, 0, 8, 8]  # a fifth window row and column, over the padding
    nodes = [helper.make_node("Conv", ["x", *inits], ["c"], name="patch", **attrs)]
    if case == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="relu"))
    elif case.endswith("residual"):  # Conv -> Add(another conv's output): the chain's residual operand
        inits["w2"] = rng.standard_normal((40, 3, 8, 8)).astype(F32)
        nodes += [helper.make_node("Conv", ["x", "w2"], ["r"], name="other", **attrs),
                  helper.make_node("Add", ["c", "r"], ["y"], name="residual")]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    model = _model(nodes, {"x": x}, ["y"], inits)
    _run_twice(model, [{"x": x}, {"x": rng.standard_normal(x.shape).astype(F32)}], kernels)
    if kernels is not None and case in ("bias", "no-bias", "relu", "uneven", "images"):
        assert kernels.calls["ep_gemm"] == 2 and not kernels.calls["ep_conv2d"], dict(kernels.calls)
    elif kernels is not None and not case.endswith("residual"):
        assert kernels.calls["ep_conv2d"] == 2, dict(kernels.calls)


# -- joint q, k, v projections with their Attention (fusion_qkv.py) ---------------------------------------


def _qkv_attention(order: str, bias: bool, mask: str, x_read_between: bool = False, fused: bool = True):
    """x -> three projections (written in `order`) -> [an Expand of the mask] -> Attention(q, k, v, mask).
    `fused`: FusedMatMul with its bias (what the optimizer makes); else MatMul + Add (the reference's)."""
    rng = np.random.default_rng(27)
    x = rng.standard_normal((2, 16, 24)).astype(F32)
    inits = {f"w{c}": (rng.standard_normal((24, 24)) / 5).astype(F32) for c in "qkv"}
    if bias:
        inits.update({f"b{c}": rng.standard_normal(24).astype(F32) for c in "qkv"})
    nodes = []
    for c in order:
        if bias and fused:
            nodes.append(helper.make_node("FusedMatMul", ["x", f"w{c}", f"b{c}"], [c], domain="ai.ephost", name=c))
        elif bias:
            nodes += [helper.make_node("MatMul", ["x", f"w{c}"], [f"{c}0"], name=c),
                      helper.make_node("Add", [f"{c}0", f"b{c}"], [c])]
        else:
            nodes.append(helper.make_node("MatMul", ["x", f"w{c}"], [c], name=c))
    inputs = {"x": x}
    if mask != "none":
        m = rng.standard_normal((1, 1, 1, 16)).astype(F32) if mask == "float" else rng.random((1, 1, 1, 16)) > 0.3
        m[..., 0] = True if mask == "bool" else m[..., 0]
        inputs["m"] = m
        inits["mshape"] = np.array([2, 1, 16, 16], np.int64)
        nodes.append(helper.make_node("Expand", ["m", "mshape"], ["mask"], name="expand"))
    if x_read_between:
        nodes.append(helper.make_node("Relu", ["x"], ["xr"], name="between"))
    nodes.append(helper.make_node("Attention", ["q", "k", "v", *(["mask"] if mask != "none" else [])], ["y"],
                                  q_num_heads=3, kv_num_heads=3, name="attention"))
    outputs = ["y", "xr"] if x_read_between else ["y"]
    return _model(nodes, inputs, outputs, inits, opset=23, domains=("ai.ephost",) if fused and bias else ()), inputs


@pytest.mark.parametrize("order", ["qkv", "vqk"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mask", ["none", "float", "bool"])
def test_qkv_projections_join_their_attention(kernels, order, bias, mask):
    from onnx.reference import ReferenceEvaluator

    model, feeds = _qkv_attention(order, bias, mask)
    sess = _ephost(model)
    ref = ReferenceEvaluator(_qkv_attention(order, bias, mask, fused=False)[0])
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-5)
    assert [c[0] for c in _chains(sess)] == ["_QkvAttention"]
    if kernels is not None:  # one GEMM and the attention a run
        assert kernels.calls["ep_gemm"] == 2 and kernels.calls["ep_attention"] == 2, dict(kernels.calls)


def test_qkv_projections_stay_apart_when_their_input_is_read_between():
    from onnx.reference import ReferenceEvaluator

    model, feeds = _qkv_attention("qkv", True, "float", x_read_between=True)
    sess = _ephost(model)
    ref = ReferenceEvaluator(_qkv_attention("qkv", True, "float", x_read_between=True, fused=False)[0])
    for got, want in zip(sess.run(None, feeds), ref.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert _chains(sess) == []


# -- nodes over shape-program values run once per signature (host/runtime/steps/cpu_hoist.py) -----------


def _causal_model(extra_outputs=(), second_product=False):
    """y = x @ causal(seq) where causal = Cast(LessOrEqual(Range(seq), Unsqueeze(Range(seq)))): the ranges are
    shape arithmetic (the shape program's), the [seq, seq] mask a data node over them only."""
    x = helper.make_tensor_value_info("x", 1, ["batch", "seq"])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "one_axis"], ["rc"]),
             helper.make_node("LessOrEqual", ["r", "rc"], ["causal"], name="le"),
             helper.make_node("Cast", ["causal"], ["cf"], to=1, name="cast"),
             helper.make_node("MatMul", ["x", "cf"], ["y"], name="mm")]
    if second_product:  # one more hoisted node (Relu over the mask), read by a second product
        nodes += [helper.make_node("Relu", ["cf"], ["cfr"], name="relu"),
                  helper.make_node("MatMul", ["x", "cfr"], ["y2"], name="mm2")]
    inits = [onnx.numpy_helper.from_array(np.array(v, dtype), name) for name, v, dtype in
             [("one", 1, np.int64), ("zero", 0, np.int64), ("one_axis", [1], np.int64)]]
    outs = [helper.make_tensor_value_info(o, 1 if o != "causal" else 9, None) for o in ["y2" if second_product else "y",
                                                                                           *extra_outputs]]
    for o in outs:
        o.type.tensor_type.shape.SetInParent()
    graph = helper.make_graph(nodes, "g", [x], outs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _hoisted(sess) -> list[str]:
    from host.runtime.steps import CpuSegment

    return [n.name for step, _ in sess.executor.steps if isinstance(step, CpuSegment) and step.hoisted
            for n in step.hoisted.nodes]


def test_nodes_over_shape_values_run_once_per_signature(kernels, monkeypatch):
    model = _causal_model()
    sess = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _hoisted(sess) == ["le", "cast"]
    calls = collections.Counter()
    le = [n.kernel for n in sess.plan.nodes if n.name == "le"][0]
    run = le._run
    monkeypatch.setattr(le, "_run", lambda *a: (calls.update(["le"]), run(*a))[1])
    rng = np.random.default_rng(28)
    for batch, seq in [(1, 16), (2, 5), (1, 16), (2, 5), (3, 16)]:
        feeds = {"x": rng.standard_normal((batch, seq)).astype(F32)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    assert calls["le"] == 3  # per signature of the program's input shapes: (1, 16), (2, 5), (3, 16)


def test_graph_outputs_are_not_hoisted(kernels):
    sess = InferenceSession(_causal_model(extra_outputs=("cf",)).SerializeToString(),
                            providers=["CPUExecutionProvider"])
    assert _hoisted(sess) == ["le"]  # 'cf' is a graph output: the caller may write into it
    model = _causal_model(second_product=True)
    sess = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert _hoisted(sess) == ["le", "cast", "relu"]
    feeds = {"x": np.ones((2, 4), F32)}
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)


def test_nodes_that_may_draw_are_never_hoisted():
    """The rule itself (the CPU EP has no random op besides Dropout, which the optimizer removes): over
    shape values alone, Dropout (training_mode may draw) stays in the loop, a Cast beside it does not."""
    from types import SimpleNamespace

    from host.runtime.steps.cpu_hoist import split_hoisted

    plan = SimpleNamespace(host_computed=frozenset({1}), object_ids=frozenset())
    nodes = [SimpleNamespace(op_type="Dropout", inputs=(1,), outputs=(2, -1)),
             SimpleNamespace(op_type="Cast", inputs=(1,), outputs=(3,)),
             SimpleNamespace(op_type="Mul", inputs=(3, 0), outputs=(4,))]
    hoisted, rest = split_hoisted(nodes, keep=set(), constants={}, plan=plan)
    assert [n.op_type for n in hoisted] == ["Cast"] and [n.op_type for n in rest] == ["Dropout", "Mul"]


def test_a_run_ignores_floating_point_errors_and_restores_the_state():
    """The segment's run enters numpy's "ignore" error state (a division by zero gives inf, as onnxruntime
    does, without a RuntimeWarning) and leaves the caller's state as it was, after a failed run too."""
    import warnings

    from host.errors import KernelError

    x, z = np.array([1.0, -1.0, 0.0, 2.0], F32), np.zeros(4, F32)
    nodes = [helper.make_node("Div", ["x", "z"], ["d"]), helper.make_node("Reshape", ["d", "shape"], ["y"], name="r")]
    feeds = {"x": x, "z": z, "shape": np.array([2, 2], np.int64)}
    model = _model(nodes, feeds, ["y"], {})
    sess = _ephost(model)
    before = np.geterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sess.run(None, feeds)[0]
        with pytest.raises(KernelError, match="^node 'r' \\(Reshape\\) on CPUExecutionProvider failed"):
            sess.run(None, {**feeds, "shape": np.array([3, 3], np.int64)})  # 4 values into 3x3: the kernel fails
    assert np.geterr() == before
    np.testing.assert_array_equal(got, _ort(model, feeds)[0])


# -- a product and the SkipLayerNormalization reading it (fusion_norm.py) ----------------------------------


def _layernorm(s, scale, bias, eps=1e-5):
    s64 = s.astype(np.float64)
    mean = s64.mean(-1, keepdims=True)
    y = (s64 - mean) / np.sqrt(((s64 - mean) ** 2).mean(-1, keepdims=True) + eps) * scale
    return y + bias if bias is not None else y


@pytest.mark.parametrize("product", ["MatMul", "FusedMatMul", "FusedMatMul-Relu"])
@pytest.mark.parametrize("y_first", [True, False])
@pytest.mark.parametrize("two_outputs", [True, False])
def test_a_product_joins_the_skip_layernorm_reading_it(kernels, product, y_first, two_outputs):
    rng = np.random.default_rng(29)
    a, skip = rng.standard_normal((2, 5, 24)).astype(F32), rng.standard_normal((2, 5, 16)).astype(F32)
    inits = {"w": rng.standard_normal((24, 16)).astype(F32), "b": rng.standard_normal(16).astype(F32),
             "gamma": rng.standard_normal(16).astype(F32), "beta": rng.standard_normal(16).astype(F32)}
    op, _, act = product.partition("-")
    attrs = {"domain": "ai.ephost", "activation": act} if op == "FusedMatMul" else {}
    prod_in = ["a", "w", "b"] if op == "FusedMatMul" else ["a", "w"]
    outs = ["y", "sum"] if two_outputs else ["y"]
    norm_in = (["p", "skip"] if y_first else ["skip", "p"]) + ["gamma", "beta"]
    nodes = [helper.make_node(op, prod_in, ["p"], name="prod", **attrs),
             helper.make_node("SkipLayerNormalization", norm_in, outs, domain="ai.ephost", name="norm", epsilon=1e-5)]
    model = _model(nodes, {"a": a, "skip": skip}, outs, inits, domains=("ai.ephost",))
    sess = _ephost(model)
    got = sess.run(None, {"a": a, "skip": skip})
    p = a.astype(np.float64) @ inits["w"] + (inits["b"] if op == "FusedMatMul" else 0)
    p = np.maximum(p, 0) if act == "Relu" else p
    total = p + skip
    np.testing.assert_allclose(got[0], _layernorm(total, inits["gamma"], inits["beta"]), rtol=1e-4, atol=1e-4)
    if two_outputs:
        np.testing.assert_allclose(got[1], total, rtol=1e-5, atol=1e-5)
    assert _chains(sess) == [("_GemmSkipNorm", ("prod", "norm"))]
    if kernels is not None:
        assert kernels.calls == {"ep_gemm": 1, "ep_layernorm": 1}, dict(kernels.calls)


def test_a_product_read_elsewhere_keeps_its_own_step():
    rng = np.random.default_rng(30)
    a, skip = rng.standard_normal((1, 4, 8)).astype(F32), rng.standard_normal((1, 4, 8)).astype(F32)
    inits = {"w": rng.standard_normal((8, 8)).astype(F32), "gamma": rng.standard_normal(8).astype(F32)}
    nodes = [helper.make_node("MatMul", ["a", "w"], ["p"], name="prod"),
             helper.make_node("SkipLayerNormalization", ["p", "skip", "gamma"], ["y"], domain="ai.ephost", name="norm")]
    model = _model(nodes, {"a": a, "skip": skip}, ["y", "p"], inits, domains=("ai.ephost",))
    sess = _ephost(model)
    got = sess.run(None, {"a": a, "skip": skip})
    np.testing.assert_allclose(got[0], _layernorm(a @ inits["w"] + skip, inits["gamma"], None), rtol=1e-4, atol=1e-4)
    assert _chains(sess) == []


@pytest.mark.parametrize("op", ["Identity", "Reshape"])
def test_a_hoisted_value_reaches_the_caller_as_its_own_array(op):
    """A graph output that is a hoisted output passed through (Identity hands on the array itself, Reshape a
    view): the caller gets memory of its own, writeable; writing into it changes nothing the next run reads.
    (Optimization off: the optimizer would drop the Identity.)"""
    from host.optimizer import GraphOptimizationLevel
    from host.runtime.options import SessionOptions

    model = _causal_model()
    model.graph.node.append(helper.make_node(op, ["cf", "flat"] if op == "Reshape" else ["cf"], ["cf_out"], name="out"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"))
    out = helper.make_tensor_value_info("cf_out", 1, None)
    out.type.tensor_type.shape.SetInParent()
    model.graph.output.append(out)
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    assert _hoisted(sess) == ["le", "cast"]
    feeds = {"x": np.ones((2, 4), F32)}
    first = sess.run(None, feeds)
    assert first[1].flags.writeable
    first[1][...] = 7.0
    again = sess.run(None, feeds)
    for got, want in zip(again, _ort(model, feeds)):
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("case", ["fed-targets", "mask-read-elsewhere"])
def test_the_mask_expand_within_a_qkv_join(kernels, case):
    """The join reads the mask before its Expand (the attention broadcasts it): with the Expand's target fed
    at run time (other values each run) and, when the expanded mask is read elsewhere too, with the Expand
    left as its own node."""
    from onnx.reference import ReferenceEvaluator

    def build(fused):
        model, feeds = _qkv_attention("qkv", True, "float", fused=fused)
        if case == "fed-targets":  # the target becomes an input
            inits = [t for t in model.graph.initializer if t.name != "mshape"]
            del model.graph.initializer[:]
            model.graph.initializer.extend(inits)
            model.graph.input.append(helper.make_tensor_value_info("mshape", onnx.TensorProto.INT64, [4]))
        else:
            out = helper.make_tensor_value_info("mask", onnx.TensorProto.FLOAT, None)
            out.type.tensor_type.shape.SetInParent()
            model.graph.output.append(out)
        return model, feeds

    model, feeds = build(True)
    sess = _ephost(model)
    ref = ReferenceEvaluator(build(False)[0])
    targets = [[2, 1, 16, 16], [1, 1, 1, 16], [2, 3, 16, 16], [2, 1, 16, 16]] if case == "fed-targets" else [None]
    for target in targets:
        run_feeds = feeds if target is None else {**feeds, "mshape": np.array(target, np.int64)}
        for got, want in zip(sess.run(None, run_feeds), ref.run(None, run_feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    (names,) = [c[1] for c in _chains(sess)]
    assert ("expand" in names) == (case == "fed-targets"), names
    if case == "fed-targets":  # a mask over 3 images for 2: the Attention node's error, as without the join
        from host.errors import KernelError

        with pytest.raises(KernelError, match="^node 'attention' \\(Attention\\) on CPUExecutionProvider failed"):
            sess.run(None, {**feeds, "mshape": np.array([3, 1, 16, 16], np.int64)})


@pytest.mark.parametrize("trans_b", [1, 0])
def test_a_linear_layers_gemm_and_relu_keep_their_compiled_call_per_shape(trans_b, monkeypatch):
    """torch's Linear as the exporters write it (Gemm with transB=1 over a bound weight and bias) followed
    by Relu: the chain keeps the GEMM's closure for the input's shape, so later runs build nothing (a batch-1
    MLP's layer spent as much in that as in its product); onnxruntime's answers at two shapes. The usual
    run's property: a replay's recording rebuilds the closures once per shape (cpu_replay.py), so it is off."""
    from host.cpu_ep import ops_math
    from host.runtime.steps import cpu_replay

    monkeypatch.setattr(cpu_replay, "ENABLED", False)

    rng = np.random.default_rng(31)
    w = rng.standard_normal((48, 40) if trans_b else (40, 48)).astype(F32)
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=trans_b),
             helper.make_node("Relu", ["h"], ["y"])]
    feeds = {"x": rng.standard_normal((1, 40)).astype(F32)}
    model = _model(nodes, feeds, ["y"], {"w": w, "c": rng.standard_normal(48).astype(F32)})
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    sess = _ephost(model)
    sess.run(None, feeds)
    built = []
    real = ops_math._product
    monkeypatch.setattr(ops_math, "_product", lambda *a, **k: (built.append(1), real(*a, **k))[1])
    for rows in (1, 1, 3, 3):
        x = {"x": rng.standard_normal((rows, 40)).astype(F32)}
        np.testing.assert_allclose(sess.run(None, x)[0], _ort(model, x)[0], **TOL)
    assert len(built) == 1  # the new shape (3, 40) only
