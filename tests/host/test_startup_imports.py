"""Start-up stays light: what `import host`, `ephost --help` and a session read from the optimized-model
cache import, checked in fresh interpreters (sys.modules), not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx

from host.cli import zoo

ROOT = Path(__file__).resolve().parents[2]
# Each costs from 0.05 s (rich) to 0.3 s (onnx-ir with sympy) to import.
OPTIMIZER = ("onnxscript", "onnx_ir", "sympy")
HEAVY = (*OPTIMIZER, "numpy", "onnx", "cffi", "rich", "tqdm", "ray", "cupy", "torch", "scipy")

# A module counts once its code has run: host/optimizer/deferred.py puts stand-ins in sys.modules for
# modules that load only when used (sympy among them).
_REPORT = ("import json, sys\n"
           "def loaded(m):\n"
           "    return m in sys.modules and '_deferred_spec' not in vars(sys.modules[m])\n"
           "print(json.dumps(sorted(m for m in {heavy!r} if loaded(m))))")


def _imported(code: str, heavy=HEAVY, env: dict | None = None, *args: str) -> list[str]:
    """The modules of `heavy` that a fresh interpreter has imported after running `code`."""
    script = f"{code}\n{_REPORT.format(heavy=tuple(heavy))}"
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_host_imports_nothing_heavy():
    assert _imported("import host") == []


def test_ephost_help_imports_nothing_heavy():
    code = ("import contextlib, io\nfrom host.cli.app import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            "assert 'make-model' in out.getvalue(), out.getvalue()")
    assert _imported(code) == []


def test_a_cached_session_does_not_import_the_optimizer(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(zoo.transformer_block(seq=8, hidden=32, heads=4, ffn=64), path)
    code = ("import sys, host\ns = host.InferenceSession(sys.argv[1])\n"
            "assert s.optimization.nodes_after < s.optimization.nodes_before, s.optimization.summary()")
    env = {"EPHOST_CACHE_DIR": str(tmp_path / "cache")}
    # The first one optimizes with onnxscript's rewriter but not onnxscript's package code (a partial
    # stand-in, host/optimizer/deferred.py), and with static shapes sympy stays a stand-in: onnx-ir
    # needs it only for symbolic dims (tests/host/optimizer/test_deferred.py).
    optimizer = (*OPTIMIZER, "onnxscript.rewriter")
    assert _imported(code, optimizer, env, str(path)) == ["onnx_ir", "onnxscript.rewriter"]
    assert _imported(code, optimizer, env, str(path)) == []  # the next ones read the cache


# What a first session (no optimized-model cache) of a small model must not load: the modules
# host/optimizer/deferred.py defers, and what onnxscript's package code imports for its script
# front end (the converter, the generated opset classes), which the optimizer does not use.
LAZY = ("sympy", "onnx_ir._symbolic_shapes", "onnx.reference", "onnx.reference.ops", "onnxscript",
        "onnxscript._internal.converter", "onnxscript.onnx_opset", "onnxscript.backend")


def test_a_first_session_of_a_small_model_loads_none_of_the_deferred_modules(tmp_path):
    paths = []
    for name, model in (("mlp", zoo.mlp(layers=4, hidden=64)), ("cnn", zoo.cnn(size=16)),
                        ("block", zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128))):
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model, paths[-1])
    # Optimized: the sessions run the optimizer (their node counts drop), with the cache off.
    code = ("import sys, host\nso = host.SessionOptions()\n"
            "so.add_session_config_entry('session.ephost.optimized_model_cache', '0')\n"
            "for path in sys.argv[1:]:\n"
            "    s = host.InferenceSession(path, so, providers=['CPUExecutionProvider'])\n"
            "    assert s.optimization.nodes_after < s.optimization.nodes_before, s.optimization.summary()")
    assert _imported(code, (*LAZY, "onnxscript.rewriter"), None, *paths) == ["onnxscript.rewriter"]
