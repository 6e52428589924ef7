"""Mutation testing of the gating and fallback code with mutmut 3 (docs/testing.md; not run in CI).

    python -m tests.property.mutation              # mutmut run over TARGETS, then the summary
    python -m tests.property.mutation --summary    # the summary of the last run only
    python -m tests.property.mutation --list       # the mutant-name globs passed to mutmut
    python -m tests.property.mutation abi.sdk ...  # only these modules of TARGETS
    python -m tests.property.mutation --pending    # only mutants not run yet or not killed (resumes a run)
    python -m tests.property.mutation --tests tests/property/test_x.py,... <module>  # only these test files

Under a mutant, mutmut runs every test its stats run saw reach the mutated function; for a module of
TESTS, or with --tests, tests/conftest.py deselects all but the listed files (EPHOST_MUTATION_TESTS).
The stats run is unchanged, so the mutants/ results of other modules stay valid (changing mutmut's own
test selection in pyproject.toml would reset them all).

pyproject.toml's [tool.mutmut] names the files mutmut copies and mutates and makes tests/property
the test command; TARGETS narrows the run to the functions that gate, negotiate and fall back (a
whole-file run makes thousands of mutants of code these properties are not about). The summary
counts killed / total per module and lists the survivors that are not in
tests/property/equivalent_mutants.txt (each line there: mutant name, a tab, why it is equivalent).
Exit status 1 when such an unexplained survivor exists.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT = Path(__file__).with_name("equivalent_mutants.txt")
SEP = "\u01c1"  # mutmut's separator in the mangled names of methods: x<SEP>Class<SEP>method

# module -> functions ("name" for a function, "Class.method", "Class.*" for every method).
TARGETS: dict[str, tuple[str, ...]] = {
    "host.plugins.loader": ("negotiate", "Slots.*"),
    "host.plugins.ep": ("PluginEp.graph_capture_enabled", "PluginEp.graph_policy", "PluginEp._concurrent_supported"),
    "host.runtime.session": ("_option_text", "_parse_providers", "InferenceSession._concurrent",
                             "InferenceSession._run", "InferenceSession._execute",
                             "InferenceSession.run_with_iobinding"),
    "host.runtime.executor": ("Executor.on_run_start", "Executor.on_run_end"),
    "host.runtime.partition": ("Partitioner.partition",),
    "host.runtime.options": ("RunOptions.*",),
    "host.runtime.graph_capture": ("parse_graph_id", "run_flags", "GraphCapture.__init__", "GraphCapture.run",
                                   "GraphCapture._replay", "GraphCapture._check_binding"),
    "host.runtime.partition.claims": ("can_compile", "collect_claims"),
    "host.runtime.partition.compile": ("claim_and_compile",),
    "abi.plugin_runtime": ("HostApi.__init__", "HostApi._covers", "HostApi.has", "HostApi.sync_stream",
                           "Runtime.expose", "Runtime._create_locked"),
    "abi.sdk": ("EpBase.GetCapability",),
    "plugin_cuda.options": ("parse_options", "_validate", "_bool", "_int", "_pointer"),
    # Issue 31 item 4: the gates and fallbacks added since (shape program, dims, contexts, optimizer cache).
    "host.runtime.shape_program": ("ShapeProgram.*", "_dims", "capacity", "_small", "build", "_shape_source"),
    "host.runtime.dims": ("compile_dim", "_whole", "_compile", "input_symbols", "term_add", "term_sub", "term_mul"),
    "host.runtime.range_lengths": ("annotate", "_set_length", "_range_lengths", "_constant", "_follow",
                                   "_range_length"),
    "host.runtime.epcontext": ("ContextOptions.*", "_flag", "validate", "check_compatibility", "SavedContexts.*",
                               "_read_node"),
    "host.runtime.epcontext_save": ("save_if_enabled", "_context_of", "_context_model", "_context_node",
                                    "_attach_kept"),
    "host.optimizer.cache": ("enabled", "budget", "OptimizedModelCache.*", "_encode", "_decode", "optimize_cached"),
    # The symbolic-shapes gate (session.ephost.symbolic_shapes) and its never-raise fallback.
    "host.runtime.symbolic_shapes": ("enabled", "annotate"),
}

# module -> the test files that exercise it, run under its mutants instead of every test that reaches
# it (a mutant of a function every session calls would otherwise run 130 to 170 property tests).
TESTS: dict[str, tuple[str, ...]] = {
    "host.runtime.range_lengths": ("tests/property/test_range_lengths.py", "tests/property/test_shape_cache.py"),
    "host.runtime.symbolic_shapes": ("tests/property/test_range_lengths.py", "tests/property/test_shape_cache.py"),
    "host.runtime.epcontext_save": ("tests/property/test_context_save.py", "tests/property/test_context_compatibility.py",
                                    "tests/property/test_fallbacks.py"),
    "host.runtime.epcontext": ("tests/property/test_context_save.py", "tests/property/test_context_compatibility.py",
                               "tests/property/test_context_edges.py", "tests/property/test_fallbacks.py",
                               "tests/property/test_gates.py"),
    "host.runtime.shape_program": ("tests/property/test_shape_cache.py", "tests/property/test_partition_paths.py",
                                   "tests/property/test_range_lengths.py", "tests/property/test_same_answers.py"),
    "host.runtime.dims": ("tests/property/test_dims.py", "tests/property/test_shape_cache.py",
                          "tests/property/test_range_lengths.py"),
    "host.optimizer.cache": ("tests/property/test_optimized_cache.py",),
}

# A test that takes longer than this under a mutant is a hang (a lock left held): tests/conftest.py ends
# the run with exit 1. The slowest property test takes ~15 s alone, ~150 s under mutmut's stats run.
HANG_LIMIT_S = 300
# equivalent_mutants.txt lines whose reason starts with this: mutants the properties do kill in a fresh
# process (planted by hand in a copy of the tree), which mutmut's forked child cannot show (it inherits
# state from the clean run in its parent); counted as killed.
BY_HAND = "killed by hand"
KILLED = {1, 3, 36, 24, -24, 152, 255, -11, -9, -6}   # test failure, pytest error, timeout, crash, abort
SURVIVED = {0}


def globs(modules=None) -> list[str]:
    """mutmut mutant-name globs for TARGETS (or the given modules of it)."""
    out = []
    for module, names in TARGETS.items():
        if modules and module not in modules:
            continue
        for name in names:
            if "." in name:
                cls, meth = name.split(".", 1)
                out.append(f"{module}.x{SEP}{cls}{SEP}{meth}__mutmut_*")
            else:
                out.append(f"{module}.x_{name}__mutmut_*")
    return out


def results() -> dict[str, int | None]:
    """Mutant name -> exit code of its test run (None: not run yet), from mutmut's meta files."""
    out: dict[str, int | None] = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
    patterns = globs()
    return {k: v for k, v in out.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def pending(modules=None) -> list[str]:
    """Mutants of TARGETS (or of the given modules) that were not run yet or survived unexplained."""
    eq = equivalent()
    return [name for name, code in sorted(results().items())
            if (not modules or module_of(name) in modules) and (code is None or (code in SURVIVED and name not in eq))]


def equivalent() -> dict[str, str]:
    out = {}
    if EQUIVALENT.is_file():
        for line in EQUIVALENT.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                name, _, why = line.partition("\t")
                out[name.strip()] = why.strip()
    return out


def module_of(mutant: str) -> str:
    return next(m for m in TARGETS if mutant.startswith(m + ".x"))


def summary() -> int:
    res = results()
    eq = equivalent()
    rows: dict[str, Counter] = {}
    unexplained = []
    for name, code in sorted(res.items()):
        c = rows.setdefault(module_of(name), Counter())
        c["total"] += 1
        if code is None:
            c["not run"] += 1
        elif code in KILLED or (code in SURVIVED and eq.get(name, "").startswith(BY_HAND)):
            c["killed"] += 1
        elif code in SURVIVED and name in eq:
            c["equivalent"] += 1
        elif code in SURVIVED:
            c["survived"] += 1
            unexplained.append(name)
        else:
            c["other"] += 1  # no covering test (33) or mutmut could not judge it
            unexplained.append(name)
    print("| module | killed | equivalent | survived | other | not run | total |")
    print("|---|---|---|---|---|---|---|")
    for module, c in rows.items():
        print(f"| `{module}` | {c['killed']} | {c['equivalent']} | {c['survived']} | {c['other']} | {c['not run']} | "
              f"{c['total']} |")
    tot = sum(rows.values(), Counter())
    print(f"| all | {tot['killed']} | {tot['equivalent']} | {tot['survived']} | {tot['other']} | {tot['not run']} | "
          f"{tot['total']} |")
    for name in unexplained:
        print(f"unexplained: {name} (exit code {res[name]}); see `mutmut show {name}`")
    return 1 if unexplained else 0


def test_files(argv: list[str], modules: list[str]) -> list[str]:
    """--tests a,b (the next argument), else the TESTS files of the modules named (all of them only when
    every module named has an entry); [] means every test that reaches the mutant."""
    if "--tests" in argv:
        return argv[argv.index("--tests") + 1].split(",")
    if modules and all(m in TESTS for m in modules):
        return sorted({f for m in modules for f in TESTS[m]})
    return []


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:  # any other flag-free call starts a run of hours
        print(__doc__)
        return 0
    if "--list" in argv:
        print("\n".join(globs()))
        return 0
    skip = {argv.index("--tests") + 1} if "--tests" in argv else set()
    modules = [a for i, a in enumerate(argv) if not a.startswith("-") and i not in skip]
    unknown = sorted(set(modules) - set(TARGETS))
    if unknown:
        print(f"unknown module(s) {unknown}; TARGETS has {sorted(TARGETS)}")
        return 2
    if "--summary" not in argv:
        # mutmut re-runs every mutant a name or glob selects; --pending names only the open ones.
        names = pending(modules) if "--pending" in argv else globs(modules)
        if names:
            env = {**os.environ, "EPHOST_TEST_TIMEOUT": os.environ.get("EPHOST_TEST_TIMEOUT", str(HANG_LIMIT_S))}
            tests = test_files(argv, modules)
            if tests:
                env["EPHOST_MUTATION_TESTS"] = ",".join(tests)
            subprocess.run([sys.executable, "-m", "mutmut", "run", *names], cwd=ROOT, env=env, check=False)
    return summary()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
