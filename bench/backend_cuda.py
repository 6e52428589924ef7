"""onnx's backend test suite on the CUDA EP: every test whose model the CUDA plugin claims a node of.

    python -m bench.backend_cuda [--kind node] [--limit N] [--option KEY=VALUE ...] [--json out.json]

Runs the suite's CPU-variant tests (tests/host/backend_compare.py runs them exactly as onnx's runner
does) through EphostBackend with providers CUDA then CPU, and sorts each test by what the CUDA EP took:
`cuda` (at least one node ran on it) or `cpu-only` (the plugin claimed nothing: the CPU EP ran it all,
which tests/host/test_backend.py already covers). Prints the counts and every failing `cuda` test with
its first error line. Results stream to --json as they come, so a time limit keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA = "CUDAExecutionProvider"


def cuda_backend(options: dict):
    from host.runtime.backend import EphostBackend

    class CudaBackend(EphostBackend):
        last_on_cuda = 0

        @classmethod
        def prepare(cls, model, device: str = "CPU", **kwargs):
            kwargs.setdefault("providers", [(CUDA, dict(options)), "CPUExecutionProvider"])
            rep = super().prepare(model, device, **kwargs)
            CudaBackend.last_on_cuda += sum(1 for ep in rep.session.node_assignment().values() if ep == CUDA)
            return rep

    return CudaBackend


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="node", help="test-name prefix kind: node, simple, real, pytorch, all")
    p.add_argument("--limit", type=int, default=0, help="run at most N tests (0: all)")
    p.add_argument("--option", action="append", default=[], help="CUDA provider option KEY=VALUE")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from tests.host import backend_compare as bc

    backend = cuda_backend(dict(o.split("=", 1) for o in args.option))
    tests = bc.suite(bc.declared_types_backend(backend))
    names = [n for n in bc.test_names() if args.kind == "all" or bc.kind_of(n) == args.kind]
    names = names[:args.limit] if args.limit else names
    rows, t0 = {}, time.perf_counter()
    sink = args.json.open("w") if args.json else None
    for name in names:
        backend.last_on_cuda = 0
        verdict = bc.run_one(tests, name)
        where = "cuda" if backend.last_on_cuda else "cpu-only"
        rows[name] = (where, verdict.passed, verdict.detail)
        if sink:
            sink.write(json.dumps({"name": name, "where": where, "passed": verdict.passed,
                                   "detail": verdict.detail}) + "\n")
            sink.flush()
    report(rows, time.perf_counter() - t0)
    return 0


def report(rows: dict, seconds: float) -> None:
    on_cuda = {n: r for n, r in rows.items() if r[0] == "cuda"}
    passed = sum(1 for r in on_cuda.values() if r[1])
    cpu_only = [r for r in rows.values() if r[0] == "cpu-only"]
    print(f"{len(rows)} tests in {seconds:.0f} s: {len(on_cuda)} with nodes on the CUDA EP, of which {passed} "
          f"passed and {len(on_cuda) - passed} failed; {len(cpu_only)} ran on the CPU EP only "
          f"({sum(1 for r in cpu_only if r[1])} passed)")
    for name, (_, ok, detail) in sorted(on_cuda.items()):
        if not ok:
            print(f"  FAIL {name}: {detail[:200]}")


if __name__ == "__main__":
    raise SystemExit(main())
