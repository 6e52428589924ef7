"""The `ephost` command line: run a model, make a zoo model, benchmark, inspect a plugin.

    ephost make-model transformer build/block.onnx --seq 16 --hidden 64 --heads 4
    ephost run build/block.onnx --random-inputs                  # the built-in CPU EP
    ephost run build/block.onnx --ep cuda --random-inputs        # the built-in CUDA plugin (needs CuPy)
    ephost bench build/block.onnx --ep cuda --iters 200 --iobinding --threads 2
    ephost run model.onnx --plugin my_ep=path/to/libmy_ep.so --ep MyEP --ep-option ops=Add,Relu --input x=x.npy
    ephost plugin-info path/to/libmy_ep.so
    ephost compile model.onnx -o model_ctx.onnx --ep cuda          # later sessions load the compiled partitions
    ephost ops                                                   # which ONNX ops each EP runs
    ephost convert model.onnx -o model_fp16.onnx --precision fp16  # half precision (docs/precision.md)

Plugins: `--plugin PATH` registers the library under its file stem; `--plugin NAME=PATH` under NAME.
(In a source checkout, `python build.py` writes example plugins to build/lib/, e.g.
build/lib/libephost_example_v6.so.)
EPs: `--ep NAME` in priority order: a provider name, a plugin's registration name, or the short names
`cuda` and `cpu`; with none, every EP of the registered plugins, in order. Nodes no chosen EP claims
run on the built-in CPU EP.
EP options: `--ep-option KEY=VALUE` goes to the first chosen EP; `--ep-option EP:KEY=VALUE` to EP.
Threads: `--threads N` sets SessionOptions.intra_op_num_threads.
Errors print `error: <message>` (one line) on stderr and exit with status 2; `--debug` adds the traceback.
Profiling: `ephost run MODEL --profile [PREFIX]` writes a Chrome-trace JSON (Perfetto, chrome://tracing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from host.cli import args as cli_args
from host.cli.serve import add_arguments as serve_args
from host.errors import EphostError

EXIT_ERROR = 2


class CliError(EphostError):
    """A command cannot proceed: a missing optional package, a file it cannot read or write."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its arguments (declared in a module that imports nothing heavy, so that
    `ephost --help` stays fast) and its function as "module:function", imported when it runs."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: str


# Every subcommand, in --help order. A new one is one row here (plus its module).
COMMANDS: list[Command] = [
    Command("run", "run a model once and summarise its outputs", cli_args.add_run,
            "host.cli.session_cmds:cmd_run"),
    Command("compile", "compile a model's partitions and save them in a context model (EPContext nodes)",
            cli_args.add_compile, "host.cli.compile_cmds:cmd_compile"),
    Command("make-model", "write a zoo model (mlp, cnn, transformer)", cli_args.add_make_model,
            "host.cli.model_cmds:cmd_make_model"),
    Command("convert", "convert a float32 model to float16 or bfloat16", cli_args.add_convert,
            "host.cli.convert_cmd:cmd_convert"),
    Command("bench", "time repeated runs: p50/p90/p99 and mean latency", cli_args.add_bench,
            "host.cli.session_cmds:cmd_bench"),
    Command("build", "build the CPU kernels and the built-in plugins for this Python (what the package "
            "lacks, into the per-user cache)", cli_args.add_build, "host.cli.plugin_cmds:cmd_build"),
    Command("plugin-info", "a plugin's ABI versions, slots and devices", cli_args.add_plugin_info,
            "host.cli.plugin_cmds:cmd_plugin_info"),
    Command("ops", "which ONNX ops and opsets each EP supports (CPU EP; plugins probed)", cli_args.add_ops,
            "host.cli.ops:cmd_ops"),
    Command("serve", "serve a model over HTTP with Ray Serve (KServe v2 protocol)", serve_args,
            "host.cli.serve:cmd_serve"),
]


def command_function(command: Command) -> Callable:
    module, _, name = command.run.partition(":")
    return getattr(importlib.import_module(module), name)


# ---- warnings and plugin log lines -------------------------------------------------------------
_FALLBACK = re.compile(r"^(?P<ep>\S+) has no device; (?P<rest>its nodes fall back to \S+)$")


class _Notices(logging.Handler):
    """Prints warnings and the plugins' log lines (WARNING and up) as one `warning: ...` line each.

    A plugin's reason for having no device ("X: no CUDA device available: ...") and the session's
    "X has no device; its nodes fall back to ..." are the same notice: they print as one line.
    """

    def __init__(self):
        super().__init__(logging.WARNING)
        self.pending: list[str] = []  # plugin lines not printed yet (waiting for a fallback to join)

    def emit(self, record: logging.LogRecord) -> None:
        self.pending.append(record.getMessage())

    def show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        match = _FALLBACK.match(text)
        if match:
            reason = next((p for p in self.pending if p.startswith(match["ep"] + ": ")), None)
            if reason is not None:
                self.pending.remove(reason)
                text = f"{reason}; {match['rest']}"
        self.flush_lines()
        print(f"warning: {text}", file=sys.stderr)

    def flush_lines(self) -> None:
        for text in self.pending:
            print(f"warning: {text}", file=sys.stderr)
        self.pending.clear()


@contextlib.contextmanager
def _notices_as_lines():
    """Warnings and plugin log lines as `warning: ...` lines, not file:line plus a source line."""
    notices = _Notices()
    plugin_log = logging.getLogger("ephost.plugin")
    plugin_log.addHandler(notices)
    propagate, plugin_log.propagate = plugin_log.propagate, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default", RuntimeWarning)
            warnings.simplefilter("default", UserWarning)
            warnings.showwarning = notices.show_warning
            yield
    finally:
        notices.flush_lines()
        plugin_log.removeHandler(notices)
        plugin_log.propagate = propagate


# ---- parser and entry point --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ephost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(command_row=command)
        # `ephost run ... --debug` as well as `ephost --debug run ...`
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
        with _notices_as_lines():
            return command_function(args.command_row)(args)
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
