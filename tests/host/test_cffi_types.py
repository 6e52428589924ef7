"""host/runtime/cffi_types.py: the creation path's C types, parsed at once, are the types cffi parses alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import cffi
import cffi.cparser
import numpy as np
import pytest
from onnx import TensorProto, helper

import abi
from host.runtime import cffi_types

ROOT = Path(__file__).resolve().parents[2]


def _fresh_ffi() -> cffi.FFI:
    ffi = cffi.FFI()  # not abi.ffi_for's (cached, shared with the sessions): nothing parsed yet
    ffi.cdef(abi.cdef(abi.ABI_VERSION))
    return ffi


def test_primed_types_are_the_types_cffi_parses_one_by_one():
    primed, alone = _fresh_ffi(), _fresh_ffi()
    assert cffi_types.prime(primed)
    for cdecl in cffi_types.CREATION_TYPES:
        a, b = primed.typeof(cdecl), alone.typeof(cdecl)
        assert (a.cname, a.kind) == (b.cname, b.kind), cdecl
        item_a, item_b = (a.item, b.item) if a.kind in ("array", "pointer") else (a, b)
        if item_a.kind != "void":
            assert primed.sizeof(item_a) == alone.sizeof(item_b), cdecl
    values = primed.new("EpValueInfo[]", 3)
    values[2].ndim = 5
    assert len(values) == 3 and values[2].ndim == 5 and values[0].ndim == 0  # zeroed, as ffi.new's


def test_after_priming_cffi_parses_none_of_them(monkeypatch):
    ffi = _fresh_ffi()
    assert cffi_types.prime(ffi)
    parsed = []
    original = cffi.cparser.Parser.parse_type_and_quals
    monkeypatch.setattr(cffi.cparser.Parser, "parse_type_and_quals",
                        lambda self, cdecl: parsed.append(cdecl) or original(self, cdecl))
    for cdecl in cffi_types.CREATION_TYPES:
        ffi.typeof(cdecl)
    ffi.typeof("EpStatus*")  # not primed: parsed as usual
    assert parsed == ["EpStatus*"]


# A fresh interpreter (this one's FFI has parsed types for other tests): the runtime imported, then the
# types cffi parses while a session is created, printed.
_CHILD = """
import sys, cffi.cparser, host, numpy as np
host.InferenceSession
parsed, original = [], cffi.cparser.Parser.parse_type_and_quals
cffi.cparser.Parser.parse_type_and_quals = lambda self, cdecl: parsed.append(cdecl) or original(self, cdecl)
sess = host.InferenceSession(sys.stdin.buffer.read(), providers=["CPUExecutionProvider"])
print(repr(parsed))
print(repr(sess.run(None, {"x": np.ones((2, 3), np.float32)})[0].tolist()))
"""


def test_a_session_parses_no_type_of_its_own_while_created():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=1), helper.make_node("Relu", ["s"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD], input=model.SerializeToString(), capture_output=True,
                         cwd=ROOT, env=env, check=True).stdout.decode().splitlines()
    assert ast.literal_eval(out[0]) == []
    np.testing.assert_allclose(ast.literal_eval(out[1]), np.full((2, 3), 1 / 3), rtol=1e-6)


def test_an_unknown_type_leaves_everything_to_cffi():
    ffi = _fresh_ffi()
    assert not cffi_types.prime(ffi, ("EpValueInfo[]", "NoSuchType*"))
    assert "EpValueInfo[]" not in ffi._parsed_types
    with pytest.raises(cffi.CDefError):
        ffi.typeof("NoSuchType*")
