"""Edges of loading a context model (host/runtime/epcontext.py, ABI v7), one edit of a saved model each.

A model saved with ExampleEP's contexts (two fused groups, test_context_compatibility.MODEL) is edited the
way other writers or users leave it: attributes onnxruntime's EPContext schema makes optional left out, a
node without ephost's kept subgraph (as onnxruntime writes them), one group that cannot be loaded beside
one that can, an output trimmed from the graph, a context for an EP the session does not have. Expected:
onnxruntime's schema defaults (main_context=1, embed_mode=1), every warning and refusal with its whole
text, the counts of loaded and recompiled groups, and onnxruntime's outputs for the source model.
The factory's answer is also checked against a plugin outside the SDK (a stub slot), which the SDK's own
range check cannot show.
"""

from __future__ import annotations

import re
import tempfile
import types
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import abi
from host.errors import EpError, InvalidArgument
from host.plugins import hostapi
from host.plugins.hostapi import ffi
from host.runtime import epcontext
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property.test_context_compatibility import GROUPS, KEY, MODEL, WANT, X, _changed

OPS = {"fuse": "1", "ops": "Add,Relu"}
FIRST = "ExampleEP_fused_0"  # the group of add and relu, before Neg in the saved model
WHERE = r"EP 'ExampleEP' of plugin 'ex7' \(.+\)"  # how the host names the EP in a plugin's failure


def _save(env, folder: Path, embed: str = "1", model: onnx.ModelProto = MODEL) -> Path:
    source, target = folder / "m.onnx", folder / "m_ctx.onnx"
    onnx.save(model, str(source))
    so = h.session_options()
    for k, v in (("ep.context_enable", "1"), ("ep.context_file_path", str(target)), ("ep.context_embed_mode", embed)):
        so.add_session_config_entry(k, v)
    with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, OPS)], env=env):
        pass
    return target


def _contexts(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if epcontext.is_context_node(n)]


def _drop(node: onnx.NodeProto, name: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)


def _run(model, env, opts=OPS):
    """(output y, fallbacks, RuntimeWarning texts) of a session over `model`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InferenceSession(model, h.session_options(), providers=[(h.EXAMPLE_EP, opts)], env=env) as sess:
            got = sess.run(["y"], {"x": X})[0]
            fallbacks = +sess.fallbacks
    return got, fallbacks, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("attribute", ["main_context", "embed_mode"])
def test_optional_attributes_take_onnxruntimes_defaults(attribute):
    """onnxruntime's EPContext schema: main_context and embed_mode default to 1 (a main, embedded context)."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        for node in _contexts(proto):
            _drop(node, attribute)
        onnx.save(proto, str(path))
        got, fallbacks, texts = _run(str(path), env)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"], texts) == (GROUPS, 0, [])
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


def test_a_node_without_context_bytes_is_compiled_again_with_the_eps_reason():
    """No ep_cache_context: an empty context, which ExampleEP refuses (0 bytes, no header)."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        for node in _contexts(proto):
            _drop(node, "ep_cache_context")
        onnx.save(proto, str(path))
        got, fallbacks, texts = _run(str(path), env)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (0, GROUPS)
    assert len(texts) == GROUPS
    for name, text in zip(sorted(n.name for n in _contexts(proto)), sorted(texts)):
        assert re.match(rf"^compiled context of '{name}' not used \({WHERE}: CompileFromContext of '{name}' failed "
                        rf"\(INVALID_GRAPH\): .*context of fused node '{name}' cannot be read \(0 bytes\): ValueError: "
                        r"no ExampleEP context header\); its nodes are compiled again$", text), text
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


# Why the first group is compiled again while the second loads: (how the saved model is edited, the reason
# the warning gives).
FIRST_NOT_LOADED = {
    "file_missing": ("embed0", r"context file '.+/m_ctx_ExampleEP_fused_0\.bin' cannot be read: No such file or "
                               r"directory"),
    "another_ep": ("source", r"XnnpackExecutionProvider is not an EP of this session"),
    "state_fails": ("state", rf"{WHERE}: CreateState of fused node '{FIRST}' failed \(FAIL\): .*injected "
                             rf"CreateState failure for fused node '{FIRST}'"),
}


@pytest.mark.parametrize("case", sorted(FIRST_NOT_LOADED))
def test_one_group_compiled_again_beside_one_loaded(case):
    """The first group's kept nodes go back into the graph before the second, loaded one: the loaded
    partition is found at its new place and only the first group is inlined. XnnpackExecutionProvider is
    onnxruntime's name of an EP no plugin here provides. lie=state_fails: ExampleEP's CreateState fails,
    for the loaded context and again for the recompiled group, which then runs as per-node kernels."""
    edit, reason = FIRST_NOT_LOADED[case]
    opts = {**OPS, "lie": "state_fails"} if edit == "state" else OPS
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp), "0" if edit == "embed0" else "1")
        proto = onnx.load(str(path))
        first = next(n for n in _contexts(proto) if n.name == FIRST)
        if edit == "embed0":
            (path.parent / next(a.s for a in first.attribute if a.name == "ep_cache_context").decode()).unlink()
        elif edit == "source":
            next(a for a in first.attribute if a.name == "source").s = b"XnnpackExecutionProvider"
            onnx.save(proto, str(path))
        got, fallbacks, texts = _run(str(path), env, opts)
    if edit == "state":  # the second group's CreateState fails the same way
        assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (0, GROUPS)
        texts = [t for t in texts if f"'{FIRST}'" in t and t.startswith("compiled context")]
    else:
        assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (1, 1)
    assert len(texts) == 1 and re.match(rf"^compiled context of '{FIRST}' not used \({reason}\); its nodes are "
                                        r"compiled again$", texts[0]), texts
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


# A node without ephost's kept subgraph (as onnxruntime writes them): (edit, the reason in the refusal or None).
WITHOUT_SUBGRAPH = {
    "usable": None,
    "another_ep": r"XnnpackExecutionProvider is not an EP of this session",
    "main_context_0": r"main_context=0 \(a context shared with another node\) is not supported",
    "truncated": rf"{WHERE}: CompileFromContext of '{FIRST}' failed \(INVALID_GRAPH\): .*context of fused node "
                 rf"'{FIRST}' cannot be read \(5 bytes\): ValueError: .+",
}


@pytest.mark.parametrize("case", sorted(WITHOUT_SUBGRAPH))
def test_a_node_without_a_kept_subgraph_loads_or_is_refused_whole(case):
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        for node in _contexts(proto):
            _drop(node, epcontext.KEPT_SUBGRAPH)
        first = next(n for n in _contexts(proto) if n.name == FIRST)
        if case == "another_ep":
            next(a for a in first.attribute if a.name == "source").s = b"XnnpackExecutionProvider"
        elif case == "main_context_0":
            next(a for a in first.attribute if a.name == "main_context").i = 0
        elif case == "truncated":
            blob = next(a for a in first.attribute if a.name == "ep_cache_context")
            blob.s = blob.s[:5]
        onnx.save(proto, str(path))
        reason = WITHOUT_SUBGRAPH[case]
        if reason is not None:
            with pytest.raises(epcontext.ContextError, match=rf"^compiled context of '{FIRST}' cannot be used "
                                                             rf"\({reason}\) and the node keeps no subgraph to compile "
                                                             r"again; compile the source model again \(ephost compile\)$"):
                _run(str(path), env)
            return
        got, fallbacks, texts = _run(str(path), env)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"], texts) == (GROUPS, 0, [])
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


def test_a_context_with_an_output_nothing_reads_is_compiled_again():
    """The source model also returns `a` (Add's output, inside the first group); the saved model's graph
    output `a` is then removed: the EPContext node writes a value nothing reads, which a rebuilt partition
    cannot leave out, so its kept nodes are compiled again (they compute only what is read)."""
    graph = helper.make_graph(list(MODEL.graph.node), "g", list(MODEL.graph.input),
                              [*MODEL.graph.output, helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=list(MODEL.opset_import), ir_version=MODEL.ir_version)
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp), model=model)
        proto = onnx.load(str(path))
        outputs = list(next(n for n in _contexts(proto) if n.name == FIRST).output)
        assert sorted(outputs) == ["a", "r"]
        proto.graph.output.remove(next(o for o in proto.graph.output if o.name == "a"))
        onnx.save(proto, str(path))
        got, fallbacks, texts = _run(str(path), env)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": X})[0]
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (1, 1)
    assert texts == [f"compiled context of '{FIRST}' not used (outputs {outputs} are not all read after the node); "
                     "its nodes are compiled again"]
    np.testing.assert_allclose(got, want, **h.TIGHT)


def test_an_unsupported_context_names_an_ep_that_now_writes_no_string():
    """null_slots=GetCompiledModelCompatibilityInfo: the EP gives no compatibility string now, which the
    refusal of a context its factory calls unsupported shows as ''."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        (entry,) = [p for p in proto.metadata_props if p.key == KEY]
        entry.value = _changed(entry.value, "format", "9")
        onnx.save(proto, str(path))
        with pytest.raises(epcontext.ContextError, match=r"^compiled context of '.+' cannot be used: ExampleEP answers "
                                                         r"EP_UNSUPPORTED for the saved compatibility string .+ \(this "
                                                         r"EP now writes ''\); compile the source model again "
                                                         r"\(ephost compile\)$"):
            _run(str(path), env, {**OPS, "null_slots": "GetCompiledModelCompatibilityInfo"})


def test_a_plugin_below_v7_is_not_applicable_with_its_version_named():
    with tempfile.TemporaryDirectory() as tmp:
        with h.example_env(7, (7,)) as env:
            path = _save(env, Path(tmp))
        (saved,) = [p.value for p in onnx.load(str(path)).metadata_props if p.key == KEY]
        with h.example_env(7, (6,)) as env6:
            assert epcontext.check_compatibility(str(path), env6) == [epcontext.Compatibility(
                h.EXAMPLE_EP, saved, abi.COMPILED_MODEL_NOT_APPLICABLE, "the plugin speaks ABI v6; saved contexts need "
                "v7: its partitions are compiled from the kept subgraphs")]


def _stub_factory(slot):
    """What validate() reads of a factory, with a ValidateCompiledModelCompatibilityInfo slot of our own (a
    plugin outside the SDK, whose answers the SDK's range check does not guard)."""
    return types.SimpleNamespace(slots=types.SimpleNamespace(ValidateCompiledModelCompatibilityInfo=slot),
                                 ptr=ffi.NULL, device_structs=ffi.NULL, devices=[], name="StubEP",
                                 registration="stub", negotiated=7)


@pytest.mark.parametrize("written", [None, 7, -2])
def test_a_factory_answer_outside_the_abi_is_an_ep_error(written):
    """A slot that returns OK without writing the answer leaves the host's initial -1: refused like any
    answer outside EP_COMPILED_MODEL_*, never read as one of them."""
    def slot(factory, devices, num_devices, info, out):
        if written is not None:
            out[0] = written
        return ffi.NULL

    answer = -1 if written is None else written
    with pytest.raises(EpError, match=rf"^plugin 'stub': ValidateCompiledModelCompatibilityInfo answered {answer}; "
                                      rf"expected one of {re.escape(str(abi.COMPATIBILITY_NAMES))}$"):
        epcontext.validate(_stub_factory(slot), "StubEP;format=1")
    assert sorted(abi.COMPATIBILITY_NAMES) == [0, 1, 2, 3]  # -1, -2 and 7 are outside; 0 and 1 are not


def test_a_failing_factory_answer_is_an_ep_error_naming_the_plugin():
    def slot(factory, devices, num_devices, info, out):
        return hostapi.STATUSES.create(abi.EP_FAIL, b"cannot judge")

    with pytest.raises(EpError, match=r"^plugin 'stub': ValidateCompiledModelCompatibilityInfo failed \(FAIL\): "
                                      r"cannot judge$"):
        epcontext.validate(_stub_factory(slot), "StubEP;format=1")


@pytest.mark.parametrize("value", ["yes", "", "2"])
def test_a_context_flag_other_than_0_or_1_is_refused(value):
    with h.example_env(7, (7,)) as env:
        so = h.session_options()
        so.add_session_config_entry("ep.context_embed_mode", value)
        with pytest.raises(InvalidArgument, match=rf"^session config entry ep.context_embed_mode={value!r}: "
                                                  r"expected '0' or '1'$"):
            InferenceSession(MODEL.SerializeToString(), so, providers=[(h.EXAMPLE_EP, OPS)], env=env)


def test_a_plain_node_named_like_a_context_node_runs_as_itself():
    """Only EPContext nodes are looked up among the saved contexts: a Neg named after the first partition
    stays a Neg (ONNX does not make node names unique)."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        path = _save(env, Path(tmp))
        proto = onnx.load(str(path))
        next(n for n in proto.graph.node if n.op_type == "Neg").name = FIRST
        onnx.save(proto, str(path))
        got, fallbacks, texts = _run(str(path), env)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"], texts) == (GROUPS, 0, [])
    np.testing.assert_allclose(got, WANT, **h.TIGHT)
