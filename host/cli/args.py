"""The arguments of each `ephost` subcommand, declared without importing what the commands need.

`ephost --help` builds every subparser, so this module imports only argparse: numpy, onnx and the
runtime are imported by the command functions (host/cli/session_cmds.py, model_cmds.py, ...).
"""

from __future__ import annotations

import argparse

LEVELS = ("disable", "basic", "extended", "all")

# Short EP names for the command line. `--ep cuda` also registers the built-in CUDA plugin (the package's
# build, else built for this Python into the per-user cache on first use; $EPHOST_CUDA_PLUGIN overrides it).
EP_ALIASES = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider", "example": "ExampleEP"}

# make-model: kind -> {option: default}. The defaults are the zoo builders' own (host/cli/zoo.py;
# tests/host/test_cli.py checks that they agree), shown in --help.
MODEL_DEFAULTS: dict[str, dict[str, object]] = {
    "mlp": {"layers": 8, "hidden": 256, "batch": 1, "in_features": None, "use_gemm": False},
    "cnn": {"batch": 1, "channels": 3, "size": 32},
    "transformer": {"batch": 1, "seq": 128, "hidden": 256, "heads": 4, "ffn": 1024},
}
MODEL_OPTION_HELP = {
    "layers": "number of MatMul+Add+Relu layers",
    "hidden": "hidden width",
    "batch": "batch size",
    "seq": "sequence length",
    "heads": "attention heads (must divide --hidden)",
    "ffn": "feed-forward width",
    "channels": "input channels",
    "size": "input height and width",
    "in_features": "input width (default: --hidden)",
}
DEFAULT_WARMUP = 10
DEFAULT_ITERS = 100


def _defaults_text(dest: str) -> str:
    values = {kind: opts[dest] for kind, opts in MODEL_DEFAULTS.items() if opts.get(dest) is not None}
    same = len(set(values.values())) == 1
    shown = [str(v) for v in set(values.values())] if same else [f"{k} {v}" for k, v in values.items()]
    kinds = [kind for kind, opts in MODEL_DEFAULTS.items() if dest in opts]
    text = f"{'/'.join(kinds)}: {MODEL_OPTION_HELP[dest]}"
    return text + (f" (default: {', '.join(shown)})" if shown else "")


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_session_options(p: argparse.ArgumentParser) -> None:
    """What `run` and `bench` share: the model, plugins, EPs, inputs and session options."""
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--plugin", action="append", default=[], metavar="[NAME=]PATH",
                   help="register an EP plugin library (name: NAME, or the file stem)")
    p.add_argument("--ep", action="append", default=[], metavar="NAME",
                   help="execution provider, in priority order: a provider name, a --plugin's name, or the short "
                        "names 'cuda' (the built-in CUDA plugin) and 'cpu' (default: every EP of the plugins; "
                        "nodes no chosen EP claims run on the CPU EP)")
    p.add_argument("--ep-option", action="append", default=[], metavar="[EP:]KEY=VALUE",
                   help="provider option for the first chosen EP, or for EP with the EP: prefix")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="feed an input")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--optimization-level", choices=LEVELS, default="all",
                   help="graph optimization before partitioning (default: all; docs/optimizer.md)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="SessionOptions.intra_op_num_threads: threads of the CPU EP's pools, BLAS included "
                        "(default: 0, the session's default)")
    p.add_argument("--verbose", action="store_true", help="print what each optimizer pass changed")


def add_run(p: argparse.ArgumentParser) -> None:
    add_session_options(p)
    p.add_argument("--random-inputs", action="store_true", help="fill inputs not given with random data")
    p.add_argument("--output-dir", metavar="DIR", help="save each output as DIR/NAME.npy")
    p.add_argument("--profile", nargs="?", const="ephost_profile_", metavar="PREFIX",
                   help="write a Chrome-trace profile (a JSON list of events, as onnxruntime writes; Perfetto, "
                        "chrome://tracing) to PREFIX_<date>_<time>_<ms>.json (default PREFIX: ephost_profile_)")


def add_compile(p: argparse.ArgumentParser) -> None:
    add_session_options(p)
    p.add_argument("-o", "--output", metavar="OUT.onnx",
                   help="the context model to write (default: MODEL_ctx.onnx beside MODEL)")
    p.add_argument("--embed-mode", choices=("0", "1"), default="0",
                   help="ep.context_embed_mode: 0 writes each context to a file beside the model (default, as "
                        "onnxruntime; a session maps it), 1 embeds it in its EPContext node")
    p.add_argument("--check", action="store_true",
                   help="MODEL is a context model: print each EP's compatibility answer for it, create no "
                        "session (exit 1 when an EP answers unsupported)")


def add_make_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=sorted(MODEL_DEFAULTS))
    p.add_argument("out", metavar="OUT.onnx", help="where to write the model (missing folders are created)")
    for dest in ("layers", "hidden", "batch", "seq", "heads", "ffn", "channels", "size", "in_features"):
        p.add_argument(flag(dest), dest=dest, type=int, metavar="N", help=_defaults_text(dest))
    p.add_argument("--use-gemm", action="store_true", help="mlp: Gemm + Relu instead of MatMul + Add + Relu")
    p.add_argument("--dynamic-batch", action="store_true", help="symbolic batch dimension 'batch'")
    p.add_argument("--opset", type=int, default=17, help="ai.onnx opset of the model (default: 17)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default: 0)")


def add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="the float32 model to convert")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx",
                   help="where to write the converted model (missing folders are created)")
    p.add_argument("--precision", required=True, choices=("fp16", "bf16"), help="float16 or bfloat16")
    p.add_argument("--keep-io-types", action="store_true",
                   help="keep float32 graph inputs and outputs (Casts at the edges)")
    p.add_argument("--block-op", action="append", metavar="OP", dest="block_ops",
                   help="keep this op type in float32 (repeatable; replaces the default block list)")
    p.add_argument("--keep-opset", action="store_true",
                   help="never raise the model's opset (bf16: Conv, Sin, Cos... admit bfloat16 only since opset 22)")


def add_bench(p: argparse.ArgumentParser) -> None:
    add_session_options(p)
    p.add_argument("--iobinding", action="store_true", help="run_with_iobinding (outputs allocated by the EP)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="set enable_cuda_graph=1 on the first EP and bind preallocated outputs")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, metavar="N",
                   help=f"untimed runs before timing (default: {DEFAULT_WARMUP})")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS, metavar="N",
                   help=f"timed runs (default: {DEFAULT_ITERS})")
    p.add_argument("--plot", metavar="FILE.png", help="latency histogram (needs matplotlib)")
    p.add_argument("--shapes", metavar="AxB,...",
                   help="time one session at each shape in turn, e.g. '1x16,8x128,3x50': the sizes of the "
                        "model's symbolic input dims, in order of first appearance (docs/dynamic_shapes.md)")


def add_build(p: argparse.ArgumentParser) -> None:
    """`ephost build` takes no arguments."""


def add_plugin_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="a plugin library (.so)")
    p.add_argument("--api-version", type=int, metavar="N", help="host API version to serve (default: newest)")


def add_ops(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="[NAME=]PATH",
                   help="also probe this plugin's EPs (through GetCapability)")
    p.add_argument("--ep", action="append", default=[], metavar="NAME", help="only these plugin EPs")
    p.add_argument("--markdown", action="store_true", help="the Markdown table of docs/ops.md")
