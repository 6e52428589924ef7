"""Range lengths from shape arithmetic (host/runtime/range_lengths.py), against onnxruntime.

Random chains of the integer shape ops exporters write between a Shape and a Range (Shape with
start/end, Gather by a scalar or a list, Slice with and without axes/steps, Concat, Unsqueeze,
Squeeze, Cast, Identity, Add/Sub/Mul with broadcasting, Constant and initializer operands) end in
`Range(start, limit, 1)`. After `range_lengths.annotate` (the path with symbolic shapes off) and
`symbolic_shapes.annotate` (the default path, which reuses range_lengths' followers), ONNX shape
inference must know the Range's length as a dim over the input symbols wherever the chain allows
it (start 0, or a constant length), and that dim, computed at random input sizes, must equal the
length onnxruntime gives. A model with no Range, or one whose lengths cannot be named, comes back
as the same object.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper, shape_inference

from host.runtime import dims, range_lengths, symbolic_shapes

SYMBOLS = {"s0", "s1"}
X_SHAPE = ["s0", "s1", 3]


class _Builder:
    """A graph under construction; each int value is kept with its length (0: a scalar)."""

    def __init__(self, draw, as_initializer: bool):
        self.draw, self.nodes, self.inits, self.values, self.n = draw, [], [], {}, 0
        self.as_initializer = as_initializer

    def name(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def node(self, op, inputs, length, **attrs) -> str:
        out = self.name()
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        self.values[out] = length
        return out

    def const(self, values, scalar=False) -> str:
        """An int64 operand, as a Constant node or an initializer (the follower reads both)."""
        arr = np.array(values[0] if scalar else values, dtype=np.int64)
        out = self.name()
        if self.as_initializer:
            self.inits.append(numpy_helper.from_array(arr, out))
        else:
            self.nodes.append(helper.make_node("Constant", [], [out], value=numpy_helper.from_array(arr)))
        return out

    def pick(self, want=None) -> str:
        names = [k for k, n in self.values.items() if want is None or want(n)]
        return self.draw(st.sampled_from(names))


def _shape(b: _Builder) -> None:
    start = b.draw(st.integers(0, 2))
    end = b.draw(st.integers(start + 1, 3))
    if start == 0 and end == 3 and b.draw(st.booleans()):
        b.node("Shape", ["X"], 3)
    else:
        b.node("Shape", ["X"], end - start, start=start, end=end)


def _step(b: _Builder) -> None:
    draw = b.draw
    op = draw(st.sampled_from(["Shape", "Gather", "Gather1", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast",
                               "Identity", "Add", "Sub", "Mul"]))
    if op == "Squeeze" and 1 not in b.values.values():
        op = "Unsqueeze"  # a length-1 value to squeeze is made first
    vec = b.pick(lambda n: n > 0)
    n = b.values[vec]
    if op == "Shape":
        _shape(b)
    elif op == "Gather":  # a scalar index: a scalar
        b.node("Gather", [vec, b.const([draw(st.integers(0, n - 1))], scalar=True)], 0, axis=0)
    elif op == "Gather1":  # a list of indices
        idx = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))
        b.node("Gather", [vec, b.const(idx)], len(idx))
    elif op == "Slice":
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        step = draw(st.sampled_from([None, 1, 2]))
        ins = [vec, b.const([start]), b.const([end])]
        if step is not None or draw(st.booleans()):
            ins.append(b.const([0]))
        if step is not None:
            ins.append(b.const([step]))
        b.node("Slice", ins, len(range(start, end, step or 1)))
    elif op == "Concat":
        others = [b.pick(lambda m: m > 0) for _ in range(draw(st.integers(1, 2)))]
        b.node("Concat", [vec, *others], n + sum(b.values[o] for o in others), axis=0)
    elif op == "Unsqueeze":
        b.node("Unsqueeze", [b.pick(lambda m: m == 0), b.const([0])], 1)
    elif op == "Squeeze":
        b.node("Squeeze", [b.pick(lambda m: m == 1), b.const([0])], 0)
    elif op in ("Cast", "Identity"):
        b.node(op, [vec], n, **({"to": TensorProto.INT64} if op == "Cast" else {}))
    else:
        other = b.pick(lambda m: m == n or m == 1 or n == 1)
        if draw(st.booleans()):  # a constant operand of the same length
            other = b.const(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
            b.values[other] = n
        b.node(op, [vec, other], max(n, b.values[other]))


@st.composite
def chains(draw):
    """(model, whether the Range's length must be known as a dim over s0 and s1)."""
    b = _Builder(draw, draw(st.booleans()))
    _shape(b)
    b.node("Gather", [next(iter(b.values)), b.const([0], scalar=True)], 0, axis=0)  # a scalar to start from
    for _ in range(draw(st.integers(0, 5))):
        _step(b)
    # The limit comes from the last value made (mostly), so that each step's follower decides the length.
    last = list(b.values)[-1]
    limit = last if draw(st.integers(0, 3)) else b.pick()
    if b.values[limit] > 1:
        limit = b.node("Gather", [limit, b.const([draw(st.integers(0, b.values[limit] - 1))], scalar=True)], 0)
    elif b.values[limit] == 1:
        limit = b.node("Squeeze", [limit, b.const([0])], 0)
    start_value = draw(st.sampled_from([0, 0, 1]))
    start = b.const([start_value], scalar=True)
    out = b.node("Range", [start, limit, b.const([1], scalar=True)], None)
    out = b.node("Identity", [out], None)  # the Range's output is an intermediate value (as in exports)
    graph = helper.make_graph(b.nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, X_SHAPE)],
                              [helper.make_tensor_value_info(out, TensorProto.INT64, None)], initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    # Known wherever limit - start cannot be negative: start 0 and no Sub on the way (a Sub may make the
    # limit negative, where Range is empty and no dim expression of the inputs' symbols is its length).
    return model, start_value == 0 and not any(n.op_type == "Sub" for n in b.nodes)


def _range_dim(model: onnx.ModelProto):
    """The Range output's only dim as ONNX shape inference gives it after the annotation."""
    inferred = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    name = model.graph.node[-1].input[0]
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            d = vi.type.tensor_type.shape.dim
            if len(d) == 1:
                return d[0].dim_value if d[0].HasField("dim_value") else (d[0].dim_param or None)
    return None


def _lengths(model: onnx.ModelProto, sizes):
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [len(sess.run(None, {"X": np.zeros((a, b, 3), np.float32)})[0]) for a, b in sizes]


ANNOTATORS = {"range_lengths": range_lengths.annotate,
              "symbolic_shapes": lambda m: symbolic_shapes.annotate(m, fold=False)}


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
@settings(max_examples=80)
@given(case=chains(), sizes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=2, max_size=2))
def test_range_length_is_the_length_onnxruntime_gives(path, case, sizes):
    model, must_know = case
    annotated = ANNOTATORS[path](model)
    dim = _range_dim(annotated)
    compiled = dims.compile_dim(dim, SYMBOLS)
    actual = _lengths(model, sizes)
    if compiled is None:
        assert not must_know, (dim, actual)
        return
    fn, _ = compiled
    assert [fn({"s0": a, "s1": b}) for a, b in sizes] == actual, (dim, sizes)


def _position_ids(start_op="Constant") -> onnx.ModelProto:
    """Range(0, Shape(X)[1], 1): the exporters' position ids, the limit a scalar Gather."""
    nodes = [helper.make_node("Shape", ["X"], ["sh"]),
             helper.make_node("Constant", [], ["i1"], value=numpy_helper.from_array(np.array(1, np.int64))),
             helper.make_node("Gather", ["sh", "i1"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
             helper.make_node("Identity", ["pos"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    graph = helper.make_graph(nodes, "pos", [helper.make_tensor_value_info("X", TensorProto.FLOAT, X_SHAPE)],
                              [helper.make_tensor_value_info("out", TensorProto.INT64, [None])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_position_ids_get_the_input_symbol_and_nothing_else_changes():
    model = _position_ids()
    annotated = range_lengths.annotate(model)
    assert annotated is not model
    entries = {vi.name: vi for vi in annotated.graph.value_info}
    assert list(entries) == ["pos"]
    t = entries["pos"].type.tensor_type
    assert t.elem_type == TensorProto.INT64
    assert [d.dim_param for d in t.shape.dim] == ["s1"]
    # Only value_info was added: the nodes, inputs and initializers are the model's own.
    del annotated.graph.value_info[:]
    assert annotated.SerializeToString() == model.SerializeToString()


def test_every_range_after_unknown_nodes_gets_its_length():
    """A node of another domain and a Div of two shape values (not followed) come first; then two Ranges:
    Range(0, s1) and Range(0, s0 * s1). Both get their lengths, and nothing is inferred from the Div."""
    model = _position_ids()
    g = model.graph
    extra = [helper.make_node("Custom", ["X"], ["c"], domain="my.domain"),
             helper.make_node("Div", ["sh", "sh"], ["d"]),
             helper.make_node("Gather", ["sh", "zero"], ["s0v"], axis=0),
             helper.make_node("Mul", ["s0v", "seq"], ["s01"]),
             helper.make_node("Range", ["zero", "s01", "one"], ["pos2"]),
             helper.make_node("Identity", ["pos2"], ["out2"])]
    for k, node in enumerate(extra[:2]):
        g.node.insert(k + 1, node)
    g.node.extend(extra[2:])
    g.output.append(helper.make_tensor_value_info("out2", TensorProto.INT64, [None]))
    model.opset_import.append(helper.make_opsetid("my.domain", 1))
    annotated = range_lengths.annotate(model)
    entries = {vi.name: [d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in annotated.graph.value_info}
    assert set(entries) == {"pos", "pos2"}
    fn, _ = dims.compile_dim(entries["pos2"][0], SYMBOLS)
    assert entries["pos"] == ["s1"] and fn({"s0": 3, "s1": 5}) == 15


def test_an_existing_value_info_entry_is_rewritten_not_duplicated():
    model = _position_ids()
    model.graph.value_info.append(helper.make_tensor_value_info("pos", TensorProto.INT64, ["unk__0", 7]))
    annotated = range_lengths.annotate(model)
    entries = [vi for vi in annotated.graph.value_info if vi.name == "pos"]
    assert len(entries) == 1
    assert [(d.dim_param, d.dim_value) for d in entries[0].type.tensor_type.shape.dim] == [("s1", 0)]
    assert [(d.dim_param, d.dim_value) for d in model.graph.value_info[0].type.tensor_type.shape.dim] == \
        [("unk__0", 0), ("", 7)]  # the caller's model is not changed


def test_models_with_nothing_to_add_come_back_as_the_same_object():
    model = _position_ids()
    no_range = onnx.ModelProto()
    no_range.CopyFrom(model)
    del no_range.graph.node[3:]
    no_range.graph.output[0].name = "seq"
    assert range_lengths.annotate(no_range) is no_range
    unnamed = onnx.ModelProto()  # the limit from a Size, which is not followed
    unnamed.CopyFrom(model)
    unnamed.graph.node[2].CopyFrom(helper.make_node("Size", ["X"], ["seq"]))
    assert range_lengths.annotate(unnamed) is unnamed
    broken = onnx.ModelProto()  # a Range with a missing input: left to the loader's checks
    broken.CopyFrom(model)
    del broken.graph.node[3].input[:]
    assert range_lengths.annotate(broken) is broken


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
def test_a_limit_that_can_be_negative_gets_no_length(path):
    """Range(0, s1 - 5, 1) is empty for s1 < 5: no dim over s1 is its length ('(s1 - 5)' would be -3)."""
    model = _position_ids()
    model.graph.node.insert(3, helper.make_node("Sub", ["seq", "five"], ["seq5"]))
    model.graph.node[4].input[1] = "seq5"
    model.graph.initializer.append(numpy_helper.from_array(np.array(5, np.int64), "five"))
    assert _lengths(model, [(1, 2), (1, 7)]) == [0, 2]
    assert dims.compile_dim(_range_dim(ANNOTATORS[path](model)), SYMBOLS) is None


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
def test_a_step_other_than_one_gets_no_length(path):
    """Range(0, s1, 2) has ceil(s1 / 2) elements: the limit alone is not its length."""
    model = _position_ids()
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(2, np.int64), "one"))
    assert _lengths(model, [(1, 4), (1, 5)]) == [2, 3]
    dim = _range_dim(ANNOTATORS[path](model))
    assert dims.compile_dim(dim, SYMBOLS) is None, dim


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
def test_a_stepped_slice_of_the_shape_is_followed(path):
    """Range(0, Slice(Shape(X), 0, 3, axis 0, step 2)[1] * s1): the slice is [s0, 3], so the length is 3 * s1."""
    model = _position_ids()
    consts = {"b": [0], "e": [3], "ax": [0], "st": [2], "i1": 1}
    model.graph.node.insert(1, helper.make_node("Slice", ["sh", "b", "e", "ax", "st"], ["sl"]))
    model.graph.node[3].input[:] = ["sl", "i1"]  # Gather(sl, 1): 3, not s1
    model.graph.node.insert(4, helper.make_node("Gather", ["sh", "i1"], ["s1v"], axis=0))
    model.graph.node.insert(5, helper.make_node("Mul", ["seq", "s1v"], ["seq3"]))
    model.graph.node[6].input[1] = "seq3"
    for name, v in consts.items():
        if name != "i1":
            model.graph.initializer.append(numpy_helper.from_array(np.array(v, np.int64), name))
    assert _lengths(model, [(1, 2), (1, 5)]) == [6, 15]
    fn, _ = dims.compile_dim(_range_dim(ANNOTATORS[path](model)), SYMBOLS)
    assert [fn({"s0": 1, "s1": 2}), fn({"s0": 1, "s1": 5})] == [6, 15]


@pytest.mark.parametrize("value", [None, "1", "0", "yes"])
def test_the_symbolic_shapes_entry_picks_the_annotation(value, monkeypatch):
    """session.ephost.symbolic_shapes: "1" (the default) annotates with symbolic_shapes, "0" with
    range_lengths only, anything else is refused; either way the session's outputs are onnxruntime's."""
    from host.errors import InvalidArgument
    from host.runtime.session import InferenceSession, SessionOptions

    called = []
    for module in (range_lengths, symbolic_shapes):
        monkeypatch.setattr(module, "annotate", lambda m, *a, _f=module.annotate, _n=module.__name__, **k:
                            called.append(_n.rsplit(".", 1)[1]) or _f(m, *a, **k))
    so = SessionOptions()
    if value is not None:
        so.add_session_config_entry(symbolic_shapes.ENABLE_KEY, value)
    model = _position_ids()
    if value == "yes":
        with pytest.raises(InvalidArgument, match=r"^session config 'session.ephost.symbolic_shapes' = 'yes': expected "
                                                  r"'1' \(default: infer symbolic shapes\) or '0' \(Range lengths only\)$"):
            InferenceSession(model.SerializeToString(), so)
        return
    x = np.zeros((2, 5, 3), np.float32)
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    with InferenceSession(model.SerializeToString(), so) as sess:
        got = sess.run(None, {"X": x})
    assert called == ["range_lengths" if value == "0" else "symbolic_shapes"]
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
def test_a_model_the_annotation_cannot_read_comes_back_unchanged(path):
    """A Range with one input (invalid ONNX): the annotation is a hint, the loader's checks report the model."""
    broken = _position_ids()
    del broken.graph.node[3].input[1:]
    assert ANNOTATORS[path](broken) is broken if path == "range_lengths" else \
        symbolic_shapes.annotate(broken) is broken


def _chain(nodes, consts) -> onnx.ModelProto:
    """Shape(X) -> `nodes` (ending in the scalar 'lim') -> Range(0, lim, 1) -> Identity."""
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in {**consts, "zero": 0, "one": 1}.items()]
    graph = helper.make_graph(
        [helper.make_node("Shape", ["X"], ["sh"]), *nodes, helper.make_node("Range", ["zero", "lim", "one"], ["pos"]),
         helper.make_node("Identity", ["pos"], ["out"])],
        "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, X_SHAPE)],
        [helper.make_tensor_value_info("out", TensorProto.INT64, [None])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CHAINS = {
    # Slice without axes or steps: sh[1:3] = [s1, 3]; [1] is 3, times s0 (s0 * 3)
    "slice without steps": ([helper.make_node("Slice", ["sh", "b1", "e3"], ["sl"]),
                             helper.make_node("Gather", ["sl", "i1"], ["g"], axis=0),
                             helper.make_node("Gather", ["sh", "i0"], ["g0"], axis=0),
                             helper.make_node("Mul", ["g", "g0"], ["lim"])], {"b1": [1], "e3": [3], "i1": 1, "i0": 0}),
    # The same with axes [0] given and steps omitted (four inputs)
    "slice with axes, without steps": ([helper.make_node("Slice", ["sh", "b1", "e3", "a0"], ["sl"]),
                                        helper.make_node("Gather", ["sl", "i1"], ["g"], axis=0),
                                        helper.make_node("Gather", ["sh", "i0"], ["g0"], axis=0),
                                        helper.make_node("Mul", ["g", "g0"], ["lim"])],
                                       {"b1": [1], "e3": [3], "a0": [0], "i1": 1, "i0": 0}),
    # Clip(s1, 0, 1) is 1: an op with three one-element inputs that is not followed (not a Slice)
    "clip": ([helper.make_node("Gather", ["sh", "i1"], ["g1"], axis=0),
              helper.make_node("Clip", ["g1", "lo", "hi"], ["cl"]),
              helper.make_node("Squeeze", ["cl", "ax"], ["lim"])], {"i1": [1], "lo": 0, "hi": 1, "ax": [0]}),
    # [s0, s1, 3] + [1] broadcast: [2] is 4
    "broadcast add": ([helper.make_node("Add", ["sh", "c1"], ["a"]),
                       helper.make_node("Gather", ["a", "i2"], ["lim"], axis=0)], {"c1": [1], "i2": 2}),
    # Concat of three one-element values: [s1, s0, 2]; [1] is s0
    "concat of three": ([helper.make_node("Gather", ["sh", "i1"], ["g1"], axis=0),
                         helper.make_node("Gather", ["sh", "i0"], ["g0"], axis=0),
                         helper.make_node("Concat", ["g1", "g0", "c2"], ["cat"], axis=0),
                         helper.make_node("Gather", ["cat", "j1"], ["lim"], axis=0)],
                        {"i1": [1], "i0": [0], "c2": [2], "j1": 1}),
}


@pytest.mark.parametrize("path", sorted(ANNOTATORS))
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_each_follower_form_gives_onnxruntimes_length(path, name):
    model = _chain(*CHAINS[name])
    sizes = [(2, 5), (4, 3)]
    compiled = dims.compile_dim(_range_dim(ANNOTATORS[path](model)), SYMBOLS)
    if name == "clip" and compiled is None:
        return  # not followed: unknown is right; a length must be onnxruntime's
    assert [compiled[0]({"s0": a, "s1": b}) for a, b in sizes] == _lengths(model, sizes)


def _reshape_model() -> onnx.ModelProto:
    """Reshape(X[s0, s1, 3], [Shape(X)[0], Shape(X)[1] * Shape(X)[2]]), then Relu; value_info names `sh`."""
    nodes = [helper.make_node("Shape", ["X"], ["sh"]), helper.make_node("Gather", ["sh", "i0"], ["g0"], axis=0),
             helper.make_node("Gather", ["sh", "i1"], ["g1"], axis=0), helper.make_node("Gather", ["sh", "i2"], ["g2"], axis=0),
             helper.make_node("Mul", ["g1", "g2"], ["m"]), helper.make_node("Concat", ["g0", "m"], ["tgt"], axis=0),
             helper.make_node("Reshape", ["X", "tgt"], ["r"]), helper.make_node("Relu", ["r"], ["Y"])]
    inits = [numpy_helper.from_array(np.array([k], np.int64), f"i{k}") for k in range(3)]
    graph = helper.make_graph(nodes, "reshape", [helper.make_tensor_value_info("X", TensorProto.FLOAT, X_SHAPE)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None])], initializer=inits,
                              value_info=[helper.make_tensor_value_info("sh", TensorProto.INT64, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("fold", [True, False])
def test_folded_shape_values_keep_onnxruntimes_outputs(fold):
    """With `fold`, the Reshape target [s0, s1 * 3] becomes the constant [0, -1] (and Shape(X)[2] the
    constant 3); without, the target stays computed. Either way: a new model, the caller's value_info
    entries kept, the Reshape's output named (s0, s1 * 3), onnxruntime's outputs at random sizes."""
    model = _reshape_model()
    annotated = symbolic_shapes.annotate(model, fold=fold)
    assert annotated is not model
    inits = {t.name: numpy_helper.to_array(t).tolist() for t in annotated.graph.initializer}
    reshape = next(n for n in annotated.graph.node if n.op_type == "Reshape")
    assert (inits.get(reshape.input[1]) == [0, -1]) == fold and (inits.get("g2") == [3]) == fold
    entries = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
               for vi in annotated.graph.value_info}
    assert entries["sh"] == [3] and list(entries).count("sh") == 1
    fn, _ = dims.compile_dim(entries["r"][1], SYMBOLS)
    assert entries["r"][0] == "s0" and fn({"s0": 2, "s1": 5}) == 15
    rng = np.random.default_rng(0)
    for a, b in [(2, 5), (4, 1)]:
        x = rng.standard_normal((a, b, 3)).astype(np.float32)
        want, got = (onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                     .run(None, {"X": x})[0] for m in (model, annotated))
        np.testing.assert_array_equal(got, want)


def test_a_fold_with_no_new_dim_still_changes_the_model():
    """Reshape(X, [Shape(X)[0], Shape(X)[1], Shape(X)[2]]): plain inference names every dim already (no
    value_info to add), but the target still folds to the constant [0, 0, 3]; onnxruntime's outputs."""
    model = _reshape_model()
    g = model.graph
    del g.node[4:6]
    g.node.insert(4, helper.make_node("Concat", ["g0", "g1", "g2"], ["tgt"], axis=0))
    g.output[0].CopyFrom(helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None, None]))
    annotated = symbolic_shapes.annotate(model, fold=True)
    assert annotated is not model and symbolic_shapes.annotate(model, fold=False) is model
    reshape = next(n for n in annotated.graph.node if n.op_type == "Reshape")
    target = next(t for t in annotated.graph.initializer if t.name == reshape.input[1])
    assert numpy_helper.to_array(target).tolist() == [0, 0, 3]
    x = np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)
    want, got = (onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                 .run(None, {"X": x})[0] for m in (model, annotated))
    np.testing.assert_array_equal(got, want)
