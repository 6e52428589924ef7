"""A Scaler and the LinearClassifier after it as one compiled call (host/cpu_ep/ml_chain.py, LinearClassifier's
_Compiled, native/kernels_ml.c).

Random Scaler -> LinearClassifier graphs (offset and scale per feature or one value, one to four score columns,
two or more labels, int or string labels, every post transform; inputs with NaN and infinities) run as one
chain, bit for bit against the same graph's kernels one by one on their NumPy steps (the compiled GEMM of
_Scores, then NumPy: what the kernels computed before the join), and against onnxruntime; skl2onnx's
StandardScaler + LogisticRegression pipelines (binary, one-vs-rest, multinomial) against onnxruntime and
scikit-learn. Inputs the call does not take run the kernels in turn, with their results and errors.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import host
from host.cpu_ep import native
from host.cpu_ep.fusion import FusedNode
from host.cpu_ep.ml_chain import ScalerLinear
from host.cpu_ep.ops_ml_linear import LinearClassifier
from host.errors import KernelError
from host.runtime.steps import CpuSegment

pytestmark = pytest.mark.skipif(native.LIB is None, reason="the compiled kernels are not built (python build.py)")

ML = "ai.onnx.ml"
POSTS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")


def _pipeline(features: int, columns: int, labels: list, post: str, offset: list, scale: list, rng,
              scaled_out: bool = False):
    """X -> Scaler -> LinearClassifier -> (label, scores); `scaled_out`: the Scaler's output is a graph output
    too (then nothing is joined)."""
    label_type = TensorProto.STRING if isinstance(labels[0], str) else TensorProto.INT64
    label_attr = "classlabels_strings" if label_type == TensorProto.STRING else "classlabels_ints"
    nodes = [helper.make_node("Scaler", ["X"], ["scaled"], name="scaler", domain=ML, offset=offset, scale=scale),
             helper.make_node("LinearClassifier", ["scaled"], ["label", "scores"], name="linear", domain=ML,
                              coefficients=rng.standard_normal(columns * features).astype(np.float32).tolist(),
                              intercepts=rng.standard_normal(columns).astype(np.float32).tolist(),
                              post_transform=post, **{label_attr: labels})]
    width = 2 if columns == 1 and len(labels) == 2 else columns
    outs = [helper.make_tensor_value_info("label", label_type, [None]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, width])]
    if scaled_out:
        outs.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [None, features]))
    graph = helper.make_graph(nodes, "pipeline", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                                 [None, features])], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])


@st.composite
def cases(draw, for_onnxruntime: bool = False):
    """(model, x): a random pipeline and rows of features, some NaN or infinite. `for_onnxruntime`: as many
    offsets as scales (its Scaler wants that), and no PROBIT (its output there is not defined, NaN or 0)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    features, columns = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    if columns == 1:  # a binary model, or one score column for more labels (not onnxruntime's business)
        n_labels = 2 if for_onnxruntime else draw(st.sampled_from([2, 3]))
    else:
        n_labels = columns
    strings = draw(st.booleans())
    labels = [f"c{i}" for i in range(n_labels)] if strings else rng.choice(100, n_labels, replace=False).tolist()
    post = draw(st.sampled_from(POSTS[:-1] if for_onnxruntime else POSTS))
    per_feature = (draw(st.booleans()),) * 2 if for_onnxruntime else (draw(st.booleans()), draw(st.booleans()))
    offset = rng.standard_normal(features if per_feature[0] else 1).astype(np.float32).tolist()
    scale = rng.uniform(0.1, 3, features if per_feature[1] else 1).astype(np.float32).tolist()
    rows = draw(st.sampled_from([1, 2, 5, 33]))
    x = (rng.standard_normal((rows, features)) * 3).astype(np.float32)
    if draw(st.booleans()):  # NaN and infinities: NaN scores in some columns and not others
        x.reshape(-1)[rng.choice(x.size, max(1, x.size // 4), replace=False)] = rng.choice([np.nan, np.inf, -np.inf])
    return _pipeline(features, columns, labels, post, offset, scale, rng), x


def _session(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return host.InferenceSession(model.SerializeToString())


class _Calls(list):
    def __init__(self):
        super().__init__()
        self.args = []


def _one_by_one(model, x, monkeypatch):
    """The outputs of the graph's kernels one by one on their NumPy steps: no compiled call."""
    with monkeypatch.context() as m:
        m.setattr(LinearClassifier, "compiled_run", lambda self, x, scaler=None: None)
        return _session(model).run(None, {"X": x})


def _same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.dtype == object:
            assert g.tolist() == w.tolist()
        else:
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def _compiled_calls(monkeypatch) -> list:
    """The names of the compiled calls made from now on (a spy wraps the loaded library); `.args` the
    arguments of each."""
    lib, calls = native.LIB, _Calls()

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return lambda *a: (calls.append(name), calls.args.append(a), fn(*a))[2]

    monkeypatch.setattr(native, "LIB", Spy())
    return calls


@settings(deadline=None)
@given(case=cases())
def test_a_joined_pipeline_gives_the_bits_of_its_kernels_one_by_one(case):
    model, x = case
    with pytest.MonkeyPatch.context() as mp:
        calls = _compiled_calls(mp)
        got = _session(model).run(None, {"X": x})
        assert "ep_ml_linear" in calls, "the compiled call did not run"
        want = _one_by_one(model, x, mp)
    _same_bits(got, want)


@settings(deadline=None)
@given(case=cases(for_onnxruntime=True))
def test_a_joined_pipeline_matches_onnxruntime(case):
    model, x = case
    x = np.nan_to_num(x, nan=0.5, posinf=2.0, neginf=-2.0)  # onnxruntime's argmax over NaN differs
    got = _session(model).run(None, {"X": x})
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)
    close = np.isclose(np.sort(want[1], axis=1)[:, -1], np.sort(want[1], axis=1)[:, -2], rtol=1e-5, atol=1e-6) \
        if want[1].shape[1] > 1 else np.zeros(len(x), bool)
    # near ties (LOGISTIC's saturated 1.0s too) may go either way: onnxruntime decides on the raw scores
    assert got[0][~close].tolist() == want[0][~close].tolist()


def test_the_pipeline_is_one_step_and_a_read_scaler_output_keeps_two():
    rng = np.random.default_rng(0)
    joined = _session(_pipeline(4, 1, [3, 7], "LOGISTIC", [0.5], [2.0], rng))
    steps = [s[0] for seg in _segments(joined) for s in seg.steps]
    assert len(steps) == 1 and isinstance(steps[0], FusedNode) and isinstance(steps[0].kernel, ScalerLinear)
    assert steps[0].names == ("scaler", "linear")
    kept = _session(_pipeline(4, 1, [3, 7], "LOGISTIC", [0.5], [2.0], rng, scaled_out=True))
    assert [s[0].op_type for seg in _segments(kept) for s in seg.steps] == ["Scaler", "LinearClassifier"]
    x = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(kept.run(None, {"X": x})[2], (x - np.float32(0.5)) * np.float32(2.0))


def _segments(sess) -> list[CpuSegment]:
    return [step for step, _ in sess.executor.steps if isinstance(step, CpuSegment)]


def _classifier(coefficients: list, intercepts: list, labels: list, post: str):
    """A LinearClassifier alone over two features (its own compiled call, without a Scaler)."""
    node = helper.make_node("LinearClassifier", ["X"], ["label", "scores"], domain=ML, coefficients=coefficients,
                            intercepts=intercepts, classlabels_ints=labels, post_transform=post)
    width = 2 if len(intercepts) == 1 else len(intercepts)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, width])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "PROBIT"])
def test_a_binary_score_of_zero_or_nan_takes_the_first_label(post, monkeypatch):
    """s > 0 picks the second label: s = 0, -0 and NaN take the first, as NumPy's comparison decides."""
    model = _classifier([1.0, 1.0], [0.0], [4, 9], post)
    x = np.array([[0, 0], [-0.0, 0], [np.nan, 1], [1, 1], [-1, 0]], dtype=np.float32)
    got = _session(model).run(None, {"X": x})
    assert got[0].tolist() == [4, 4, 4, 9, 4]
    _same_bits(got, _one_by_one(model, x, monkeypatch))


def test_several_columns_label_the_first_nan_as_numpys_argmax_does(monkeypatch):
    """LOGISTIC over three columns: inf * 0 makes a column NaN; NumPy's argmax takes the first NaN (the compiled
    argmax of ep_ml_logistic_labels must too), else the first maximum."""
    model = _classifier([1.0, 0.0, 0.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [5, 6, 7], "LOGISTIC")
    x = np.array([[np.inf, 1], [1, np.inf], [-np.inf, np.inf], [2, 0], [0, 0]], dtype=np.float32)
    calls = _compiled_calls(monkeypatch)
    got = _session(model).run(None, {"X": x})
    assert calls == ["ep_ml_linear", "ep_ml_logistic_labels"]
    assert got[0].tolist() == [6, 5, 5, 5, 5]
    _same_bits(got, _one_by_one(model, x, monkeypatch))


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC"])
def test_one_score_column_for_three_labels_labels_by_its_sign(post, monkeypatch):
    """Not binary (three labels): the last label where the transformed score is > 0, else the first."""
    model = _classifier([1.0, -1.0], [0.0], [1, 2, 3], post)
    model.graph.output[1].type.tensor_type.shape.dim[1].dim_value = 1
    x = np.array([[1, 0], [0, 1], [0, 0]], dtype=np.float32)
    got = _session(model).run(None, {"X": x})
    assert got[0].tolist() == ([3, 1, 1] if post == "NONE" else [3, 3, 3]) and got[1].shape == (3, 1)
    _same_bits(got, _one_by_one(model, x, monkeypatch))


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_input_the_call_does_not_take_runs_the_kernels_in_turn(dtype, monkeypatch):
    model = _pipeline(3, 2, [1, 2], "SOFTMAX", [0.25, 0.5, 1.0], [2.0], np.random.default_rng(1))
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.INT64
    x = (np.random.default_rng(2).standard_normal((4, 3)) * 4).astype(dtype)
    calls = _compiled_calls(monkeypatch)
    got = _session(model).run(None, {"X": x})
    # the Scaler's kernel ran (its float32 output then took the classifier's own compiled call, no scaler)
    assert calls == ["ep_ml_linear"] and calls.args[0][3] == native.NULL
    _same_bits(got, _one_by_one(model, x, monkeypatch))


def test_a_row_of_the_wrong_width_fails_as_the_classifier_does():
    model = _pipeline(3, 2, [1, 2], "NONE", [0.0], [1.0], np.random.default_rng(3))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "F"
    with pytest.raises(KernelError, match=r"^node 'linear' \(LinearClassifier\) .*x has 5 features; "
                                          r"the coefficients expect 3"):
        _session(model).run(None, {"X": np.ones((2, 5), np.float32)})


@pytest.mark.parametrize("multi_class", ["binary", "ovr", "multinomial"])
@pytest.mark.parametrize("rows", [1, 200])
def test_sklearn_scaler_logistic_pipelines_match_onnxruntime_and_sklearn(multi_class, rows):
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.RandomState(4)
    x = rng.rand(600, 6).astype(np.float32)
    y = (x[:, 0] + 2 * x[:, 1] + rng.rand(600) > 2).astype(np.int64)
    if multi_class != "binary":
        y = y + (x[:, 2] > 0.5)
    model = LogisticRegression()
    if multi_class == "ovr":
        model = OneVsRestClassifier(model)
    pipe = make_pipeline(StandardScaler(), model).fit(x, y)
    onx = to_onnx(pipe, x[:1], options={id(pipe): {"zipmap": False}} if multi_class != "ovr" else None,
                  target_opset={"": 17, ML: 1})
    feed = rng.rand(rows, 6).astype(np.float32)
    got = _session(onx).run(None, {"X": feed})
    want = onnxruntime.InferenceSession(onx.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": feed})
    assert got[0].tolist() == want[0].tolist() == pipe.predict(feed).tolist()
    if isinstance(want[1], list):  # ZipMap's dicts
        want[1] = np.array([[d[k] for k in sorted(d)] for d in want[1]], dtype=np.float32)
        got[1] = np.array([[d[k] for k in sorted(d)] for d in got[1]], dtype=np.float32)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], pipe.predict_proba(feed), rtol=1e-4, atol=1e-5)
