"""The `ephost` command line: run a model, make a zoo model, benchmark, inspect a plugin.

    ephost run model.onnx --plugin build/lib/libephost_example_v5.so --random-inputs
    ephost run model.onnx --plugin ex=lib.so --ep ExampleEP --ep-option ops=Add,Relu --input x=x.npy
    ephost make-model transformer block.onnx --seq 16 --hidden 64 --heads 4
    ephost bench model.onnx --plugin lib.so --iters 200 --iobinding
    ephost plugin-info build/lib/libephost_example_v5.so

Plugins: `--plugin PATH` registers the library under its file stem; `--plugin NAME=PATH` under NAME.
EPs: `--ep NAME` in priority order; with none, every EP of the registered plugins, in order. Nodes
no chosen EP claims run on the built-in CPU EP.
EP options: `--ep-option KEY=VALUE` goes to the first chosen EP; `--ep-option EP:KEY=VALUE` to EP.
Errors print `error: <message>` (one line) on stderr and exit with status 2; `--debug` adds the traceback.
Profiling: `ephost run MODEL --profile [PREFIX]` writes a Chrome-trace JSON (Perfetto, chrome://tracing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from host.errors import EphostError, InvalidArgument, ModelError

CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
EXIT_ERROR = 2


class CliError(EphostError):
    """A command cannot proceed: a missing optional package, a file it cannot read or write."""


# ---- shared pieces -----------------------------------------------------------------------------
def parse_plugin(spec: str) -> tuple[str, str]:
    """`NAME=PATH` or `PATH` (registered under the file stem) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name:
        if not path:
            raise InvalidArgument(f"--plugin {spec!r}: no path after '='; expected NAME=PATH or PATH")
        return name, path
    return Path(spec).stem, spec


def parse_ep_options(items: list[str], eps: list[str]) -> dict[str, dict[str, str]]:
    """`KEY=VALUE` (first chosen EP) and `EP:KEY=VALUE` (the EP named) -> {ep: {key: value}}."""
    options: dict[str, dict[str, str]] = {ep: {} for ep in eps}
    for item in items:
        target, sep, value = item.partition("=")
        if not sep or not target:
            raise InvalidArgument(f"--ep-option {item!r}: expected KEY=VALUE or EP:KEY=VALUE")
        ep, colon, key = target.partition(":")
        if not colon:
            if not eps:
                raise InvalidArgument(f"--ep-option {item!r}: no EP chosen to take it; give --plugin and/or --ep")
            ep, key = eps[0], target
        if ep not in options:
            raise InvalidArgument(f"--ep-option {item!r} targets EP {ep!r}, which is not chosen; chosen: {eps}")
        if ep == CPU_EP:
            raise InvalidArgument(f"--ep-option {item!r}: {CPU_EP} takes no options")
        if not key:
            raise InvalidArgument(f"--ep-option {item!r}: empty option name")
        options[ep][key] = value
    return options


@contextlib.contextmanager
def _warnings_as_lines():
    """Show each warning as one `warning: ...` line on stderr instead of file:line plus source."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("default", RuntimeWarning)
        warnings.simplefilter("default", UserWarning)
        warnings.showwarning = show
        yield


def _load_model(path: str):
    from host.runtime.model import load_model

    return load_model(path)


def _environment(plugins: list[str]):
    from host.plugins.environment import Environment

    env = Environment()
    try:
        for spec in plugins:
            env.register_plugin(*parse_plugin(spec))
    except BaseException:
        env.close()
        raise
    return env


# Short EP names for the command line; `--ep cuda` also registers the built-in CUDA plugin
# (built for this Python into the per-user cache on first use; $EPHOST_CUDA_PLUGIN overrides the path).
EP_ALIASES = {"cuda": "CUDAExecutionProvider", "cpu": CPU_EP, "example": "ExampleEP"}


def _chosen_eps(env, names: list[str]) -> list[str]:
    if not names:
        return [f.name for reg in env.plugins.values() for f in reg.factories]
    chosen = []
    for name in names:
        reg = env.plugins.get(name)
        if reg is not None:  # a plugin's registration name stands for its EPs
            chosen += [f.name for f in reg.factories]
            continue
        ep = EP_ALIASES.get(name.lower(), name)
        # A built-in provider (CUDA) is built/found by the session, which falls back to the CPU EP without it.
        chosen.append(ep)
    return chosen


def _session_options(args):
    """SessionOptions from the command line (`run --profile [PREFIX]`)."""
    from host.runtime.options import SessionOptions

    so = SessionOptions()
    level = getattr(args, "optimization_level", None)
    if level is not None:
        so.graph_optimization_level = level  # a name: "disable", "basic", "extended", "all"
    prefix = getattr(args, "profile", None)
    if prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = prefix
    return so


def _open_session(stack: contextlib.ExitStack, args, extra_options: dict[str, str] | None = None):
    """Environment, plugins and InferenceSession from the shared options; closed by `stack`."""
    from host.runtime.session import InferenceSession

    model = _load_model(args.model)
    env = _environment(args.plugin)
    stack.callback(env.close)
    eps = _chosen_eps(env, args.ep)
    options = parse_ep_options(args.ep_option, eps)
    if extra_options:
        plugin_eps = [ep for ep in eps if ep != CPU_EP]
        if not plugin_eps:
            raise InvalidArgument(f"options {extra_options} need a plugin EP; give --plugin and/or --ep")
        options[plugin_eps[0]].update(extra_options)
    try:
        session = InferenceSession(model, _session_options(args), providers=[(ep, options[ep]) for ep in eps],
                                   env=env)
    except ModelError as exc:
        if args.model in str(exc):
            raise
        raise ModelError(f"model '{args.model}': {exc}") from exc
    stack.callback(session.close)
    if getattr(args, "verbose", False):
        report = getattr(session, "optimization", None)
        print(report.summary() if report is not None else "optimizer: disabled")
    return session, model


def _load_npy(name: str, file: str) -> np.ndarray:
    """One --input file as an array; every unreadable file is one CliError line."""
    path = Path(file)
    if path.is_file() and path.stat().st_size == 0:
        raise CliError(f"--input {name}: '{file}' is empty (0 bytes); expected a .npy file written by numpy.save")
    try:
        return np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:  # EOFError: a truncated .npy
        raise CliError(f"--input {name}: cannot read '{file}' as a .npy array: {exc}") from exc


def _feeds(args, model, session, random_missing: bool) -> dict[str, np.ndarray]:
    feeds = {}
    for item in args.input:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise InvalidArgument(f"--input {item!r}: expected NAME=FILE.npy")
        feeds[name] = _load_npy(name, file)
    missing = [i.name for i in session.get_inputs() if i.name not in feeds]
    if missing and not random_missing:
        raise InvalidArgument(f"missing input(s) {missing}; give --input NAME=FILE.npy or --random-inputs")
    if missing:
        from host.cli.zoo import random_inputs

        generated = random_inputs(model, seed=args.seed)
        feeds.update({name: generated[name] for name in missing})
    return feeds


def _node_counts(session) -> list[str]:
    counts = Counter(session.node_assignment().values())
    order = [ep for ep in session.get_providers() if ep in counts]
    order += sorted(set(counts) - set(order))
    return [f"{ep}: {counts[ep]} node{'s' if counts[ep] != 1 else ''}" for ep in order]


def summarize(name: str, value: np.ndarray, count: int = 5) -> str:
    """One line: name, shape, dtype, min/max/mean and the first `count` values."""
    head = f"{name}: shape={list(value.shape)} dtype={value.dtype}"
    if value.size == 0:
        return head + " (empty)"
    flat = value.reshape(-1)
    numeric = flat.astype(np.float64) if value.dtype == np.bool_ else flat
    first = np.array2string(flat[:count], precision=4, separator=", ", max_line_width=10_000)
    more = ", ..." if value.size > count else ""
    return (f"{head} min={numeric.min():.6g} max={numeric.max():.6g} mean={numeric.mean():.6g} "
            f"values={first[:-1]}{more}]")


def _file_name(output: str) -> str:
    # Output names may hold '/' or ':' (torch exports); keep file names flat and portable.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", output) + ".npy"


def _save_outputs(directory: str, names: list[str], values: list[np.ndarray]) -> list[Path]:
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, value in zip(names, values):
            path = out / _file_name(name)
            np.save(path, value)
            paths.append(path)
    except OSError as exc:
        raise CliError(f"cannot write outputs to '{out}': {exc}") from exc
    return paths


# ---- ephost run --------------------------------------------------------------------------------
def cmd_run(args) -> int:
    with contextlib.ExitStack() as stack:
        session, model = _open_session(stack, args)
        feeds = _feeds(args, model, session, random_missing=args.random_inputs)
        names = [o.name for o in session.get_outputs()]
        values = session.run(names, feeds)
        for line in _node_counts(session):
            print(line)
        for name, value in zip(names, values):
            print(summarize(name, value))
        if args.output_dir:
            for path in _save_outputs(args.output_dir, names, values):
                print(f"saved {path}")
        if args.profile is not None:
            print(f"profile: {session.end_profiling()}")
    return 0


# ---- ephost make-model -------------------------------------------------------------------------
# Which options each model kind takes (argparse dest -> builder keyword).
_MODEL_OPTIONS = {
    "mlp": {"layers": "layers", "hidden": "hidden", "batch": "batch", "in_features": "in_features",
            "use_gemm": "use_gemm"},
    "cnn": {"batch": "batch", "channels": "channels", "size": "size"},
    "transformer": {"batch": "batch", "seq": "seq", "hidden": "hidden", "heads": "heads", "ffn": "ffn"},
}
_ALL_MODEL_OPTIONS = sorted({k for opts in _MODEL_OPTIONS.values() for k in opts})


def _check_opset(opset: int) -> None:
    from host.runtime.model import MAX_OPSET

    # Below 9 the models would need IR version 3 (initializers listed as graph inputs), which the
    # builders do not write; above MAX_OPSET `ephost run` refuses the model.
    if not MIN_ZOO_OPSET <= opset <= MAX_OPSET:
        raise InvalidArgument(f"--opset {opset} is not supported; make-model writes opsets "
                              f"{MIN_ZOO_OPSET}..{MAX_OPSET} (what `ephost run` accepts)")


MIN_ZOO_OPSET = 9


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def cmd_make_model(args) -> int:
    import onnx

    from host.cli import zoo

    builders = {"mlp": zoo.mlp, "cnn": zoo.cnn, "transformer": zoo.transformer_block}
    allowed = _MODEL_OPTIONS[args.kind]
    values = {d: getattr(args, d) for d in _ALL_MODEL_OPTIONS}
    # `is not` because `0 in (None, False)` is true, and --layers 0 must reach the builder's check.
    given = {d: v for d, v in values.items() if v is not None and v is not False}
    stray = sorted(_flag(d) for d in given if d not in allowed)
    if stray:
        verb = "does" if len(stray) == 1 else "do"
        raise InvalidArgument(f"{', '.join(stray)} {verb} not apply to {args.kind}; "
                              f"{args.kind} takes {', '.join(_flag(d) for d in allowed)}")
    kwargs = {allowed[d]: v for d, v in given.items()}
    _check_opset(args.opset)
    model = builders[args.kind](seed=args.seed, opset=args.opset, dynamic_batch=args.dynamic_batch, **kwargs)
    try:
        onnx.save(model, args.out)
    except OSError as exc:
        raise CliError(f"cannot write model to '{args.out}': {exc}") from exc
    print(f"wrote {args.out}: {args.kind}, {len(model.graph.node)} nodes, opset {args.opset}")
    return 0


# ---- ephost bench ------------------------------------------------------------------------------
def has_package(name: str) -> bool:
    """Whether `name` can be imported (without importing it)."""
    return importlib.util.find_spec(name) is not None


def _require_matplotlib() -> None:
    if not has_package("matplotlib"):
        raise CliError("--plot needs the 'matplotlib' package, which is not installed (pip install matplotlib)")


def _gpu_device(session) -> int | None:
    """The device id of the first plugin EP on a GPU in the plan, or None when all is on the CPU."""
    import abi

    for ep in session.plan.eps:
        if ep.location[0] != abi.DEVICE_CPU:
            return ep.location[1]
    return None


def _output_specs(session, feeds) -> list[tuple[str, tuple, np.dtype]]:
    from abi.dtypes import to_numpy

    metas = session.graph.outputs
    if all(m.shape is not None and all(isinstance(d, int) and d > 0 for d in m.shape) for m in metas):
        return [(m.name, tuple(m.shape), to_numpy(m.elem_type)) for m in metas]
    # Some dims are symbolic: one plain run tells their sizes for these feeds.
    values = session.run([m.name for m in metas], feeds)
    return [(m.name, v.shape, v.dtype) for m, v in zip(metas, values)]


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise CliError(f"binding GPU buffers needs the 'cupy' package, which cannot be imported ({exc})") from exc
    return cupy


def _bound_runner(session, feeds: dict, fixed_outputs: bool):
    """run_with_iobinding over one binding; `fixed_outputs` binds preallocated output buffers.

    When an EP of the plan lives on a GPU, inputs and fixed outputs are CuPy arrays on its device
    (CuPy is imported only then), so runs do not copy through host memory.
    """
    binding = session.io_binding()
    gpu = _gpu_device(session)
    cupy = _cupy() if gpu is not None else None

    def on_device(make):
        with cupy.cuda.Device(gpu):
            return make()

    for name, value in feeds.items():
        binding.bind_input(name, value if cupy is None else on_device(lambda v=value: cupy.asarray(v)))
    if fixed_outputs:
        for name, shape, dtype in _output_specs(session, feeds):
            if cupy is None:
                binding.bind_output(name, np.empty(shape, dtype))
            else:
                binding.bind_output(name, on_device(lambda s=shape, d=dtype: cupy.empty(s, d)))
    else:
        for out in session.get_outputs():
            binding.bind_output(out.name)

    def run():
        session.run_with_iobinding(binding)

    return run


def _plot(samples: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(samples, bins=min(50, max(10, len(samples) // 5)))
    ax.set_xlabel("latency (us)")
    ax.set_ylabel("runs")
    ax.set_title(title)
    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    except OSError as exc:
        raise CliError(f"cannot write plot to '{path}': {exc}") from exc
    finally:
        plt.close(fig)


def cmd_bench(args) -> int:
    from host.cli.benchutil import PlanReports, bench_session, format_stats, plan_counts

    if args.plot:
        _require_matplotlib()  # fail before a long run, not after
    extra = {"enable_cuda_graph": "1"} if args.cuda_graph else None
    with contextlib.ExitStack() as stack:
        with PlanReports() as reports:
            session, model = _open_session(stack, args, extra)
        feeds = _feeds(args, model, session, random_missing=True)
        if args.cuda_graph or args.iobinding:
            # An EP capturing graphs (whatever option turned it on) replays into fixed buffers.
            fixed = args.cuda_graph or session.capture.enabled
            run = _bound_runner(session, feeds, fixed_outputs=fixed)
            mode = "run_with_iobinding" + (", graph capture" if session.capture.enabled else "")
        else:
            def run():
                session.run(None, feeds)
            mode = "run"
        stats = bench_session(run, args.warmup, args.iters)
        print(f"model: {args.model}")
        print(f"mode: {mode}")
        for line in _node_counts(session) + plan_counts(session, reports.lines):
            print(line)
        print(format_stats(stats))
        if CUDA_EP in session.get_providers() and not session.capture.enabled:
            # The CUDA EP also replays: a second session captures a CUDA graph and times its replays.
            replay_session, _ = _open_session(stack, args, {"enable_cuda_graph": "1"})
            replay = bench_session(_bound_runner(replay_session, feeds, fixed_outputs=True), args.warmup, args.iters)
            print("mode: run_with_iobinding, graph capture (replay)")
            print(format_stats(replay))
    if args.plot:
        _plot(stats["samples_us"], args.plot, f"{Path(args.model).name}: {mode}, {args.iters} runs")
        print(f"plot: {args.plot}")
    return 0


# ---- ephost plugin-info ------------------------------------------------------------------------
def cmd_plugin_info(args) -> int:
    try:
        from host.plugins import plugin_info as pinfo
    except ModuleNotFoundError as exc:
        if exc.name != "host.plugins.plugin_info":
            raise
        raise CliError("plugin-info needs host.plugins.plugin_info, which this installation lacks") from exc
    import abi

    version = abi.ABI_VERSION if args.api_version is None else args.api_version
    print(pinfo.format_plugin_info(pinfo.plugin_info(args.path, version)))
    return 0


def cmd_build(args) -> int:
    from host.native_build import build_everything

    for name, path in build_everything().items():
        print(f"{name}: {path}")
    return 0


# ---- parser ------------------------------------------------------------------------------------
def _add_session_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--plugin", action="append", default=[], metavar="[NAME=]PATH",
                   help="register an EP plugin library (name: NAME, or the file stem)")
    p.add_argument("--ep", action="append", default=[], metavar="NAME",
                   help="execution provider, in priority order (default: every EP of the plugins)")
    p.add_argument("--ep-option", action="append", default=[], metavar="[EP:]KEY=VALUE",
                   help="provider option for the first chosen EP, or for EP with the EP: prefix")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="feed an input")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--optimization-level", choices=["disable", "basic", "extended", "all"], default="all",
                   help="graph optimization before partitioning (default: all; docs/optimizer.md)")
    p.add_argument("--verbose", action="store_true", help="print what each optimizer pass changed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ephost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run a model once and summarise its outputs")
    _add_session_options(p)
    p.add_argument("--random-inputs", action="store_true", help="fill inputs not given with random data")
    p.add_argument("--output-dir", metavar="DIR", help="save each output as DIR/NAME.npy")
    p.add_argument("--profile", nargs="?", const="ephost_profile_", metavar="PREFIX",
                   help="write a Chrome-trace profile (Perfetto, chrome://tracing) to PREFIX<date>_<pid>_<n>.json")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("make-model", help="write a zoo model (mlp, cnn, transformer)")
    p.add_argument("kind", choices=sorted(_MODEL_OPTIONS))
    p.add_argument("out", metavar="OUT.onnx")
    for dest in ("layers", "hidden", "batch", "seq", "heads", "ffn", "channels", "size", "in_features"):
        p.add_argument(_flag(dest), dest=dest, type=int, metavar="N")
    p.add_argument("--use-gemm", action="store_true", help="mlp: Gemm + Relu instead of MatMul + Add + Relu")
    p.add_argument("--dynamic-batch", action="store_true", help="symbolic batch dimension 'batch'")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("bench", help="time repeated runs: p50/p90/p99 and mean latency")
    _add_session_options(p)
    p.add_argument("--iobinding", action="store_true", help="run_with_iobinding (outputs allocated by the EP)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="set enable_cuda_graph=1 on the first EP and bind preallocated outputs")
    p.add_argument("--warmup", type=int, default=10, metavar="N")
    p.add_argument("--iters", type=int, default=100, metavar="N")
    p.add_argument("--plot", metavar="FILE.png", help="latency histogram (needs matplotlib)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("build", help="build the built-in plugins for this Python into the per-user cache")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("plugin-info", help="a plugin's ABI versions, slots and devices")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--api-version", type=int, metavar="N", help="host API version to serve (default: newest)")
    p.set_defaults(func=cmd_plugin_info)

    from host.cli import ops as ops_cli  # `ephost ops` (host/cli/ops.py)

    ops_cli.add_parser(sub)
    from host.cli import serve as serve_cli  # `ephost serve` (host/cli/serve.py)

    serve_cli.add_parser(sub)
    for p in sub.choices.values():  # `ephost run ... --debug` as well as `ephost --debug run ...`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ephost` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or an argument error: argparse already printed why
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        with _warnings_as_lines():
            return args.func(args)
    except (EphostError, OSError, ValueError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _one_line(exc: BaseException) -> str:
    """The error's message on one line (an OSError or ValueError from a library may span several)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if isinstance(exc, EphostError) else f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
