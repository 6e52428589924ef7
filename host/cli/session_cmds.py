"""`ephost run` and `ephost bench`: a session from the command line's options, run or timed."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np

from host.cli.app import CliError
from host.cli.args import EP_ALIASES
from host.cli.progress import session_progress
from host.errors import InvalidArgument, ModelError

CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"


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
        # A built-in provider (CUDA) is built/found by the session, which falls back to the CPU EP
        # with a warning where its plugin cannot be built or loaded.
        if ep != CPU_EP and not _is_builtin(ep) and env.find_factory(ep)[1] is None:
            raise InvalidArgument(f"--ep {name!r}: no execution provider {ep!r}; available: "
                                  f"{', '.join(_available_eps(env))} (short names: {', '.join(EP_ALIASES)})")
        chosen.append(ep)
    return chosen


def _is_builtin(provider: str) -> bool:
    from host.plugins.builtin import BUILTIN_PLUGINS

    return provider in BUILTIN_PLUGINS


def _available_eps(env) -> list[str]:
    """Every EP name --ep accepts here: the registered plugins' EPs, the built-in providers (each with
    a note when its plugin cannot be used on this machine), the CPU EP."""
    from host.plugins.builtin import BUILTIN_PLUGINS

    names = [f.name for reg in env.plugins.values() for f in reg.factories]
    for provider in BUILTIN_PLUGINS:
        if provider not in names:
            names.append(provider + _builtin_note(env, provider))
    return [*names, CPU_EP]


def _builtin_note(env, provider: str) -> str:
    """'' when the built-in `provider` has a device here, else why it would fall back or fail."""
    from host.errors import EphostError
    from host.plugins.builtin import builtin_registration_name

    with _plugin_lines(builtin_registration_name(provider)) as lines:  # its reason goes into the note
        try:
            env.ensure_builtin(provider)
        except EphostError as exc:
            return f" (its plugin is not usable here: {exc})"
    factory = env.find_factory(provider)[1]
    if factory is None or not factory.devices:
        why = "; ".join(line.removeprefix(f"{provider}: ") for line in lines)
        return f" (no device here{': ' + why if why else ''}; its nodes would run on the CPU EP)"
    return ""


@contextlib.contextmanager
def _plugin_lines(registration_name: str):
    """The log lines of plugin `registration_name` in the block, collected instead of shown."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger(f"ephost.plugin.{registration_name}")
    handler, propagate = Collect(logging.WARNING), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def _session_options(args):
    """SessionOptions from the command line (`--optimization-level`, `--threads`, `run --profile [PREFIX]`)."""
    from host.runtime.options import SessionOptions

    so = SessionOptions()
    level = getattr(args, "optimization_level", None)
    if level is not None:
        so.graph_optimization_level = level  # a name: "disable", "basic", "extended", "all"
    threads = getattr(args, "threads", None)
    if threads is not None:
        so.intra_op_num_threads = threads  # SessionOptions checks the value (an int >= 0)
    prefix = getattr(args, "profile", None)
    if prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = prefix
    for key, value in getattr(args, "config_entries", {}).items():  # set by commands, e.g. compile
        so.add_session_config_entry(key, value)
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
    so = _session_options(args)
    try:
        with session_progress():
            session = InferenceSession(model, so, providers=[(ep, options[ep]) for ep in eps], env=env)
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


def parse_shapes(text: str, symbols: list[str]) -> list[dict[str, int]]:
    """'1x16,8x128' -> [{batch: 1, seq: 16}, {batch: 8, seq: 128}] for the model's symbolic dims."""
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
            raise InvalidArgument(f"--shapes: {item.strip()!r} is not sizes joined by 'x' (e.g. 8x128); sizes are "
                                  "integers >= 1")
        if len(parts) != len(symbols):
            raise InvalidArgument(f"--shapes: {item.strip()!r} gives {len(parts)} size(s); the model's inputs have "
                                  f"{len(symbols)} symbolic dim(s) {symbols}: one size each, in that order")
        out.append(dict(zip(symbols, map(int, parts))))
    return out


def _bench_shapes(args, session, model) -> None:
    """`ephost bench --shapes`: each shape in turn on one session; the first run of a shape is timed
    apart (a new input-shape signature)."""
    from host.cli.benchutil import bench_session, format_stats
    from host.cli.zoo import random_inputs
    from host.runtime.dims import input_symbols

    if args.input:
        raise InvalidArgument("--shapes makes random inputs at each shape; it cannot be combined with --input")
    symbols = list(input_symbols(session.graph.inputs))
    print(f"model: {args.model}")
    print(f"mode: {'run_with_iobinding' if args.iobinding else 'run'}, shapes in turn")
    for sizes in parse_shapes(args.shapes, symbols):
        feeds = random_inputs(model, seed=args.seed, sizes=sizes)
        if args.iobinding:
            run = _bound_runner(session, feeds, fixed_outputs=False)
        else:
            def run(feeds=feeds):
                session.run(None, feeds)
        stats = bench_session(run, args.warmup, args.iters)
        print(f"shape: {', '.join(f'{k}={v}' for k, v in sizes.items())}")
        print(format_stats(stats))


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
        if args.shapes:  # issue 23: one session, the shapes in turn
            _bench_shapes(args, session, model)
            return 0
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
