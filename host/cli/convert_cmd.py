"""`ephost convert`: a float32 model in float16 or bfloat16 (host/precision.py)."""

from __future__ import annotations

from collections import Counter


def cmd_convert(args) -> int:
    from host.cli.model_cmds import _save
    from host.precision import DEFAULT_OP_BLOCK_LIST, convert_precision
    from host.runtime.model import load_model

    model = load_model(args.model)
    block = DEFAULT_OP_BLOCK_LIST if args.block_ops is None else frozenset(args.block_ops)
    converted = convert_precision(model, args.precision, keep_io_types=args.keep_io_types, op_block_list=block,
                                   upgrade_opset=not args.keep_opset)
    _save(converted, args.output)
    casts = Counter(n.op_type for n in converted.graph.node)["Cast"] - Counter(n.op_type for n in model.graph.node)["Cast"]
    kept = sorted({n.op_type for n in model.graph.node if n.op_type in block})
    print(f"wrote {args.output}: {args.precision}, {len(converted.graph.node)} nodes ({casts} Casts added); "
          f"kept in float32: {', '.join(kept) if kept else 'none'}{_opset_note(model, converted)}")
    return 0


def _opset_note(model, converted) -> str:
    def default(m):
        return next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    before, after = default(model), default(converted)
    return "" if before == after else f"; opset raised from {before} to {after}"
