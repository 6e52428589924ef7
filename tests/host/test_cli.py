"""The `ephost` command line, through main(argv) in-process (plus one `python -m` smoke test)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from host.cli import app as cli
from host.cli import session_cmds, zoo
from host.cli.args import DEFAULT_ITERS, DEFAULT_WARMUP, MODEL_DEFAULTS
from host.cli.benchutil import bench_session
from host.errors import InvalidArgument
from host.plugins import loader
from host.runtime.session import InferenceSession

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plugin(example_plugin) -> str:
    # tests/conftest.py builds with build.build_python_plugin("example", 5) once per process:
    # rebuilding here would rewrite a .so that other tests already have mapped.
    return str(example_plugin(5))


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "mlp.onnx"
    assert cli.main(["make-model", "mlp", str(path), "--layers", "2", "--hidden", "8"]) == 0
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def direct_run(model_path, feeds, **kw):
    with InferenceSession(str(model_path), **kw) as s:
        return s.run(None, feeds)


# ---- make-model and run ------------------------------------------------------------------------
def test_make_model_then_run_saves_outputs_equal_to_a_direct_run(capsys, tmp_path):
    model = tmp_path / "t.onnx"
    rc, out, _ = run_cli(capsys, "make-model", "transformer", model, "--seq", 4, "--hidden", 16, "--heads", 2,
                         "--ffn", 32)
    assert rc == 0 and out.startswith(f"wrote {model}: transformer")
    rc, out, err = run_cli(capsys, "run", model, "--random-inputs", "--seed", 3, "--output-dir", tmp_path / "out")
    assert rc == 0, err
    assert "CPUExecutionProvider: " in out
    assert "output: shape=[1, 4, 16] dtype=float32 min=" in out
    saved = np.load(tmp_path / "out" / "output.npy")
    feeds = zoo.random_inputs(zoo.transformer_block(seq=4, hidden=16, heads=2, ffn=32), seed=3)
    np.testing.assert_array_equal(saved, direct_run(model, feeds)[0])


def test_run_with_input_file(capsys, tmp_path, mlp_path):
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    np.save(tmp_path / "x.npy", x)
    rc, _, err = run_cli(capsys, "run", mlp_path, "--input", f"input={tmp_path / 'x.npy'}", "--output-dir", tmp_path)
    assert rc == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "output.npy"), direct_run(mlp_path, {"input": x})[0])


def test_run_on_example_plugin_reports_node_counts(capsys, plugin, mlp_path):
    rc, out, err = run_cli(capsys, "run", mlp_path, "--plugin", plugin, "--ep", "ExampleEP", "--random-inputs",
                           "--optimization-level", "disable")  # counts the model's own 6 nodes, not Gemm fusions
    assert rc == 0, err
    assert out.splitlines()[0] == "ExampleEP: 6 nodes"


def test_ep_options_go_to_the_first_or_the_named_ep(capsys, plugin, mlp_path):
    for option in ("ops=MatMul,Add", "ExampleEP:ops=MatMul,Add"):
        rc, out, err = run_cli(capsys, "run", mlp_path, "--plugin", f"ex={plugin}", "--ep-option", option,
                               "--random-inputs", "--optimization-level", "disable")
        assert rc == 0, err
        assert out.splitlines()[:2] == ["ExampleEP: 4 nodes", "CPUExecutionProvider: 2 nodes"]


def test_plugin_without_device_warns_on_one_line(capsys, plugin, mlp_path, monkeypatch):
    describe = loader.PluginRegistration._describe

    def no_devices(self, slots):
        f = describe(self, slots)
        f.devices = []  # what a GPU plugin reports on a machine without a GPU
        return f

    monkeypatch.setattr(loader.PluginRegistration, "_describe", no_devices)
    rc, out, err = run_cli(capsys, "run", mlp_path, "--plugin", plugin, "--random-inputs",
                           "--optimization-level", "disable")
    assert rc == 0
    assert err.splitlines() == ["warning: ExampleEP has no device; its nodes fall back to CPUExecutionProvider"]
    assert out.splitlines()[0] == "CPUExecutionProvider: 6 nodes"


# ---- errors ------------------------------------------------------------------------------------
def assert_error(rc, out, err, *fragments):
    assert rc == 2
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err + out
    for f in fragments:
        assert f in err


def test_unknown_ep_is_an_error(capsys, plugin, mlp_path):
    rc, out, err = run_cli(capsys, "run", mlp_path, "--plugin", plugin, "--ep", "NoSuchEP", "--random-inputs")
    assert_error(rc, out, err, "--ep 'NoSuchEP': no execution provider 'NoSuchEP'; available: ExampleEP, ")
    # Every name --ep takes: the plugin's EP, the built-in CUDA EP (with a note where it cannot run), the CPU EP.
    assert "CUDAExecutionProvider" in err and ", CPUExecutionProvider (short names: cuda, cpu, example)" in err


def test_malformed_model_names_the_path(capsys, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all")
    assert_error(*run_cli(capsys, "run", bad, "--random-inputs"), str(bad))
    assert_error(*run_cli(capsys, "run", tmp_path / "missing.onnx"), "missing.onnx", "does not exist")


@pytest.mark.parametrize("argv, fragment", [
    (["--ep-option", "nokey"], "expected KEY=VALUE or EP:KEY=VALUE"),
    (["--ep-option", "Other:ops=Add"], "targets EP 'Other', which is not chosen"),
    (["--ep-option", "ops=Add", "--ep", "CPUExecutionProvider"], "CPUExecutionProvider takes no options"),
    ([], "missing input(s) ['input']; give --input NAME=FILE.npy or --random-inputs"),
    (["--input", "input=/nonexistent.npy"], "--input input: cannot read '/nonexistent.npy'"),
])
def test_argument_value_errors(capsys, mlp_path, argv, fragment):
    assert_error(*run_cli(capsys, "run", mlp_path, *argv), fragment)


def test_make_model_rejects_options_of_other_kinds(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "make-model", "mlp", tmp_path / "m.onnx", "--seq", 4)
    assert_error(rc, out, err, "--seq does not apply to mlp; mlp takes --layers")
    assert_error(*run_cli(capsys, "make-model", "cnn", tmp_path / "m.onnx", "--batch", 0), "batch must be")


def test_argparse_errors_exit_2(capsys):
    assert cli.main(["run"]) == 2
    assert cli.main(["make-model", "resnet", "x.onnx"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0


# ---- bench ---------------------------------------------------------------------------------------
def test_bench_prints_percentiles(capsys, plugin, mlp_path):
    rc, out, err = run_cli(capsys, "bench", mlp_path, "--plugin", plugin, "--warmup", 2, "--iters", 5,
                           "--optimization-level", "disable")
    assert rc == 0, err
    for label in ("first run: ", "p50: ", "p90: ", "p99: ", "mean: "):
        assert label in out
    assert "ExampleEP: 6 nodes" in out


def test_bench_iobinding_with_graph_capture_binds_fixed_outputs(capsys, plugin, mlp_path):
    rc, out, err = run_cli(capsys, "bench", mlp_path, "--plugin", plugin, "--ep-option", "enable_graph=1",
                           "--iobinding", "--warmup", 3, "--iters", 5, "--optimization-level", "disable")
    assert rc == 0, err
    assert "mode: run_with_iobinding, graph capture" in out


def test_bench_cuda_graph_passes_enable_cuda_graph_to_the_ep(capsys, plugin, mlp_path):
    # ExampleEP knows no enable_cuda_graph option, so its refusal shows the option arrived.
    rc, out, err = run_cli(capsys, "bench", mlp_path, "--plugin", plugin, "--cuda-graph", "--iters", 1)
    assert_error(rc, out, err, "unknown option(s) ['enable_cuda_graph']")
    assert_error(*run_cli(capsys, "bench", mlp_path, "--cuda-graph"), "need a plugin EP")


def test_bench_plot_without_matplotlib_names_the_package(capsys, mlp_path, monkeypatch):
    monkeypatch.setattr(session_cmds, "has_package", lambda name: False)
    assert_error(*run_cli(capsys, "bench", mlp_path, "--iters", 1, "--plot", "x.png"), "'matplotlib'")


def test_bench_session_counts_calls_and_orders_percentiles():
    calls = []
    stats = bench_session(lambda: calls.append(1), warmup=3, iters=7)
    assert len(calls) == 10 and len(stats["samples_us"]) == 7
    assert stats["min_us"] <= stats["p50_us"] <= stats["p90_us"] <= stats["p99_us"] <= stats["max_us"]
    assert stats["first_run_us"] <= stats["warmup_us"]
    assert bench_session(lambda: None, warmup=0, iters=1)["first_run_us"] > 0
    with pytest.raises(InvalidArgument, match="^iters must be an integer >= 1; got 0$"):
        bench_session(lambda: None, 1, 0)
    with pytest.raises(InvalidArgument, match="^warmup must be an integer >= 0; got -1$"):
        bench_session(lambda: None, -1, 1)


def test_summarize_handles_empty_and_bool_outputs():
    assert session_cmds.summarize("e", np.zeros((0, 3), np.float32)) == "e: shape=[0, 3] dtype=float32 (empty)"
    line = session_cmds.summarize("b", np.array([True, False, True, True, False, True]))
    assert line.startswith("b: shape=[6] dtype=bool min=0 max=1 mean=0.666667 values=[ True, False,")
    assert line.endswith(", ...]")


# ---- plugin-info and entry points --------------------------------------------------------------
def test_plugin_info(capsys, plugin):
    rc, out, err = run_cli(capsys, "plugin-info", plugin)
    assert rc == 0, err
    assert "ExampleEP" in out
    assert_error(*run_cli(capsys, "plugin-info", "/nonexistent/lib.so"), "/nonexistent/lib.so")


def test_python_dash_m_entry_points(tmp_path):
    out = tmp_path / "c.onnx"
    for module in ("host.cli", "host"):
        r = subprocess.run([sys.executable, "-m", module, "make-model", "cnn", str(out), "--size", "8"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert out.is_file()


def test_ep_aliases_name_plugins_and_builtin_eps(capsys, plugin, mlp_path, cuda_plugin_path, monkeypatch):
    # `--ep cuda` registers the CUDA plugin build.py made; without a GPU it falls back with a warning.
    monkeypatch.setenv("EPHOST_CUDA_PLUGIN", str(cuda_plugin_path))
    rc, out, err = run_cli(capsys, "run", str(mlp_path), "--ep", "cuda", "--random-inputs",
                           "--optimization-level", "disable")
    assert rc == 0, err
    assert "output" in out
    from plugin_cuda.plugin import probe_devices

    if not probe_devices()[1]:  # one notice: the plugin's reason and the fallback on one line
        assert len(err.splitlines()) == 1, err
        assert err.startswith("warning: CUDAExecutionProvider: no CUDA device available: ")
        assert err.rstrip().endswith("; its nodes fall back to CPUExecutionProvider")
        assert "RuntimeWarning" not in err
        assert "CPUExecutionProvider: 6 nodes" in out
    rc, out, err = run_cli(capsys, "run", str(mlp_path), "--plugin", f"ex={plugin}", "--ep", "ex",
                           "--random-inputs")
    assert rc == 0, err
    assert "ExampleEP:" in out


# ---- rough edges: folders, help, threads, start-up imports ------------------------------------
def test_make_model_creates_missing_folders(capsys, tmp_path):
    out = tmp_path / "build" / "nested" / "mlp.onnx"
    rc, _, err = run_cli(capsys, "make-model", "mlp", out, "--layers", 1, "--hidden", 4)
    assert rc == 0, err
    model = onnx.load(out)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "Relu"]


def _help(capsys, *argv) -> str:
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def test_make_model_help_shows_the_builders_defaults(capsys):
    text = " ".join(_help(capsys, "make-model").split())
    builders = {"mlp": zoo.mlp, "cnn": zoo.cnn, "transformer": zoo.transformer_block}
    for kind, options in MODEL_DEFAULTS.items():
        params = inspect.signature(builders[kind]).parameters
        for dest, default in options.items():
            assert params[dest].default == default, (kind, dest)  # the table tells the builders' truth
    assert "--seq N transformer: sequence length (default: 128)" in text
    assert "--hidden N mlp/transformer: hidden width (default: 256)" in text
    assert "--layers N mlp: number of MatMul+Add+Relu layers (default: 8)" in text


def test_bench_help_documents_warmup_iters_threads_and_ep_short_names(capsys):
    text = " ".join(_help(capsys, "bench").split())
    assert f"--warmup N untimed runs before timing (default: {DEFAULT_WARMUP})" in text
    assert f"--iters N timed runs (default: {DEFAULT_ITERS})" in text
    assert "--threads N SessionOptions.intra_op_num_threads" in text
    assert "the short names 'cuda' (the built-in CUDA plugin) and 'cpu'" in text


def test_top_help_lists_every_command_and_no_checkout_only_path(capsys):
    text = _help(capsys)
    for command in cli.COMMANDS:
        assert f"    {command.name}" in text
        assert callable(cli.command_function(command))
    assert "libephost_example_v5.so" not in text  # an installed user has no build/lib
    assert "--ep cuda" in text and "python build.py" in text


def test_threads_sets_intra_op_num_threads(capsys, mlp_path, monkeypatch):
    seen = []
    original = session_cmds._session_options
    monkeypatch.setattr(session_cmds, "_session_options", lambda args: seen.append(original(args)) or seen[-1])
    rc, _, err = run_cli(capsys, "run", mlp_path, "--random-inputs", "--threads", 3)
    assert rc == 0, err
    assert seen[0].intra_op_num_threads == 3
    assert_error(*run_cli(capsys, "bench", mlp_path, "--threads", -1),
                 "SessionOptions.intra_op_num_threads must be an integer >= 0; got -1")


def test_importing_the_cli_imports_no_heavy_module():
    # `ephost --help` and every command's start pay for what host.cli imports.
    code = ("import sys, host.cli, host.cli.app; host.cli.app.build_parser(); "
            "print(sorted(m for m in ('numpy', 'onnx', 'onnxscript', 'onnx_ir', 'scipy', 'cffi', 'host.runtime.session')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_cpu_session_without_erf_or_sigmoid_does_not_import_scipy():
    # scipy.special (0.2-0.5 s to import) serves Erf and Sigmoid only: it loads when one of them runs.
    code = ("import sys, host; from host.cli import zoo; "
            "s = host.InferenceSession(zoo.mlp(layers=1, hidden=4).SerializeToString()); "
            "print('scipy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_ops_for_an_ep_without_a_device_is_a_clear_error(capsys):
    """`ephost ops --ep cuda` where the CUDA plugin makes no EP (no GPU, no CuPy): a one-line error naming
    where its table is, not a traceback; with a GPU it lists the plugin's ops."""
    from plugin_cuda.plugin import probe_devices

    code, out, err = run_cli(capsys, "ops", "--ep", "cuda")
    if probe_devices()[1]:  # device names
        assert code == 0 and "LSTM" in out
    else:
        assert code != 0
        assert "CUDAExecutionProvider has no device on this machine, so its ops cannot be probed" in err
