"""Loads and runs models sent on stdin, one per line (base64), and answers one JSON line each.

    python -m tests.hostile.fuzz_worker

Runs in its own process (with an address-space limit) so that a model that crashes the onnx
checker, shape inference or the host cannot take the test process with it: the test sees the
worker die and reports the model that killed it.
"""

from __future__ import annotations

import base64
import json
import resource
import sys

import numpy as np

from abi.dtypes import to_numpy
from host.errors import EphostError
from host.runtime.session import InferenceSession

MEMORY_LIMIT = 4 << 30  # a model asking for more is refused by the allocator, not by the OOM killer


def _feeds(session) -> dict:
    feeds = {}
    for arg in session.graph.inputs:
        dims = [d if isinstance(d, int) and 0 <= d <= 16 else 1 for d in (arg.shape or ())]
        try:
            dtype = to_numpy(arg.elem_type)
        except (TypeError, KeyError, ValueError):
            dtype = np.float32
        feeds[arg.name] = np.ones(dims, dtype)
    return feeds


def outcome(data: bytes) -> dict:
    """'ok', a typed error's class name, or 'raw:<class>' for anything else (the test's failure)."""
    stage = "create"
    try:
        with InferenceSession(data, providers=["CPUExecutionProvider"]) as s:
            stage = "run"
            s.run(None, _feeds(s))
        return {"outcome": "ok", "stage": stage}
    except EphostError as exc:
        return {"outcome": type(exc).__name__, "stage": stage, "message": str(exc)[:300]}
    except BaseException as exc:  # noqa: BLE001 - reported, never raised
        return {"outcome": f"raw:{type(exc).__name__}", "stage": stage, "message": str(exc)[:300]}


def main() -> int:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    for line in sys.stdin:
        print(json.dumps(outcome(base64.b64decode(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
