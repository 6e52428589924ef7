"""ABI v7 contexts judged by their compatibility string (host/runtime/epcontext.py validate, resolve).

A model saved with ExampleEP's contexts (ep.context_enable=1, fuse=1) gets its compatibility string
(`ep_compatibility_info.ExampleEP` in the metadata) changed at random: one field (plugin version, ABI,
context format, device), another EP's name, garbage, or no string at all. ExampleEP's factory answers
by its documented rules (tests/plugins/example_ep.py): another format, device or EP -> unsupported,
another plugin version or ABI -> prefer recompilation, else optimal. Expected here from those rules:
`check_compatibility` gives that answer without a session; an unsupported context refuses the session
(`ContextError` with the whole reason); prefer-recompilation recompiles every group silently
(`context_recompiled`); optimal or no string loads them (`context_loaded`). Outputs equal onnxruntime's.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import abi
from abi import sdk
from host.runtime import epcontext
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property import strategies as s

V = 7
KEY = epcontext.COMPATIBILITY_KEY + h.EXAMPLE_EP
FIELDS = ("plugin", "abi", "format", "device")
CHANGES = (*FIELDS, "ep_name", "garbage", "none", "same")
# Nodes ExampleEP takes (Add, Relu) around one it does not (Neg): two fused groups.
MODEL = helper.make_model(helper.make_graph(
    [helper.make_node("Add", ["x", "x"], ["a"], name="add"), helper.make_node("Relu", ["a"], ["r"], name="relu"),
     helper.make_node("Neg", ["r"], ["n"], name="neg"), helper.make_node("Add", ["n", "x"], ["y"], name="add2")],
    "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]),
    opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
GROUPS = 2
X = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
WANT = ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def _changed(saved: str, change: str, suffix: str) -> str | None:
    """The compatibility string after `change` (None: the entry removed)."""
    if change == "none":
        return None
    if change == "same":
        return saved
    if change == "garbage":
        return "\x01not a compatibility string"
    name, _, rest = saved.partition(";")
    if change == "ep_name":
        return f"OtherEP;{rest}"
    fields = sdk.compatibility_fields(saved, h.EXAMPLE_EP)
    fields[change] = fields[change] + suffix
    return sdk.compatibility_string(name, **fields)


def _expected(change: str) -> int:
    if change in ("format", "device", "ep_name", "garbage"):
        return abi.COMPILED_MODEL_UNSUPPORTED
    if change in ("plugin", "abi"):
        return abi.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION
    return abi.COMPILED_MODEL_NOT_APPLICABLE if change == "none" else abi.COMPILED_MODEL_SUPPORTED_OPTIMAL


def _save(env, folder: Path) -> Path:
    source, target = folder / "m.onnx", folder / "m_ctx.onnx"
    onnx.save(MODEL, str(source))
    so = h.session_options()
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(target))
    with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, {"fuse": "1", "ops": "Add,Relu"})], env=env):
        pass
    return target


@pytest.mark.parametrize("change", CHANGES)
@given(suffix=st.text("0123456789abcxyz.", min_size=1, max_size=3))
@settings(deadline=None, max_examples=s.budget(2))
def test_a_changed_compatibility_string_gets_the_factorys_answer(change, suffix):
    with tempfile.TemporaryDirectory() as tmp, h.example_env(V, (V,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        (entry,) = [p for p in proto.metadata_props if p.key == KEY]
        value = _changed(entry.value, change, suffix)
        if value is None:
            proto.metadata_props.remove(entry)
        else:
            entry.value = value
        onnx.save(proto, str(path))
        answer = _expected(change)
        (judged,) = epcontext.check_compatibility(str(path), env)
        reason = ("the model holds no compatibility string for this EP: its contexts are tried as they are"
                  if value is None else f"{h.EXAMPLE_EP} answers {abi.COMPATIBILITY_NAMES[answer]} for the saved "
                  f"compatibility string {value!r}")
        assert judged == epcontext.Compatibility(h.EXAMPLE_EP, value or "", answer, reason), judged
        providers = [(h.EXAMPLE_EP, {"fuse": "1", "ops": "Add,Relu"})]
        if answer == abi.COMPILED_MODEL_UNSUPPORTED:
            with pytest.raises(epcontext.ContextError,
                               match=r"^compiled context of '.+' cannot be used: ExampleEP answers EP_UNSUPPORTED "
                                     r"for the saved compatibility string .+ \(this EP now writes 'ExampleEP;.+'\); "
                                     r"compile the source model again \(ephost compile\)$"):
                InferenceSession(str(path), h.session_options(), providers=providers, env=env)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # prefer-recompilation is silent; loading is too
            with InferenceSession(str(path), h.session_options(), providers=providers, env=env) as sess:
                got = sess.run(None, {"x": X})[0]
                fallbacks = +sess.fallbacks
    recompiled = answer == abi.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION
    assert fallbacks["context_recompiled"] == (GROUPS if recompiled else 0)
    assert fallbacks["context_loaded"] == (0 if recompiled else GROUPS)
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


PROBLEMS = ("file_missing", "as_bytes", "main_context_0", "unnamed")


@pytest.mark.parametrize("problem", PROBLEMS)
@given(embed=st.sampled_from(["0", "1"]))
@settings(deadline=None, max_examples=s.budget(2))
def test_a_context_that_cannot_be_read_is_compiled_again_with_a_warning(problem, embed):
    """Contexts saved beside the model (embed_mode=0) whose file is gone, or that are loaded from bytes (no
    folder to find them in), or a node marked main_context=0: the kept nodes are compiled again with a
    RuntimeWarning naming the reason. A node without a name is a ModelError. Embedded contexts are unaffected
    by the first two."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(V, (V,)) as env:
        source, target = Path(tmp) / "m.onnx", Path(tmp) / "m_ctx.onnx"
        onnx.save(MODEL, str(source))
        so = h.session_options()
        for k, v in (("ep.context_enable", "1"), ("ep.context_file_path", str(target)), ("ep.context_embed_mode", embed)):
            so.add_session_config_entry(k, v)
        opts = {"fuse": "1", "ops": "Add,Relu"}
        with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, opts)], env=env):
            pass
        proto = onnx.load(str(target))
        nodes = [n for n in proto.graph.node if n.op_type == "EPContext"]
        assert len(nodes) == GROUPS
        model = str(target)
        external = embed == "0"
        reason = None
        if problem == "file_missing" and external:
            for f in Path(tmp).iterdir():
                if f not in (source, target):
                    f.unlink()
            reason = r"context file '.+' cannot be read: "
        elif problem == "as_bytes":
            model = target.read_bytes()
            reason = r"the context is in file '.+', and the model was not given as a path" if external else None
        elif problem == "main_context_0":
            for n in nodes:
                next(a for a in n.attribute if a.name == "main_context").i = 0
            onnx.save(proto, str(target))
            reason = r"main_context=0 \(a context shared with another node\) is not supported"
        elif problem == "unnamed":
            nodes[0].name = ""
            onnx.save(proto, str(target))
            with pytest.raises(epcontext.ModelError, match=r"^an EPContext node of source 'ExampleEP' has no name; "
                                                           r"expected the partition name$"):
                InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, opts)], env=env)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, opts)], env=env) as sess:
                got = sess.run(None, {"x": X})[0]
                fallbacks = +sess.fallbacks
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if reason is None:
        assert fallbacks["context_loaded"] == GROUPS and texts == []
    else:
        assert fallbacks["context_recompiled"] == GROUPS
        assert len(texts) == GROUPS and all(re.match(rf"^compiled context of '.+' not used \({reason}", t) for t in texts)
    np.testing.assert_allclose(got, WANT, **h.TIGHT)
