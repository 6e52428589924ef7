"""Graph optimization between model loading and partitioning, on onnxscript's optimizer and rewriter.

    result = optimize(model_proto, GraphOptimizationLevel.ORT_ENABLE_ALL)
    result.model      # the optimized onnx.ModelProto
    result.report     # one PassReport per pass that changed the graph

Fused ops no execution provider claims are turned back into their unfused subgraphs by
`expand_unclaimed`, which the session calls after asking the EPs (docs/optimizer.md).

Only the levels are imported eagerly: onnxscript takes about a second to import, and
SessionOptions needs the enum without it. The rest loads on first use, and what onnx-ir and onnxscript
import for work a session rarely does (sympy, onnx's reference kernels) loads only when used
(host/optimizer/deferred.py): installed here, before any module of this package imports them.
"""

from __future__ import annotations

import importlib

from host.optimizer import deferred
from host.optimizer.levels import LEVEL_NAMES, GraphOptimizationLevel, as_level

deferred.install()

# name -> module that defines it (loaded on first access)
_LAZY = {
    "OptimizeResult": "host.optimizer.result",
    "PassReport": "host.optimizer.result",
    "optimize": "host.optimizer.pipeline",
    "can_expand": "host.optimizer.fallback",
    "expand_unclaimed": "host.optimizer.fallback",
    "prepare": "host.optimizer.hooks",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'host.optimizer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["GraphOptimizationLevel", "LEVEL_NAMES", "OptimizeResult", "PassReport", "as_level", "can_expand",
           "expand_unclaimed", "optimize", "prepare"]
