"""onnx's whole backend test suite, CPU variants, through onnxruntime and ephost: who passes what.

    python -m tests.host.backend_compare                 # ephost live, onnxruntime from the cached verdicts
    python -m tests.host.backend_compare --ort-live      # both live (about as long again)
    python -m tests.host.backend_compare --write-ort-verdicts   # regenerate tests/host/backend_ort_verdicts.json
    python -m tests.host.backend_compare -k 'reduce|mod' --list  # a subset, with every failing test and why

The suite is what `onnx.backend.test.BackendTest` builds (one unittest method per case and device) for the
kinds onnx's loader provides: `node` (cases collected in memory from onnx.backend.test.case.node), `real`
(the light models under onnx/backend/test/data/light, run with onnx's dummy inputs), `simple`,
`pytorch-converted` and `pytorch-operator` (model and data files under onnx/backend/test/data). Only the
`_cpu` variants are kept; a test's name below drops that suffix. Each test runs exactly as onnx's runner
runs it (prepare, run, `Runner.assert_similar_outputs` with the case's tolerances): a backend passes it
when the unittest method neither fails, errors nor skips (a skip means "model not compatible").

onnxruntime's verdicts change only when onnx or onnxruntime does, so they are cached in
`backend_ort_verdicts.json` with both versions recorded; tests/host/test_backend.py reads that file and
runs only ephost. The exclusions (`backend_exclusions.txt`) list every test ephost fails, with a reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import unittest
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test
from onnx.backend.test.loader import load_model_tests

HERE = Path(__file__).resolve().parent
ORT_VERDICTS = HERE / "backend_ort_verdicts.json"
EXCLUSIONS = HERE / "backend_exclusions.txt"
KINDS = ("node", "real", "simple", "pytorch-converted", "pytorch-operator")
NOT_YET = "not implemented yet (issue 26/27)"
BOTH_FAIL = "onnxruntime fails too"
REGENERATE = "python -m tests.host.backend_compare --write-ort-verdicts"


# ---- the suite ----------------------------------------------------------------------------------------------
@cache
def _cases() -> dict[str, tuple[str, onnx.ModelProto | None]]:
    """Test name (no device suffix) -> (kind, in-memory model or None)."""
    with warnings.catch_warnings():  # the node cases' numpy generators overflow on purpose
        warnings.simplefilter("ignore", RuntimeWarning)
        out = {}
        for kind in KINDS:
            for tc in load_model_tests(kind=kind):
                out[tc.name] = (kind, tc.model)
    return out


def test_names() -> list[str]:
    return sorted(_cases())


def kind_of(name: str) -> str:
    return _cases()[name][0]


def _main_op(model: onnx.ModelProto) -> str:
    ops = [n.op_type for n in model.graph.node]
    if len(ops) == 1:
        return ops[0]
    counts = Counter(op for op in ops if op != "Constant")
    return counts.most_common(1)[0][0] if counts else "Constant"


@cache
def category(name: str) -> str:
    """The op a node test exercises (a function-expanded variant: its unexpanded test's op), else its kind."""
    cases = _cases()
    kind, model = cases[name]
    if kind != "node":
        return kind
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    if base != name and base in cases:
        model = cases[base][1]
    return _main_op(model)


def suite(backend: type) -> type[unittest.TestCase]:
    """onnx's BackendTest over `backend`, CPU variants only, as one unittest.TestCase class."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bt = onnx.backend.test.BackendTest(backend, __name__)
    bt.include(r"_cpu$")
    return bt.tests


def declared_types_backend(backend: type) -> type:
    """`backend` (EphostBackend) whose prepared models also check each run's tensor outputs: exactly the
    element type the graph declares, or an AssertionError that fails the test (the output-type contract,
    checked on every model of the suite)."""

    class DeclaredTypes(backend):
        @classmethod
        def prepare(cls, model, device: str = "CPU", **kwargs):
            return _DeclaredTypesRep(super().prepare(model, device, **kwargs))

    return DeclaredTypes


class _DeclaredTypesRep:
    """A prepared model whose run() checks output element types against the session's declarations."""

    def __init__(self, rep):
        self.rep = rep
        self.declared = {a.name: a.type for a in rep.session.get_outputs()}

    def run(self, inputs, **kwargs):
        from abi.dtypes import dtype_type_name  # noqa: PLC0415 - keep the module importable alone

        outputs = self.rep.run(inputs, **kwargs)
        for name, value in zip(kwargs.get("output_names") or self.rep.output_names, outputs):
            want = self.declared.get(name, "")
            if isinstance(value, np.ndarray) and want.startswith("tensor("):
                got = dtype_type_name(value.dtype)
                assert got == want, f"output '{name}' is {got}; the graph declares {want}"
        return outputs


# ---- verdicts -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    passed: bool
    detail: str = ""  # why it failed: the exception's first lines, or the skip reason
    seconds: float = 0.0


class _FirstProblem(unittest.TestResult):
    """Keeps the first failure, error or skip of a run as one line (exception type and message)."""

    problem: str | None = None

    def _keep(self, text: str) -> None:
        if self.problem is None:
            self.problem = re.sub(r"\s+", " ", text).strip()[:300]

    def addError(self, test, err):  # noqa: N802 - unittest's names
        self._keep(f"{err[0].__module__}.{err[0].__qualname__}: {err[1]}")

    def addFailure(self, test, err):  # noqa: N802
        self._keep(f"{err[0].__qualname__}: {err[1]}")

    def addSkip(self, test, reason):  # noqa: N802
        self._keep(f"skipped: {reason}")


def run_one(tests: type[unittest.TestCase], name: str) -> Verdict:
    """Runs test `name` (no device suffix) of a `suite()` class."""
    result = _FirstProblem()
    start = time.perf_counter()
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        tests(name + "_cpu").run(result)
    seconds = time.perf_counter() - start
    if result.problem is not None:
        return Verdict(False, result.problem, seconds)
    return Verdict(True, "", seconds)


def run_all(backend: type, names: list[str], progress: bool = False) -> dict[str, Verdict]:
    tests = suite(backend)
    out = {}
    for i, name in enumerate(names):
        out[name] = run_one(tests, name)
        if progress and i % 100 == 0:
            print(f"  {i}/{len(names)}", file=sys.stderr, flush=True)
    return out


def ephost_backend() -> type:
    from host.runtime.backend import EphostBackend  # noqa: PLC0415 - keep the module importable alone

    return EphostBackend


def ort_backend() -> type:
    import onnxruntime.backend  # noqa: PLC0415

    return onnxruntime.backend.backend.OnnxRuntimeBackend


# ---- onnxruntime's cached verdicts --------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    import onnxruntime  # noqa: PLC0415

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "numpy": np.__version__}


def write_ort_verdicts(path: Path = ORT_VERDICTS) -> dict[str, Verdict]:
    verdicts = run_all(ort_backend(), test_names(), progress=True)
    doc = {"generated_by": REGENERATE, **_versions(),
           "passed": sorted(n for n, v in verdicts.items() if v.passed),
           "failed": {n: v.detail for n, v in sorted(verdicts.items()) if not v.passed}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return verdicts


def cached_ort_verdicts(path: Path = ORT_VERDICTS) -> dict[str, Verdict] | None:
    """onnxruntime's verdicts from the cache, or None when it was made with another onnx or onnxruntime
    (or covers other tests) than the installed ones."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    versions = _versions()
    if doc.get("onnx") != versions["onnx"] or doc.get("onnxruntime") != versions["onnxruntime"]:
        return None
    out = {n: Verdict(True) for n in doc["passed"]}
    out.update({n: Verdict(False, d) for n, d in doc["failed"].items()})
    return out if set(out) == set(test_names()) else None


def ort_verdicts(live: bool = False) -> dict[str, Verdict]:
    cached = None if live else cached_ort_verdicts()
    if cached is None:
        if not live:
            print(f"onnxruntime verdict cache missing or stale: running onnxruntime live (regenerate: {REGENERATE})",
                  file=sys.stderr)
        return run_all(ort_backend(), test_names(), progress=True)
    return cached


# ---- exclusions ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exclusion:
    pattern: str  # a regex matched against the whole test name (re.fullmatch)
    reason: str
    line: int


def load_exclusions(path: Path = EXCLUSIONS) -> list[Exclusion]:
    """`<regex> <reason>` per line (the regex has no spaces), `#` comments and blank lines ignored."""
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition(" ")
        if not reason.strip():
            raise ValueError(f"{path.name}:{number}: an exclusion needs a reason after the pattern: {raw!r}")
        re.compile(pattern)
        out.append(Exclusion(pattern, reason.strip(), number))
    return out


def exclusion_of(name: str, exclusions: list[Exclusion]) -> Exclusion | None:
    return next((e for e in exclusions if re.fullmatch(e.pattern, name)), None)


# ---- the report ---------------------------------------------------------------------------------------------
def counts(ort: dict[str, Verdict], eph: dict[str, Verdict], names: list[str]) -> dict[str, int]:
    o = {n for n in names if ort[n].passed}
    e = {n for n in names if eph[n].passed}
    return {"tests": len(names), "onnxruntime": len(o), "ephost": len(e), "both": len(o & e),
            "only_onnxruntime": len(o - e), "only_ephost": len(e - o), "neither": len(set(names) - o - e)}


def format_report(ort: dict[str, Verdict], eph: dict[str, Verdict], names: list[str]) -> str:
    total = counts(ort, eph, names)
    lines = [f"onnx {onnx.__version__} backend suite, CPU: {total['tests']} tests; onnxruntime passes "
             f"{total['onnxruntime']}, ephost {total['ephost']} (both {total['both']}, only onnxruntime "
             f"{total['only_onnxruntime']}, only ephost {total['only_ephost']}, neither {total['neither']})",
             "", f"{'category':34s} {'tests':>5s} {'ort':>5s} {'ephost':>6s} {'both':>5s} {'only-ort':>8s} "
             f"{'only-ep':>7s}"]
    by_cat: dict[str, list[str]] = {}
    for n in names:
        by_cat.setdefault(category(n), []).append(n)
    rows = sorted(by_cat.items(), key=lambda kv: (-counts(ort, eph, kv[1])["only_onnxruntime"], kv[0]))
    for cat, members in rows:
        c = counts(ort, eph, members)
        lines.append(f"{cat:34s} {c['tests']:5d} {c['onnxruntime']:5d} {c['ephost']:6d} {c['both']:5d} "
                     f"{c['only_onnxruntime']:8d} {c['only_ephost']:7d}")
    return "\n".join(lines)


def format_failures(ort: dict[str, Verdict], eph: dict[str, Verdict], names: list[str]) -> str:
    lines = []
    for n in names:
        if not eph[n].passed:
            tag = "ORT-PASSES" if ort[n].passed else "both-fail"
            lines.append(f"{n}  [{category(n)}] {tag}: {eph[n].detail}")
    return "\n".join(lines)


def _brief(detail: str, limit: int = 110) -> str:
    """An error line without its module path and onnxruntime's status prefix, shortened."""
    detail = re.sub(r"^[\w.]*\.(?=\w+:)", "", detail)
    detail = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", detail)
    return detail if len(detail) <= limit else detail[:limit - 3] + "..."


def write_exclusions(ort: dict[str, Verdict], eph: dict[str, Verdict], path: Path = EXCLUSIONS) -> int:
    """Rewrites the exclusions file: one line per test ephost fails, grouped by category; a test that
    already has an exact line with a hand-written reason keeps it. Returns the number of lines written."""
    # Hand-written reasons stay; generated ones (NOT_YET, BOTH_FAIL with the errors of the day) are redone.
    old = {e.pattern: e.reason for e in load_exclusions(path)
           if e.reason != NOT_YET and not e.reason.startswith(BOTH_FAIL)} if path.exists() else {}
    header = [line for line in path.read_text().splitlines() if line.startswith("##")] if path.exists() else []
    by_cat: dict[str, list[str]] = {}
    for name in sorted(eph):
        if not eph[name].passed:
            by_cat.setdefault(category(name), []).append(name)
    lines = list(header)
    for cat in sorted(by_cat):
        lines += ["", f"# {cat}"]
        for name in by_cat[cat]:
            reason = old.get(name) or (NOT_YET if ort[name].passed else
                                       f"{BOTH_FAIL} ({_brief(ort[name].detail)}); ephost: {_brief(eph[name].detail)}")
            lines.append(f"{name} {reason}")
    path.write_text("\n".join(lines) + "\n")
    return sum(len(v) for v in by_cat.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.host.backend_compare", description=__doc__.splitlines()[0])
    p.add_argument("-k", help="only the tests whose name matches this regex (re.search)")
    p.add_argument("--ort-live", action="store_true", help="run onnxruntime too instead of reading its cache")
    p.add_argument("--write-ort-verdicts", action="store_true", help=f"regenerate {ORT_VERDICTS.name}")
    p.add_argument("--list", action="store_true", help="list every test ephost fails, with its error")
    p.add_argument("--write-exclusions", action="store_true",
                   help=f"rewrite {EXCLUSIONS.name} from ephost's failures (existing reasons kept)")
    p.add_argument("--json", help="write ephost's verdicts to this file")
    args = p.parse_args(argv)
    if args.write_ort_verdicts:
        start = time.perf_counter()
        verdicts = write_ort_verdicts()
        print(f"wrote {ORT_VERDICTS} ({sum(v.passed for v in verdicts.values())} of {len(verdicts)} pass, "
              f"{time.perf_counter() - start:.0f} s)")
        return 0
    names = [n for n in test_names() if not args.k or re.search(args.k, n)]
    ort = ort_verdicts(live=args.ort_live)
    start = time.perf_counter()
    eph = run_all(ephost_backend(), names, progress=True)
    print(format_report(ort, eph, names))
    print(f"\nephost ran {len(names)} tests in {time.perf_counter() - start:.0f} s")
    if args.list:
        print(format_failures(ort, eph, names))
    if args.write_exclusions:
        if args.k:
            p.error("--write-exclusions needs the whole suite (no -k)")
        print(f"wrote {write_exclusions(ort, eph)} exclusions to {EXCLUSIONS}")
    if args.json:
        Path(args.json).write_text(json.dumps({n: [v.passed, v.detail, round(v.seconds, 3)]
                                               for n, v in eph.items()}, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
