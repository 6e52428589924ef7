"""Property 11: several fused groups of one EP (ABI v6), each judged on its own.

A chain of elementwise nodes where ExampleEP (`ops=` a drawn subset, `fuse=1`) takes 2 or 3
separate runs of nodes, split by nodes only the CPU EP takes: each run is one fused group. Drawn
with it: Compile NULL, Compile failing for one group (`compile_fails=<one of its nodes>`: the
batch Compile of all groups fails, so the host must find the failing group by compiling each alone)
or for every group, or Compile working. The expectations come from the drawn layout:

- Compile NULL: `fused_groups_without_compile` counts every group (not once per EP), every
  claimed node runs as a per-node kernel.
- Compile failing for some groups: `compile_failed` counts exactly those, each with its own
  RuntimeWarning; the other groups run compiled (one EpNodeComputeInfo.Compute each per run), the
  failed groups' nodes as per-node kernels.
- Every compiled partition's state is made once and released once by the time the session is
  closed (ReleaseState per CreateState: the SDK's Release would free a forgotten state silently).

Outputs equal onnx's ReferenceEvaluator and onnxruntime's CPU EP on every run. The fallback table
(fallback_table.py) is also played on such chains, whose several groups its own strategies seldom draw.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from tests.property import fallback_table as ft
from tests.property import harness as h
from tests.property import strategies as s
from tests.property.scenario import Scenario
from tests.property.test_fallbacks import check_scenario

VERSION = 6  # ABI version of Ep.Compile (fallback_table.COMPILE_VERSION)
CHAIN_OPS = ("Add", "Sub", "Mul", "Relu", "Sigmoid")
BINARY = {"Add", "Sub", "Mul"}
SHAPE = (2, 3)
CONCURRENT = {"concurrent_runs": 1}  # ExampleEP without graph capture runs concurrently (fallback table)
pytestmark = pytest.mark.filterwarnings("ignore:ExampleEP did not capture graph:RuntimeWarning")


@dataclass
class Chain:
    case: s.Case
    claimed: tuple[str, ...]          # the ops ExampleEP is told to take (ops=)
    groups: list[list[str]]           # node names of each fused group, in order

    @property
    def plugin_nodes(self) -> int:
        return sum(len(g) for g in self.groups)


def _chain_case(layout: list[str]) -> s.Case:
    """X -> n0 -> n1 -> ... -> Z over float32 (2, 3); binary nodes also read Y."""
    nodes, prev, shapes = [], "X", {}
    for i, op in enumerate(layout):
        out = "Z" if i == len(layout) - 1 else f"v{i}"
        nodes.append(helper.make_node(op, [prev, "Y"] if op in BINARY else [prev], [out], name=f"n{i}"))
        shapes[out] = SHAPE
        prev = out
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in "XYZ"]
    model = helper.make_model(helper.make_graph(nodes, "chain", vi[:2], vi[2:]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    rng = np.random.default_rng(len(layout))
    feeds, feeds2 = ({k: rng.uniform(-1, 1, SHAPE).astype(np.float32) for k in "XY"} for _ in range(2))
    return s.Case(model, feeds, feeds2, {f"n{i}": op for i, op in enumerate(layout)}, {"Z": SHAPE}, 17,
                  intermediates=shapes)


@st.composite
def chains(draw) -> Chain:
    """2 or 3 runs of claimed ops, each of 1 or 2 nodes, split by (and maybe led or ended by) an op
    ExampleEP is not told to take."""
    ops = draw(st.permutations(CHAIN_OPS))
    cut = draw(st.integers(1, len(ops) - 1))
    claimed, other = ops[:cut], ops[cut:]
    layout: list[str] = []
    groups: list[list[str]] = []
    if draw(st.booleans()):
        layout.append(draw(st.sampled_from(other)))
    for g in range(draw(st.integers(2, 3))):
        if g:
            layout.append(draw(st.sampled_from(other)))
        run = draw(st.lists(st.sampled_from(claimed), min_size=1, max_size=2))
        groups.append([f"n{len(layout) + i}" for i in range(len(run))])
        layout += run
    if draw(st.booleans()):
        layout.append(draw(st.sampled_from(other)))
    return Chain(_chain_case(layout), tuple(sorted(claimed)), groups)


def _fixed(layout: list[str], claimed: tuple[str, ...]) -> Chain:
    """An explicit chain (for @example): groups are the maximal runs of `claimed` ops."""
    groups: list[list[str]] = []
    previous = False
    for i, op in enumerate(layout):
        if op in claimed:
            if not previous:
                groups.append([])
            groups[-1].append(f"n{i}")
        previous = op in claimed
    return Chain(_chain_case(layout), claimed, groups)


THREE_GROUPS = _fixed(["Add", "Mul", "Relu", "Sub", "Sigmoid", "Add"], ("Add", "Sub"))


def _play(chain: Chain, opts: dict[str, str], runs: int):
    """Session, `runs` eager runs checked against the references, close. (fallbacks, compile
    warnings, slot calls during the runs, slot calls of the whole session)."""
    refs = h.References(chain.case)
    feeds = [chain.case.feeds, chain.case.feeds2]
    with h.example_env(VERSION, [VERSION]) as env:
        rec = h.record(VERSION)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            sess = h.session(chain.case, env, opts)
        try:
            before = rec.slot_calls.copy()
            for i in range(runs):
                refs.check(sess.run(None, feeds[i % 2]), feeds[i % 2], f"run {i}")
            during = rec.slot_calls - before
            fallbacks = +sess.fallbacks.copy()
            assignment = sess.node_assignment()
        finally:
            sess.close()
        whole = rec.slot_calls.copy()
    compile_warnings = [str(w.message) for w in caught if "could not be compiled" in str(w.message)]
    return fallbacks, assignment, compile_warnings, during, whole


def _claims_hold(chain: Chain, assignment: dict[str, str]) -> None:
    on_ep = {n for g in chain.groups for n in g}
    assert assignment == {n: h.EXAMPLE_EP if n in on_ep else "CPUExecutionProvider" for n in chain.case.nodes}


@given(chain=chains(), runs=st.integers(1, 2))
@example(chain=THREE_GROUPS, runs=2)
@settings(deadline=None, max_examples=s.budget(8))
def test_every_fused_group_under_a_null_compile_is_counted(chain, runs):
    opts = {"ops": ",".join(chain.claimed), "fuse": "1", "null_slots": "Compile"}
    fallbacks, assignment, compile_warnings, during, whole = _play(chain, opts, runs)
    assert fallbacks == {"fused_groups_without_compile": len(chain.groups), **CONCURRENT}
    assert compile_warnings == []
    _claims_hold(chain, assignment)
    assert during["EpKernel.Compute"] == chain.plugin_nodes * runs
    assert whole["Ep.Compile"] == whole["EpNodeComputeInfo.Compute"] == 0


@given(chain=chains(), failing=st.one_of(st.none(), st.just("all"), st.integers(0, 2)), runs=st.integers(1, 2))
@example(chain=THREE_GROUPS, failing=1, runs=2)
@example(chain=THREE_GROUPS, failing="all", runs=1)
@settings(deadline=None, max_examples=s.budget(10))
def test_a_failed_compile_falls_back_for_its_own_groups_only_and_every_state_is_released(chain, failing, runs):
    """`failing`: None (every group compiles), "all", or the index of the one group whose Compile
    fails (one of its nodes drawn as compile_fails=)."""
    opts = {"ops": ",".join(chain.claimed), "fuse": "1"}
    if failing == "all":
        failed = list(range(len(chain.groups)))
        opts["compile_fails"] = "all"
    elif failing is not None:
        failed = [failing % len(chain.groups)]
        opts["compile_fails"] = chain.groups[failed[0]][-1]
    else:
        failed = []
    fallbacks, assignment, compile_warnings, during, whole = _play(chain, opts, runs)
    compiled = len(chain.groups) - len(failed)
    assert fallbacks == ({"compile_failed": len(failed)} if failed else {}) | CONCURRENT
    assert len(compile_warnings) == len(failed)
    for i in failed:  # each warning names its group's node count; the failed group's nodes are in the error text
        assert any(f"its {len(chain.groups[i])} node(s) run as per-node kernels" in w for w in compile_warnings)
    _claims_hold(chain, assignment)
    assert during["EpNodeComputeInfo.Compute"] == compiled * runs
    assert during["EpKernel.Compute"] == sum(len(chain.groups[i]) for i in failed) * runs
    # One state per compiled partition, made once and handed back once: none outlives the session.
    assert whole["EpNodeComputeInfo.CreateState"] == compiled
    assert whole["EpNodeComputeInfo.ReleaseState"] == compiled
    assert whole["EpNodeComputeInfo.Release"] == compiled


@given(chain=chains(), how=st.sampled_from(["null", "fail"]), eager=st.integers(1, 2), threads=st.integers(1, 2),
       bound=st.lists(s.run_options, max_size=2))
@settings(deadline=None, max_examples=s.budget(6))
def test_the_fallback_table_predicts_several_groups(chain, how, eager, threads, bound):
    """The table's rows "Fused groups without Compile" and "Compile failed" on scenarios with 2 or 3
    groups (its own strategies seldom draw more than one): every counter, Compute count and output."""
    opts = {"ops": ",".join(chain.claimed), "fuse": "1"}
    if how == "fail":
        opts["compile_fails"] = "all"
    nulls = ("Compile",) if how == "null" else ()
    sc = Scenario(chain.case, VERSION, VERSION, nulls, opts, eager, threads, bound)
    assert ft.fused_groups(sc) == len(chain.groups)  # the table's model of the groups agrees with the layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "could not be compiled": counted by the table
        check_scenario(sc)
