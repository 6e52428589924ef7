"""Writing a context model (host/runtime/epcontext_save.py, ABI v7, ep.context_enable=1).

The saved model has onnxruntime's EPContext form (com.microsoft opset 1, one node per compiled group
named after its partition, main_context=1, the embed mode asked for, the EP's name and plugin version)
and gives onnxruntime's outputs when loaded; a context file (embed_mode=0) goes beside the model, also in
a folder that did not exist. A group whose EP gives no context, a v6 plugin (no GetContext) or a
GetContext that fails keeps its nodes and is counted once (`context_not_offered`), the failure with a
warning naming the group. A model that already holds contexts is refused.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from host.errors import InvalidArgument
from host.runtime import epcontext
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property.test_context_compatibility import GROUPS, MODEL, WANT, X

OPS = {"fuse": "1", "ops": "Add,Relu"}


def _save(env, folder: Path, embed: str, target: Path, model=MODEL, **opts):
    source = folder / "m.onnx"
    onnx.save(model, str(source))
    so = h.session_options()
    for k, v in (("ep.context_enable", "1"), ("ep.context_file_path", str(target)), ("ep.context_embed_mode", embed)):
        so.add_session_config_entry(k, v)
    with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, {**OPS, **opts})], env=env) as sess:
        return +sess.fallbacks


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name != epcontext.KEPT_SUBGRAPH}


@pytest.mark.parametrize("embed", ["0", "1"])
@pytest.mark.parametrize("nested", [False, True])
def test_the_context_model_has_onnxruntimes_epcontext_form(embed, nested):
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        target = Path(tmp) / ("new/deeper" if nested else ".") / "m_ctx.onnx"
        fallbacks = _save(env, Path(tmp), embed, target)
        proto = onnx.load(str(target))
        nodes = [n for n in proto.graph.node if n.op_type == "EPContext"]
        assert fallbacks["context_not_offered"] == 0
        meta = {p.key: p.value for p in proto.metadata_props}
        assert meta[epcontext.SOURCE_HASH_KEY] == hashlib.sha256((Path(tmp) / "m.onnx").read_bytes()).hexdigest()
        assert len(nodes) == GROUPS and len({n.name for n in nodes}) == GROUPS
        assert [(o.domain, o.version) for o in proto.opset_import if o.domain == "com.microsoft"] == [("com.microsoft", 1)]
        for n in nodes:
            a = _attrs(n)
            assert n.domain == "com.microsoft"
            assert (a["main_context"], a["embed_mode"], a["source"], a["partition_name"], a["ep_sdk_version"]) == \
                (1, int(embed), h.EXAMPLE_EP.encode(), n.name.encode(), b"1.0.0")  # ExampleEP's plugin version
            if embed == "0":  # a file name relative to the model's folder, as onnxruntime writes it
                assert "/" not in a["ep_cache_context"].decode()
                assert (target.parent / a["ep_cache_context"].decode()).is_file()
        with InferenceSession(str(target), h.session_options(), providers=[(h.EXAMPLE_EP, OPS)], env=env) as sess:
            got = sess.run(None, {"x": X})[0]
            assert sess.fallbacks["context_loaded"] == GROUPS
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


@pytest.mark.parametrize("why", ["context=0", "v6 plugin", "context=fail"])
def test_groups_without_a_context_keep_their_nodes_and_are_counted(why):
    plugin = 6 if why == "v6 plugin" else 7
    opts = {"context": why.split("=")[1]} if "=" in why else {}
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (plugin,)) as env:
        target = Path(tmp) / "m_ctx.onnx"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallbacks = _save(env, Path(tmp), "1", target, **opts)
        texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        proto = onnx.load(str(target))
        assert fallbacks["context_not_offered"] == GROUPS
        assert [n.op_type for n in proto.graph.node] == [n.op_type for n in MODEL.graph.node]
        if why == "context=fail":
            assert len(texts) == GROUPS
            for t in texts:
                name = re.escape(re.search(r"GetContext of '([^']+)'", t).group(1))
                assert re.match(rf"^EP '{h.EXAMPLE_EP}' of plugin 'ex7' \(.+\): GetContext of '{name}' failed \(FAIL\): "
                                rf".+: context of fused node '{name}' refused \(option context=fail\); the model keeps "
                                rf"the nodes of '{name}'$", t), t
        else:
            assert texts == []
        with InferenceSession(str(target), h.session_options(), providers=[(h.EXAMPLE_EP, OPS)], env=env) as sess:
            got = sess.run(None, {"x": X})[0]
    np.testing.assert_allclose(got, WANT, **h.TIGHT)


def test_a_model_that_already_holds_contexts_is_refused():
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        target = Path(tmp) / "m_ctx.onnx"
        _save(env, Path(tmp), "1", target)
        so = h.session_options()
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(Path(tmp) / "again.onnx"))
        with pytest.raises(InvalidArgument, match=r"^ep.context_enable=1: the model already holds EPContext nodes; "
                                                  r"expected a source model \(one without compiled contexts\)$"):
            InferenceSession(str(target), so, providers=[(h.EXAMPLE_EP, OPS)], env=env)


def test_an_epcontext_node_follows_the_producers_of_its_inputs():
    """add and add2 are one fused group around Neg (ExampleEP does not take it), which only reads x: the
    EPContext node stands where add stood, before Neg, whose output it reads; the saved nodes are sorted."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "x"], ["a"], name="add"), onnx.helper.make_node("Neg", ["x"], ["n"], name="neg"),
         onnx.helper.make_node("Add", ["a", "n"], ["y"], name="add2")],
        "g", list(MODEL.graph.input), list(MODEL.graph.output))
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        target = Path(tmp) / "m_ctx.onnx"
        _save(env, Path(tmp), "1", target, model=model, fuse="all")
        proto = onnx.load(str(target))
        assert [n.op_type for n in proto.graph.node] == ["Neg", "EPContext"]
        onnx.checker.check_model(proto)  # topologically sorted
        with InferenceSession(str(target), h.session_options(), providers=[(h.EXAMPLE_EP, OPS)], env=env) as sess:
            got = sess.run(None, {"x": X})[0]
    np.testing.assert_allclose(got, X + X - X, **h.TIGHT)


def test_the_context_model_goes_beside_the_source_or_where_the_entry_says():
    """Without ep.context_file_path: `<model>_ctx.onnx` beside a model given as a path; a model given as
    bytes needs the entry; a path that cannot be written is refused with the OS's reason."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        source = Path(tmp) / "net.onnx"
        onnx.save(MODEL, str(source))
        so = h.session_options()
        so.add_session_config_entry("ep.context_enable", "1")
        with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, OPS)], env=env):
            pass
        # The contexts in files beside it (embed mode 0, the default), named after the model and partition.
        assert sorted(p.name for p in Path(tmp).iterdir()) == [
            "net.onnx", "net_ctx.onnx", "net_ctx_ExampleEP_fused_0.bin", "net_ctx_ExampleEP_fused_1.bin"]
        with pytest.raises(InvalidArgument, match=r"^ep.context_enable=1 with a model given as bytes: set "
                                                  r"ep.context_file_path to the file the context model goes to$"):
            InferenceSession(MODEL.SerializeToString(), so, providers=[(h.EXAMPLE_EP, OPS)], env=env)
        blocked = source / "m_ctx.onnx"  # a folder under a file: mkdir finds the file
        so.add_session_config_entry("ep.context_file_path", str(blocked))
        with pytest.raises(InvalidArgument, match=rf"^ep.context_file_path '{re.escape(str(blocked))}': cannot write "
                                                  r"the context model \(File exists\); expected a writable file path$"):
            InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, OPS)], env=env)


def test_check_compatibility_names_unregistered_eps_and_missing_strings():
    """ephost compile --check's answers without a session: an EP no plugin of the environment provides,
    and a model without the EP's compatibility string, are NOT_APPLICABLE with their whole reasons."""
    import abi
    from host.plugins.environment import Environment

    key = epcontext.COMPATIBILITY_KEY + h.EXAMPLE_EP
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        target = Path(tmp) / "m_ctx.onnx"
        _save(env, Path(tmp), "1", target)
        proto = onnx.load(str(target))
        (saved,) = [p.value for p in proto.metadata_props if p.key == key]
        unregistered = f"no EP called '{h.EXAMPLE_EP}' is registered; its partitions would run from the kept subgraphs"
        with Environment(api_version=7) as bare:
            assert epcontext.check_compatibility(str(target), bare) == [epcontext.Compatibility(
                h.EXAMPLE_EP, saved, abi.COMPILED_MODEL_NOT_APPLICABLE, unregistered)]
            for p in [p for p in proto.metadata_props if p.key == key]:
                proto.metadata_props.remove(p)
            assert epcontext.check_compatibility(proto, bare) == [epcontext.Compatibility(
                h.EXAMPLE_EP, "", abi.COMPILED_MODEL_NOT_APPLICABLE, unregistered)]
        assert epcontext.check_compatibility(proto, env) == [epcontext.Compatibility(
            h.EXAMPLE_EP, "", abi.COMPILED_MODEL_NOT_APPLICABLE, "the model holds no compatibility string for this EP: "
            "its contexts are tried as they are")]


def test_a_context_model_given_as_a_proto_is_left_as_it_was():
    """SavedContexts.split strips the EPContext nodes' contexts from the model it reads: from a copy when the
    caller handed over their own ModelProto (the caller's model still holds every context)."""
    with tempfile.TemporaryDirectory() as tmp, h.example_env(7, (7,)) as env:
        target = Path(tmp) / "m_ctx.onnx"
        _save(env, Path(tmp), "1", target)
        proto = onnx.load(str(target))
        before = proto.SerializeToString()
        with InferenceSession(proto, h.session_options(), providers=[(h.EXAMPLE_EP, OPS)], env=env) as sess:
            got = sess.run(None, {"x": X})[0]
            assert sess.fallbacks["context_loaded"] == GROUPS
        assert proto.SerializeToString() == before
    np.testing.assert_allclose(got, WANT, **h.TIGHT)
