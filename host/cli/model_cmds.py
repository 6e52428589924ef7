"""`ephost make-model`: write a zoo model (host/cli/zoo.py) to a file."""

from __future__ import annotations

from pathlib import Path

from host.cli.app import CliError
from host.cli.args import MODEL_DEFAULTS, flag
from host.errors import InvalidArgument

# Which options each model kind takes (the argparse dest is the builder's keyword).
_ALL_MODEL_OPTIONS = sorted({k for opts in MODEL_DEFAULTS.values() for k in opts})
MIN_ZOO_OPSET = 9


def _check_opset(opset: int) -> None:
    from host.runtime.model import MAX_OPSET

    # Below 9 the models would need IR version 3 (initializers listed as graph inputs), which the
    # builders do not write; above MAX_OPSET `ephost run` refuses the model.
    if not MIN_ZOO_OPSET <= opset <= MAX_OPSET:
        raise InvalidArgument(f"--opset {opset} is not supported; make-model writes opsets "
                              f"{MIN_ZOO_OPSET}..{MAX_OPSET} (what `ephost run` accepts)")


def _builder_kwargs(args) -> dict:
    allowed = MODEL_DEFAULTS[args.kind]
    values = {d: getattr(args, d) for d in _ALL_MODEL_OPTIONS}
    # `is not` because `0 in (None, False)` is true, and --layers 0 must reach the builder's check.
    given = {d: v for d, v in values.items() if v is not None and v is not False}
    stray = sorted(flag(d) for d in given if d not in allowed)
    if stray:
        verb = "does" if len(stray) == 1 else "do"
        raise InvalidArgument(f"{', '.join(stray)} {verb} not apply to {args.kind}; "
                              f"{args.kind} takes {', '.join(flag(d) for d in allowed)}")
    return given


def _save(model, out: str) -> None:
    from host.runtime.model import save_model

    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # `make-model mlp build/mlp.onnx` from an empty folder
        save_model(model, path)
    except OSError as exc:
        raise CliError(f"cannot write model to '{out}': {exc}") from exc


def cmd_make_model(args) -> int:
    from host.cli import zoo

    builders = {"mlp": zoo.mlp, "cnn": zoo.cnn, "transformer": zoo.transformer_block}
    kwargs = _builder_kwargs(args)
    _check_opset(args.opset)
    model = builders[args.kind](seed=args.seed, opset=args.opset, dynamic_batch=args.dynamic_batch, **kwargs)
    _save(model, args.out)
    print(f"wrote {args.out}: {args.kind}, {len(model.graph.node)} nodes, opset {args.opset}")
    return 0
