"""Bad input -> a typed error with a one-line message, in the API and in the CLI (exit status 2, one
`error:` line on stderr, no traceback unless --debug)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from host.cli import app as cli
from host.cli import session_cmds, zoo
from host.errors import InvalidArgument, ModelError, NoSuchFile
from host.runtime.model import MAX_OPSET
from host.runtime.session import InferenceSession

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "mlp.onnx"
    onnx.save(zoo.mlp(layers=1, hidden=8), path)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, pattern: str) -> None:
    assert rc == cli.EXIT_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert re.match(pattern, lines[0]), lines[0]


# ---- empty .npy input ----------------------------------------------------------------------------
def test_empty_npy_file_is_one_line(capsys, mlp_path, tmp_path):
    empty = tmp_path / "x.npy"
    empty.write_bytes(b"")
    rc, _, err = run_cli(capsys, "run", mlp_path, "--input", f"input={empty}")
    assert_one_line_error(rc, err, rf"^error: --input input: '{empty}' is empty \(0 bytes\); expected a \.npy file "
                                   r"written by numpy\.save$")


def test_truncated_npy_file_is_one_line(capsys, mlp_path, tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.ones((1, 8), np.float32))
    path.write_bytes(path.read_bytes()[:20])
    rc, _, err = run_cli(capsys, "run", mlp_path, "--input", f"input={path}")
    assert_one_line_error(rc, err, rf"^error: --input input: cannot read '{path}' as a \.npy array: ")


def test_array_with_no_elements_is_a_shape_error(capsys, mlp_path, tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((0, 8), np.float32))
    rc, _, err = run_cli(capsys, "run", mlp_path, "--input", f"input={path}")
    assert_one_line_error(rc, err, r"^error: input 'input': dimension 0 must be 1, got 0 ")


# ---- make-model --opset --------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [1, 7, 8, MAX_OPSET + 1, 30])
def test_make_model_refuses_opsets_run_cannot_take(capsys, tmp_path, opset):
    out = tmp_path / "m.onnx"
    rc, _, err = run_cli(capsys, "make-model", "mlp", out, "--opset", opset)
    assert_one_line_error(rc, err, rf"^error: --opset {opset} is not supported; make-model writes opsets "
                                   rf"9\.\.{MAX_OPSET} \(what `ephost run` accepts\)$")
    assert not out.exists()


@pytest.mark.parametrize("kind, opset", [("mlp", 9), ("cnn", 9), ("mlp", MAX_OPSET), ("cnn", MAX_OPSET),
                                         ("transformer", MAX_OPSET)])
def test_make_model_edges_run(capsys, tmp_path, kind, opset):
    out = tmp_path / "m.onnx"
    rc, _, err = run_cli(capsys, "make-model", kind, out, "--opset", opset)
    assert rc == 0, err
    rc, stdout, err = run_cli(capsys, "run", out, "--random-inputs")
    assert rc == 0, err
    assert "output: shape=" in stdout


# ---- a directory, a missing file ----------------------------------------------------------------
def test_directory_as_model(capsys, tmp_path):
    with pytest.raises(ModelError, match=rf"^model path '{tmp_path}' is a directory; expected an ONNX model file "
                                         r"\(\.onnx\)$"):
        InferenceSession(str(tmp_path))
    rc, _, err = run_cli(capsys, "run", tmp_path, "--random-inputs")
    assert_one_line_error(rc, err, rf"^error: model path '{tmp_path}' is a directory")


def test_missing_model_is_no_such_file(tmp_path):
    missing = tmp_path / "missing.onnx"
    with pytest.raises(NoSuchFile, match=rf"^model file '{missing}' does not exist$") as info:
        InferenceSession(str(missing))
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ModelError)


# ---- IOBinding.get_outputs before a run ----------------------------------------------------------
def test_get_outputs_before_any_run(mlp_path):
    s = InferenceSession(str(mlp_path))
    b = s.io_binding()
    b.bind_input("input", np.ones((1, 8), np.float32))
    b.bind_output("output")
    msg = r"^IOBinding has no outputs yet: call run_with_iobinding\(binding\) before get_outputs\(\)$"
    with pytest.raises(InvalidArgument, match=msg):
        b.get_outputs()
    with pytest.raises(InvalidArgument, match=msg):
        b.copy_outputs_to_cpu()
    s.run_with_iobinding(b)
    np.testing.assert_allclose(b.get_outputs()[0].numpy(), s.run(None, {"input": np.ones((1, 8), np.float32)})[0])


# ---- the CLI's error funnel ------------------------------------------------------------------------
@pytest.mark.parametrize("exc, line", [
    (ValueError("bad value\nsecond line"), "error: ValueError: bad value second line"),
    (OSError(28, "No space left on device"), "error: OSError: [Errno 28] No space left on device"),
    (InvalidArgument("plain message"), "error: plain message"),
])
def test_cli_turns_errors_into_one_line(capsys, monkeypatch, mlp_path, exc, line):
    def boom(args):
        raise exc
    monkeypatch.setattr(session_cmds, "cmd_run", boom)
    rc, _, err = run_cli(capsys, "run", mlp_path)
    assert rc == cli.EXIT_ERROR and err.strip() == line


@pytest.mark.parametrize("argv", [["--debug", "run", "{dir}"], ["run", "{dir}", "--debug"]])
def test_debug_flag_shows_the_traceback(capsys, tmp_path, argv):
    rc, _, err = run_cli(capsys, *[a.format(dir=tmp_path) for a in argv])
    assert rc == cli.EXIT_ERROR
    assert err.startswith("Traceback (most recent call last):")
    assert err.strip().splitlines()[-1].startswith(f"error: model path '{tmp_path}' is a directory")


def test_console_script_error_is_one_line(tmp_path):
    """Through the real entry point in a fresh interpreter (no traceback printed by Python either)."""
    proc = subprocess.run([sys.executable, "-m", "host.cli", "run", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == cli.EXIT_ERROR
    assert proc.stderr.strip().splitlines() == [f"error: model path '{tmp_path}' is a directory; expected an ONNX "
                                                "model file (.onnx)"]
