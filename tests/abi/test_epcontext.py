"""ABI v7: compiled partitions saved as EPContext nodes and loaded back, through the example plugin.

Outputs are compared with onnxruntime's CPU EP on the source model; what the plugin did is read
from its Record (which slots were called: a loaded context must not be compiled again).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import abi
import build
from abi import sdk
from host import cli
from host.errors import InvalidArgument
from host.plugins.environment import Environment
from host.runtime import epcontext
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.abi.test_compiled import chain_model

EP = "ExampleEP"
V = abi.ABI_VERSION
# Two fused groups: ExampleEP takes Add, Relu, Mul and leaves Sigmoid to the CPU EP (ops=...).
OPS = ("Add", "Relu", "Sigmoid", "Mul", "Add")
EP_OPTIONS = {"fuse": "1", "ops": "Add,Relu,Mul"}
pytestmark = pytest.mark.filterwarnings("ignore:compiled context of .* not used:RuntimeWarning")


def record(version: int) -> sdk.Record:
    return sdk.runtime(build.module_name("example", version)).record


def onnxruntime_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def x_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3)).astype(np.float32)


@pytest.fixture
def source(tmp_path):
    model = chain_model(OPS)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return model, path


def options(**entries) -> SessionOptions:
    so = SessionOptions()
    for k, v in entries.items():
        so.add_session_config_entry(k, v)
    return so


def save(env, path, ep_options=None, **entries):
    """Compile `path` with ep.context_enable=1 (and `entries`); returns the session's fallbacks."""
    so = options(**{epcontext.ENABLE: "1", **entries})
    with InferenceSession(str(path), so, providers=[(EP, ep_options or EP_OPTIONS)], env=env) as s:
        return s.context_model, s.fallbacks


def load_and_check(env, ctx_path, model, version: int = V, ep_options=None):
    """A session from the context model: outputs equal onnxruntime's on the source model."""
    record(version).clear()
    with InferenceSession(str(ctx_path), providers=[(EP, ep_options or EP_OPTIONS)], env=env) as s:
        for seed in range(2):
            x = x_input(seed)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)
        return s.fallbacks, record(version).slot_calls


@pytest.fixture
def env7(plugins):
    with Environment() as env:
        env.register_plugin("ex7", plugins.example[V])
        yield env


def context_nodes(path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "EPContext"]


def test_saved_model_holds_epcontext_nodes_and_loads_without_compiling(env7, source):
    model, path = source
    ctx_path, saved_fallbacks = save(env7, path)
    assert ctx_path == path.with_name("model_ctx.onnx")
    nodes = context_nodes(ctx_path)
    assert [(n.domain, n.name) for n in nodes] == [("com.microsoft", f"{EP}_fused_0"), ("com.microsoft", f"{EP}_fused_1")]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    # embed_mode 0 by default, as onnxruntime: the context in a file beside the model.
    assert (attrs["source"], attrs["partition_name"], attrs["embed_mode"], attrs["main_context"]) == (
        EP.encode(), f"{EP}_fused_0".encode(), 0, 1)
    assert (ctx_path.parent / attrs["ep_cache_context"].decode()).stat().st_size > 0
    assert [n.op_type for n in attrs[epcontext.KEPT_SUBGRAPH].node] == ["Add", "Relu"]
    meta = {p.key: p.value for p in onnx.load(str(ctx_path)).metadata_props}
    assert meta[epcontext.SOURCE_HASH_KEY] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta["ep_compatibility_info.ExampleEP"] == f"{EP};plugin=1.0.0;abi={V};format=1;device=example-cpu"
    assert saved_fallbacks["context_not_offered"] == 0

    fallbacks, calls = load_and_check(env7, ctx_path, model)
    assert fallbacks["context_loaded"] == 2 and fallbacks["context_recompiled"] == 0
    assert calls["Ep.CompileFromContext"] == 2
    assert calls["Ep.Compile"] == 0, "a loaded context is not compiled again"
    assert calls["EpFactory.ValidateCompiledModelCompatibilityInfo"] == 1  # once per EP, not per node
    assert calls["EpNodeComputeInfo.Compute"] == 2 * 2
    # A ModelProto given by the caller is read, not changed (the blobs and kept subgraphs stay): its
    # contexts are embedded (a file beside it is found only from a model path).
    embedded, _ = save(env7, path, **{epcontext.FILE_PATH: str(path.with_name("embedded_ctx.onnx")),
                                      epcontext.EMBED_MODE: "1"})
    proto = onnx.load(str(embedded))
    before = proto.SerializeToString()
    with InferenceSession(proto, providers=[(EP, EP_OPTIONS)], env=env7) as s:
        assert s.fallbacks["context_loaded"] == 2
    assert proto.SerializeToString() == before


def test_external_contexts_beside_the_model(env7, source, tmp_path):
    model, path = source
    target = tmp_path / "out" / "m_ctx.onnx"
    ctx_path, _ = save(env7, path, **{epcontext.FILE_PATH: str(target), epcontext.EMBED_MODE: "0"})
    assert ctx_path == target
    files = [onnx.helper.get_attribute_value(a).decode() for n in context_nodes(target) for a in n.attribute
             if a.name == "ep_cache_context"]
    assert files == ["m_ctx_ExampleEP_fused_0.bin", "m_ctx_ExampleEP_fused_1.bin"]
    assert all((target.parent / f).stat().st_size > 0 for f in files)
    fallbacks, calls = load_and_check(env7, target, model)
    assert (fallbacks["context_loaded"], calls["Ep.Compile"]) == (2, 0)
    # A missing context file: that partition is compiled from the kept nodes, with a warning.
    (target.parent / files[1]).unlink()
    with pytest.warns(RuntimeWarning, match=r"^compiled context of 'ExampleEP_fused_1' not used \(context file '.*"
                                            r"m_ctx_ExampleEP_fused_1\.bin' cannot be read: "):
        fallbacks, calls = load_and_check(env7, target, model)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"], calls["Ep.Compile"]) == (1, 1, 1)


def _edit_compatibility(path, text: str) -> None:
    proto = onnx.load(str(path))
    for p in proto.metadata_props:
        if p.key == "ep_compatibility_info.ExampleEP":
            p.value = text
    onnx.save(proto, str(path))


def test_prefer_recompilation_compiles_the_kept_subgraph(env7, source):
    model, path = source
    ctx_path, _ = save(env7, path)
    _edit_compatibility(ctx_path, f"{EP};plugin=0.9.0;abi={V};format=1;device=example-cpu")
    answers = epcontext.check_compatibility(ctx_path, env7)
    assert [(a.ep, a.name) for a in answers] == [(EP, "EP_SUPPORTED_PREFER_RECOMPILATION")]
    fallbacks, calls = load_and_check(env7, ctx_path, model)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (0, 2)
    assert (calls["Ep.CompileFromContext"], calls["Ep.Compile"]) == (0, 1)


def test_unsupported_context_is_a_typed_error_naming_the_reason(env7, source):
    _, path = source
    ctx_path, _ = save(env7, path)
    saved = f"{EP};plugin=1.0.0;abi={V};format=1;device=example-npu"
    _edit_compatibility(ctx_path, saved)
    with pytest.raises(epcontext.ContextError,
                       match=rf"^compiled context of 'ExampleEP_fused_0' cannot be used: ExampleEP answers "
                             rf"EP_UNSUPPORTED for the saved compatibility string '{saved}' \(this EP now writes "
                             rf"'ExampleEP;plugin=1\.0\.0;abi={V};format=1;device=example-cpu'\); compile the source "
                             r"model again \(ephost compile\)$"):
        InferenceSession(str(ctx_path), providers=[(EP, EP_OPTIONS)], env=env7)


@pytest.mark.parametrize("how", ["corrupt", "truncated"])
def test_a_damaged_context_is_recompiled(env7, source, how):
    from tests.property.scenario import damage

    model, path = source
    ctx_path, _ = save(env7, path)
    damage(ctx_path, how)
    with pytest.warns(RuntimeWarning, match=r"^compiled context of 'ExampleEP_fused_0' not used \(.*CompileFromContext "
                                            r"of 'ExampleEP_fused_0' failed \(INVALID_GRAPH\): .*context of fused "
                                            r"node 'ExampleEP_fused_0' cannot be read"):
        fallbacks, calls = load_and_check(env7, ctx_path, model)
    assert (fallbacks["context_loaded"], fallbacks["context_recompiled"]) == (0, 2)
    assert (calls["Ep.CompileFromContext"], calls["Ep.Compile"]) == (2, 1)


def test_an_ep_that_gives_no_context_keeps_the_nodes(env7, source):
    model, path = source
    ctx_path, saved_fallbacks = save(env7, path, {**EP_OPTIONS, "context": "0"})
    assert saved_fallbacks["context_not_offered"] == 2
    assert context_nodes(ctx_path) == []
    fallbacks, calls = load_and_check(env7, ctx_path, model)
    assert (fallbacks["context_loaded"], calls["Ep.Compile"]) == (0, 1)


def test_context_options_are_checked(env7, source):
    model, path = source
    with pytest.raises(InvalidArgument, match=r"^session config entry ep\.context_enable='yes': expected '0' or '1'$"):
        save(env7, path, **{epcontext.ENABLE: "yes"})
    with pytest.raises(InvalidArgument, match=r"^ep\.context_enable=1 with a model given as bytes: set "
                                              r"ep\.context_file_path"):
        InferenceSession(model.SerializeToString(), options(**{epcontext.ENABLE: "1"}),
                         providers=[(EP, EP_OPTIONS)], env=env7)
    ctx_path, _ = save(env7, path)
    with pytest.raises(InvalidArgument, match=r"^ep\.context_enable=1: the model already holds EPContext nodes"):
        save(env7, ctx_path)


def test_a_context_model_runs_without_its_ep(env7, source):
    """No ExampleEP in the session: the kept nodes come back and run on the CPU EP."""
    model, path = source
    ctx_path, _ = save(env7, path)
    with pytest.warns(RuntimeWarning, match=r"^compiled context of 'ExampleEP_fused_0' not used \(ExampleEP is not an "
                                            r"EP of this session\)"):
        s = InferenceSession(str(ctx_path), providers=["CPUExecutionProvider"], env=env7)
    with s:
        x = x_input()
        np.testing.assert_allclose(s.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)
        assert s.fallbacks["context_recompiled"] == 2


# ---- versions -------------------------------------------------------------------------------------
def test_v7_context_model_with_a_v6_plugin_compiles_the_kept_nodes(plugins, source):
    model, path = source
    with Environment() as env:
        env.register_plugin("ex7", plugins.example[V])
        ctx_path, _ = save(env, path)
    with Environment() as env:
        env.register_plugin("ex6", plugins.example[6])
        fallbacks, calls = load_and_check(env, ctx_path, model, version=6)
    assert (fallbacks["context_recompiled"], calls["Ep.Compile"]) == (2, 1)
    assert [k for k in calls if "." in k and abi.since(*k.split(".")) > 6] == []


@pytest.mark.parametrize("host,plugin", [(7, 6), (6, 7)])
def test_below_v7_no_context_is_asked_for(plugins, source, host, plugin):
    model, path = source
    with Environment(api_version=host) as env:
        env.register_plugin("ex", plugins.example[plugin])
        record(plugin).clear()
        ctx_path, fallbacks = save(env, path)
        assert record(plugin).slot_calls["EpNodeComputeInfo.GetContext"] == 0
        assert fallbacks["context_not_offered"] == 2
        assert context_nodes(ctx_path) == []
        load_and_check(env, ctx_path, model, version=plugin)


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_compile_and_check(plugins, source, tmp_path, capsys):
    model, path = source
    out = tmp_path / "cli_ctx.onnx"
    common = ["--plugin", str(plugins.example[V]), "--ep-option", "fuse=1", "--ep-option", "ops=Add,Relu,Mul"]
    assert cli.main(["compile", str(path), "-o", str(out), *common]) == 0
    text = capsys.readouterr().out
    assert "2 saved as EPContext nodes, 0 kept as nodes" in text and f"wrote {out}" in text
    assert len(context_nodes(out)) == 2
    assert cli.main(["compile", "--check", str(out), "--plugin", str(plugins.example[V])]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ExampleEP: EP_SUPPORTED_OPTIMAL (")
    assert f"source model sha256: {hashlib.sha256(path.read_bytes()).hexdigest()}" in text
    _edit_compatibility(out, f"{EP};plugin=1.0.0;abi={V};format=2;device=example-cpu")
    assert cli.main(["compile", "--check", str(out), "--plugin", str(plugins.example[V])]) == 1
    assert capsys.readouterr().out.startswith("ExampleEP: EP_UNSUPPORTED (")
    assert cli.main(["compile", "--check", str(path)]) == 0
    assert "no compiled contexts" in capsys.readouterr().out


def test_a_damaged_context_never_crashes_the_process(plugins, source):
    """Garbage and truncated blobs in a fresh process: the session runs and the process exits 0."""
    from tests.property.scenario import damage

    _, path = source
    with Environment() as env:
        env.register_plugin("ex7", plugins.example[V])
        ctx_path, _ = save(env, path)
    damage(ctx_path, "truncated")
    code = (f"import numpy as np, warnings; warnings.simplefilter('ignore')\n"
            f"from host.plugins.environment import Environment\nfrom host.runtime.session import InferenceSession\n"
            f"env = Environment(); env.register_plugin('ex', {str(plugins.example[V])!r})\n"
            f"s = InferenceSession({str(ctx_path)!r}, providers=[('{EP}', {EP_OPTIONS!r})], env=env)\n"
            f"print(s.fallbacks['context_recompiled'], s.run(None, {{'x': np.ones((2, 3), np.float32)}})[0].shape)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=build.ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "(2,", "3)"]


@pytest.mark.parametrize("plugin", [6, V])
def test_the_c_plugin_saves_no_context(cc, tmp_path, plugin):
    """The C plugin (no v7 slots filled; at v6 it has none): ep.context_enable keeps its fused nodes."""
    from tests.abi.test_compiled import add_chain, c_plugin_at

    path, lib = c_plugin_at(plugin)
    model = add_chain(4)
    source = tmp_path / "adds.onnx"
    onnx.save(model, str(source))
    with Environment() as env:
        env.register_plugin("c", path)
        so = options(**{epcontext.ENABLE: "1"})
        with InferenceSession(str(source), so, providers=["ExampleCEP"], env=env) as s:
            assert s.fallbacks["context_not_offered"] == 1
        assert context_nodes(s.context_model) == []
        computes = lib.ExampleC_ComputeCalls()
        with InferenceSession(str(s.context_model), providers=["ExampleCEP"], env=env) as s2:
            x = x_input()
            np.testing.assert_allclose(s2.run(None, {"x": x})[0], onnxruntime_reference(model, x), rtol=1e-6)
        assert lib.ExampleC_ComputeCalls() - computes == 1  # compiled again, one crossing


def test_a_damaged_context_without_kept_nodes_is_a_typed_error(env7, source):
    """An EPContext node from elsewhere (no ephost_subgraph): nothing to fall back to."""
    from tests.property.scenario import damage

    _, path = source
    ctx_path, _ = save(env7, path, **{epcontext.EMBED_MODE: "1"})  # a ModelProto below: embedded contexts
    damage(ctx_path, "corrupt")
    proto = onnx.load(str(ctx_path))
    for node in proto.graph.node:
        kept = [a for a in node.attribute if a.name != epcontext.KEPT_SUBGRAPH]
        del node.attribute[:]
        node.attribute.extend(kept)
    with pytest.raises(epcontext.ContextError, match=r"^compiled context of 'ExampleEP_fused_0' cannot be used \(EP "
                                                     r"'ExampleEP' .*CompileFromContext of 'ExampleEP_fused_0' failed "
                                                     r"\(INVALID_GRAPH\): .*\) and the node keeps no subgraph to compile "
                                                     r"again; compile the source model again \(ephost compile\)$"):
        InferenceSession(proto, providers=[(EP, EP_OPTIONS)], env=env7)
