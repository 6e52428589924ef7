"""`ephost compile`: save a model's compiled partitions as EPContext nodes, or check a saved one.

    ephost compile model.onnx -o model_ctx.onnx --plugin build/lib/libephost_example_v7.so --ep-option fuse=1
    ephost compile --check model_ctx.onnx --plugin build/lib/libephost_example_v7.so

The first creates a session with ep.context_enable=1 (host/runtime/epcontext_save.py); the second
asks each EP's factory about the saved compatibility strings without creating a session
(host/runtime/epcontext.py: check_compatibility).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from host.cli.session_cmds import _environment, _open_session


def cmd_compile(args) -> int:
    if args.check:
        return _check(args)
    from host.runtime import epcontext, epcontext_save

    args.config_entries = {epcontext.ENABLE: "1", epcontext.EMBED_MODE: args.embed_mode}
    if args.output:
        args.config_entries[epcontext.FILE_PATH] = args.output
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        session, _ = _open_session(stack, args)
        seconds = time.perf_counter() - start
        path = Path(session.context_model)
        saved = session.fallbacks["context_not_offered"]
        parts = epcontext_save.main_graph_partitions(session)
        print(f"compiled {len(parts)} partition(s) in {seconds:.2f} s; {len(parts) - saved} saved as EPContext "
              f"nodes, {saved} kept as nodes (their EP gave no context)")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


def _check(args) -> int:
    from host.runtime import epcontext
    from host.runtime.model import load_model

    env = _environment(args.plugin)
    try:
        answers = epcontext.check_compatibility(args.model, env)
    finally:
        env.close()
    if not answers:
        print(f"{args.model}: no compiled contexts (no EPContext nodes); a session compiles it from scratch")
        return 0
    for a in answers:
        print(f"{a.ep}: {a.name} ({a.reason})")
    meta = {p.key: p.value for p in load_model(args.model).metadata_props}
    print(f"source model sha256: {meta.get(epcontext.SOURCE_HASH_KEY, 'not recorded')}")
    return 1 if any(a.answer == epcontext.abi.COMPILED_MODEL_UNSUPPORTED for a in answers) else 0
