"""host/optimizer/deferred.py: sympy and onnx's reference kernels load only when used, and then work.

Each check runs in a fresh interpreter: in the test process other tests have imported both long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from host.optimizer import deferred

ROOT = Path(__file__).resolve().parents[3]


def _child(code: str, tmp_path: Path) -> dict:
    env = {**os.environ, "EPHOST_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_first_session_of_each_small_zoo_model_loads_neither_and_matches_onnxruntime(tmp_path):
    got = _child("""
        import json
        import numpy as np, onnxruntime as ort
        import host
        from host.cli import zoo
        from host.optimizer import deferred
        models = [zoo.mlp(layers=4, hidden=64), zoo.cnn(size=16),
                  zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128)]
        worst = 0.0
        for model in models:
            data = model.SerializeToString()
            so = host.SessionOptions()
            so.add_session_config_entry("session.ephost.optimized_model_cache", "0")  # the first-session path
            sess = host.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
            assert sess.get_providers() == ["CPUExecutionProvider"]
            feeds = {i.name: np.random.default_rng(0).standard_normal(
                [d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32) for i in sess.get_inputs()}
            want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            worst = max(worst, float(np.max(np.abs(sess.run(None, feeds)[0] - want))))
        print(json.dumps({"loaded": [n for n in deferred.DEFERRED if deferred.loaded(n)], "worst": worst}))
    """, tmp_path)
    assert got["loaded"] == []
    assert got["worst"] < 1e-4


def test_the_deferred_modules_load_on_first_use_and_work(tmp_path):
    """Symbolic dim arithmetic (sympy), the reference evaluator, and constant folding (which reaches the
    reference kernels as `onnx.reference.ops.load_op`, through the parent's attribute)."""
    got = _child("""
        import json
        import numpy as np, onnx
        from onnx import helper, numpy_helper, TensorProto
        from host.optimizer import deferred, optimize
        import onnx_ir as ir
        before = [n for n in deferred.DEFERRED if deferred.loaded(n)]
        a = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "a")
        b = numpy_helper.from_array(np.full((2, 3), 0.5, np.float32), "b")
        graph = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])],
                                  "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [a, b])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        folded = optimize(model).model
        from onnx.reference import ReferenceEvaluator
        x = np.ones((2, 3), np.float32)
        print(json.dumps({
            "before": before,
            "dim": str(ir.SymbolicDim("N") * 2 + 1),
            "ops": [n.op_type for n in folded.graph.node],
            "folded_right": bool(np.array_equal(ReferenceEvaluator(folded).run(None, {"x": x})[0],
                                                x + (np.arange(6).reshape(2, 3) - 0.5))),
            "after": [n for n in deferred.DEFERRED if deferred.loaded(n)],
        }))
    """, tmp_path)
    assert got["before"] == []
    assert got["dim"] == "2*N + 1"
    assert got["ops"] == ["Add"] and got["folded_right"]  # Sub of two constants folded by the reference kernel
    assert got["after"] == list(deferred.DEFERRED)


def test_defer_leaves_imported_missing_and_compiled_modules_alone():
    assert deferred.defer("json") is False                       # imported already
    assert deferred.defer("no_such_module_xyz") is False          # not installed
    assert "no_such_module_xyz" not in sys.modules
    if "_testcapi" in sys.modules:
        pytest.skip("_testcapi, the compiled module tried here, is imported in this process already")
    assert deferred.defer("_testcapi") is False  # an extension module cannot run into a stand-in
    assert "_testcapi" not in sys.modules


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    """A module on sys.path whose code takes a while and defines FIRST before, LAST after the wait."""
    name = f"_ephost_slow_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("import time\nFIRST = 1\ntime.sleep(0.3)\nLAST = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_thread_reading_a_module_another_thread_is_loading_waits_for_the_whole_module(slow_module):
    import threading

    assert deferred.defer(slow_module) is True
    module = sys.modules[slow_module]
    assert not deferred.loaded(slow_module)
    seen, errors = {}, []

    def read(attr):
        try:
            seen[attr] = getattr(module, attr)
        except AttributeError as exc:
            errors.append(exc)

    first = threading.Thread(target=read, args=("FIRST",))
    first.start()
    while "FIRST" not in vars(module):  # the first thread is inside the module's code, in its sleep
        pass
    second = threading.Thread(target=read, args=("LAST",))
    second.start()
    first.join()
    second.join()
    assert errors == [] and seen == {"FIRST": 1, "LAST": 2}
    assert deferred.loaded(slow_module)
    with pytest.raises(AttributeError, match=rf"^module '{slow_module}' has no attribute 'MISSING'$"):
        module.MISSING  # noqa: B018 - the read is the test


def test_onnxscript_imports_its_submodules_without_its_package_code_then_loads_whole_on_other_names(tmp_path):
    """The partial stand-in: onnxscript.rewriter imports without onnxscript/__init__.py (no script converter,
    no generated opsets); `from onnxscript import opset18` and `onnxscript.__version__` load the package."""
    got = _child("""
        import importlib.metadata, json, sys
        from host.optimizer import deferred
        import onnxscript.rewriter
        partial = [deferred.loaded("onnxscript"), "onnxscript.onnx_opset" in sys.modules,
                   onnxscript.rewriter is sys.modules["onnxscript.rewriter"]]
        from onnxscript import opset18 as op
        whole = [deferred.loaded("onnxscript"), op.Add.__name__, onnxscript.script.__name__,
                 onnxscript.__version__ == importlib.metadata.version("onnxscript")]
        print(json.dumps({"partial": partial, "whole": whole}))
    """, tmp_path)
    assert got["partial"] == [False, False, True]
    assert got["whole"] == [True, "Add", "script", True]


def test_a_stand_in_deferred_before_its_parent_is_imported_is_linked_to_it(tmp_path):
    """host.optimizer imported before onnx: `onnx.reference` must still be onnx's attribute once onnx
    loads, or onnxscript's folding fails quietly (a constant Sub stayed unfolded)."""
    got = _child("""
        import json, sys
        from host.optimizer import deferred  # before onnx
        stand_in_first = "onnx" not in sys.modules and "onnx.reference" in sys.modules
        import importlib.util
        importlib.util.find_spec("onnx")  # a look that imports nothing leaves the link waiting
        import numpy as np, onnx
        from host.optimizer import optimize
        from onnx import helper, numpy_helper, TensorProto
        a = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "a")
        b = numpy_helper.from_array(np.full((2, 3), 0.5, np.float32), "b")
        graph = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])],
                                  "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [a, b])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        print(json.dumps({"stand_in_first": stand_in_first,
                          "linked": onnx.reference is sys.modules["onnx.reference"],
                          "loader": type(onnx.__loader__).__name__,
                          "ops": [n.op_type for n in optimize(model).model.graph.node]}))
    """, tmp_path)
    assert got["stand_in_first"] is True
    assert got["linked"] is True and got["loader"] == "SourceFileLoader"
    assert got["ops"] == ["Add"]


def test_no_name_of_onnxscript_s_package_code_is_a_submodule_of_another_meaning():
    """The partial stand-in answers a submodule's name with the submodule: right only while the package's
    own code binds no other object to such a name (checked on the installed onnxscript)."""
    import pkgutil

    import onnxscript

    assert callable(onnxscript.script)  # the whole package, loaded here if it was partial
    submodules = {m.name for m in pkgutil.iter_modules(onnxscript.__path__)}
    assert "rewriter" in submodules and "optimizer" in submodules
    clashes = [name for name, value in vars(onnxscript).items()
               if name in submodules and getattr(value, "__name__", None) != f"onnxscript.{name}"]
    assert clashes == []
