"""The fallback table: the one source of the README's "Fallback table" section and of what the
property tests expect the host and the example plugin to record.

Each `Row` holds the README text of one fallback, the counters it makes (where, which key, how
many times for a scenario of scenario.py), when the row's situation arises in a scenario
(`holds`), and a strategy that draws only scenarios where it does (`scenarios`): the property
tests draw from every row, so that every row is exercised in every CI run, whatever hypothesis
draws elsewhere. `markdown()` renders the README section; `python -m tests.property.fallback_table`
prints it (`--check` compares it with README.md).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

import abi
from tests.property import harness as h
from tests.property import scenario
from tests.property import strategies as s
from tests.property.scenario import MAX_INTERNAL_RUNS, Events, Scenario, scenarios

ROOT = Path(__file__).resolve().parents[2]
CAPTURE_VERSIONS = tuple(v for v in s.VERSIONS if v >= 3)
STREAM_SYNC_VERSION = abi.since("Ep", "ReplayGraphWithSync")
SYNC_STREAM_VERSION = abi.since("EpApi", "KernelContext_GetSyncStream")
COMPILE_VERSION = abi.since("Ep", "Compile")
CONTEXT_VERSION = abi.since("Ep", "CompileFromContext")


@dataclass(frozen=True)
class Count:
    """One counter a row makes: in the session's `fallbacks` or the plugin Record's `fallbacks`."""

    where: str                                   # "session" or "plugin"
    key: Callable[[Scenario], str] | str         # the Counter key (a function for host_api_vN)
    count: Callable[[Scenario, Events], int]     # how many times the scenario records it

    def key_for(self, sc: Scenario) -> str:
        return self.key(sc) if callable(self.key) else self.key


@dataclass(frozen=True)
class Row:
    title: str
    when: str                                    # README: when it happens
    host: str                                    # README: what the session records
    plugin: str                                  # README: what the plugin records
    counts: tuple[Count, ...]
    holds: Callable[[Scenario, Events], bool]    # the row's situation arises in the scenario
    scenarios: Callable[[], st.SearchStrategy]   # scenarios in which it does

    def markdown(self) -> str:
        return f"| {self.title} | {self.when} | {self.host} | {self.plugin} |"


# ---- what a scenario does -----------------------------------------------------------------------
def on_plan(sc: Scenario) -> bool:
    """ExampleEP runs at least one node (an EP without nodes is not in the session's plan)."""
    return sc.plugin_nodes > 0


def concurrent(sc: Scenario) -> bool:
    return not on_plan(sc) or h.concurrent(sc.negotiated, sc.null_slots, sc.opts)


def sync_replays(ev: Events) -> int:
    return sum(ev.replays)


def stream_sync(sc: Scenario) -> bool:
    return sc.ep_has("ReplayGraphWithSync")


def capture_off_silently(sc: Scenario) -> bool:
    return (sc.opts.get("enable_graph") == "1" and sc.negotiated >= 3
            and bool(s.CAPTURE_SLOTS & set(sc.null_slots)))


def fused_groups(sc: Scenario) -> int:
    """ExampleEP's fused groups (fuse=1): maximal runs of consecutive nodes it claims."""
    if sc.opts.get("fuse") != "1" or sc.negotiated < COMPILE_VERSION:
        return 0
    ops = h.claimed_ops(sc.opts)
    runs, previous = 0, False
    for op in sc.case.nodes.values():
        runs += op in ops and not previous
        previous = op in ops
    return runs


def compile_null(sc: Scenario) -> bool:
    return "Compile" in sc.null_slots


def saved_groups(sc: Scenario, mode: str) -> int:
    """Fused groups of a context scenario (ABI v7) whose contexts end as `mode`: "loaded", "not offered"
    (n == 6: GetContext does not exist; or ExampleEP context=0) or "recompiled" (a damaged blob)."""
    if not sc.context or not scenario.compiled(sc):
        return 0
    if sc.negotiated < CONTEXT_VERSION or sc.opts.get("context") == "0":
        outcome = "not offered"
    elif sc.context in ("corrupt", "truncated") or "CompileFromContext" in sc.null_slots:
        outcome = "recompiled"  # a NULL CompileFromContext cannot rebuild: the kept nodes compile again
    else:
        outcome = "loaded"
    return fused_groups(sc) if outcome == mode else 0


# ---- strategies: scenarios that reach a given row -------------------------------------------------
def _pair(negotiated: int):
    """(host, plugin) with min(host, plugin) == negotiated, either side the older one."""
    newer = st.sampled_from([v for v in s.VERSIONS if v >= negotiated])
    return st.one_of(st.tuples(st.just(negotiated), newer), st.tuples(newer, st.just(negotiated)))


@st.composite
def capture_scenarios(draw, negotiated: int | None = None, sync: bool | None = None,
                      null_pool=("Sync", "ReplayGraphWithSync", "ReleaseCapturedGraph", "IsConcurrentRunSupported",
                                 "GetGraphCaptureNodeAssignmentPolicy"),
                      state: str = "on", also_null: tuple[str, ...] = ()) -> Scenario:
    """A scenario that captures a graph and replays it (`state` "on") with the given negotiated
    version and sync mode (None: any), or one whose capture is never reached (`state` "never")."""
    n = draw(st.sampled_from(CAPTURE_VERSIONS)) if negotiated is None else negotiated
    host, plugin = draw(_pair(n))
    nulls = set(draw(st.lists(st.sampled_from(null_pool), unique=True, max_size=3))) | set(also_null)
    if state == "never":
        nulls |= set(draw(st.lists(st.sampled_from(["OnRunStart", "OnRunEnd"]), min_size=1, unique=True)))
    case = draw(s.elementwise_graphs(max_nodes=3))
    opts = {"enable_graph": "1", "min_runs": str(draw(st.integers(0, 3)))}
    gid = draw(st.sampled_from([None, "0", "1", "3"]))
    first = s.RunOpts(gid, draw(st.sampled_from([None, "0", "1"])))
    mode = draw(st.booleans()) if sync is None else sync
    again = s.RunOpts(gid, draw(st.sampled_from([None, "0"])) if mode else "1")
    extra = draw(st.lists(s.run_options, max_size=2))
    runs = [first, again] + draw(st.permutations(extra + [again]))
    return Scenario(case, host, plugin, tuple(sorted(nulls)), opts, draw(st.integers(0, 1)), 1, runs)


@st.composite
def _with_versions(draw, negotiated: int | None = None, pair=None, graph=None) -> Scenario:
    """A scenario of scenario.py with the version pair drawn from `pair` or with min == `negotiated`."""
    host, plugin = draw(pair if pair is not None else _pair(negotiated))
    sc = draw(scenarios(host=st.just(host), plugin=st.just(plugin)))
    if graph is not None:
        sc.opts = {k: v for k, v in sc.opts.items() if k != "enable_graph"}
        if graph:
            sc.opts["enable_graph"] = "1"
    return sc


def _running(sc: Scenario) -> Scenario:
    """At least one eager run with ExampleEP on the plan (it takes every node it can)."""
    sc.opts.pop("ops", None)
    sc.eager_runs = max(sc.eager_runs, 1)
    if sc.refused:  # capture on with a node ExampleEP cannot take: run without capture instead
        sc.opts.pop("enable_graph", None)
    return sc


def _null(slot: str) -> Callable[[Scenario], Scenario]:
    def add(sc: Scenario) -> Scenario:
        sc.null_slots = tuple(sorted(set(sc.null_slots) | {slot}))
        return sc
    return add


def _serialised() -> st.SearchStrategy:
    return st.one_of(
        _with_versions(1, graph=False),
        _with_versions(pair=st.tuples(s.versions, s.versions), graph=False).map(_null("IsConcurrentRunSupported")),
        capture_scenarios(),
    ).map(_running)


def _silently_off() -> st.SearchStrategy:
    missing = st.lists(st.sampled_from(sorted(s.CAPTURE_SLOTS)), min_size=1, unique=True)
    return st.tuples(capture_scenarios(), missing).map(lambda p: _null_all(p[0], p[1]))


def _null_all(sc: Scenario, slots) -> Scenario:
    sc.null_slots = tuple(sorted(set(sc.null_slots) | set(slots)))
    return sc


def _device_sync() -> st.SearchStrategy:
    older = [v for v in CAPTURE_VERSIONS if v < STREAM_SYNC_VERSION]
    newer = [v for v in CAPTURE_VERSIONS if v >= STREAM_SYNC_VERSION]
    return st.one_of(st.sampled_from(older).flatmap(lambda n: capture_scenarios(n, sync=True)),
                     st.sampled_from(newer).flatmap(
                         lambda n: capture_scenarios(n, sync=True, also_null=("ReplayGraphWithSync",))))


def _stream_sync() -> st.SearchStrategy:
    versions = [v for v in CAPTURE_VERSIONS if v >= STREAM_SYNC_VERSION]
    pool = ("Sync", "ReleaseCapturedGraph", "IsConcurrentRunSupported")
    return st.sampled_from(versions).flatmap(lambda n: capture_scenarios(n, sync=True, null_pool=pool))


def _untagged() -> st.SearchStrategy:
    n = st.sampled_from([v for v in s.VERSIONS if v < SYNC_STREAM_VERSION])
    return n.flatmap(lambda v: _with_versions(v)).map(_running)


def _fusing(how: str) -> Callable[[Scenario], Scenario]:
    """ExampleEP fuses (fuse=1) and its groups cannot compile: `how` "fail" or "null" (Compile NULL)."""
    def change(sc: Scenario) -> Scenario:
        sc = _running(sc)
        sc.opts.update({"fuse": "1"} if how == "null" else {"fuse": "1", "compile_fails": "all"})
        if how == "null":
            sc.null_slots = tuple(sorted(set(sc.null_slots) | {"Compile"}))
        return sc
    return change


def _v6(how: str) -> st.SearchStrategy:
    return st.sampled_from([v for v in s.VERSIONS if v >= COMPILE_VERSION]).flatmap(
        lambda n: _with_versions(n)).map(_fusing(how))


def _saving(mode: str, blob: bool = True) -> Callable[[Scenario], Scenario]:
    """A context scenario (scenario.CONTEXT_MODES): ExampleEP fuses and compiles every node it runs."""
    def change(sc: Scenario) -> Scenario:
        sc = _running(sc)
        sc.opts = {k: v for k, v in sc.opts.items() if k not in ("compile_fails", "enable_graph")}
        sc.opts.update({"fuse": "1"} if blob else {"fuse": "1", "context": "0"})
        sc.null_slots = tuple(n for n in sc.null_slots if n != "Compile")
        sc.context = mode
        return sc
    return change


def _contexts(mode: str, pairs: list[tuple[int, int]], blob: bool = True) -> st.SearchStrategy:
    return _with_versions(pair=st.sampled_from(pairs), graph=False).map(_saving(mode, blob))


V7_PAIRS = [(a, b) for a in s.VERSIONS for b in s.VERSIONS if min(a, b) >= CONTEXT_VERSION]
V6_PAIRS = [(a, b) for a in s.VERSIONS for b in s.VERSIONS if min(a, b) == CONTEXT_VERSION - 1]


def _older_host() -> st.SearchStrategy:
    pairs = [(a, b) for a in s.VERSIONS for b in s.VERSIONS if a < b]
    return _with_versions(pair=st.sampled_from(pairs))


# ---- the table --------------------------------------------------------------------------------------
ROWS: tuple[Row, ...] = (
    Row("No graph capture", "n < 3 (the v3 graph slots do not exist)",
        "`no_graph_capture` (once per session and plugin EP)", "—",
        (Count("session", "no_graph_capture", lambda sc, ev: int(sc.negotiated < 3)),),
        lambda sc, ev: sc.negotiated < 3,
        lambda: st.sampled_from([1, 2]).flatmap(lambda n: _with_versions(n, graph=True))),
    Row("Graph capture off, silently",
        "n >= 3 but `Ep.IsGraphCaptureEnabled`, `Ep.IsGraphCaptured` or `Ep.ReplayGraph` NULL",
        "nothing recorded", "—",
        (),
        lambda sc, ev: capture_off_silently(sc),
        _silently_off),
    Row("Serialised runs",
        "a plugin EP that runs nodes of the session has n = 1, or `Ep.IsConcurrentRunSupported` NULL, or "
        "answers no (ExampleEP while `enable_graph=1`)",
        "`serialised_runs` (once per session; `concurrent_runs` otherwise)", "—",
        (Count("session", "serialised_runs", lambda sc, ev: int(not concurrent(sc))),
         Count("session", "concurrent_runs", lambda sc, ev: int(concurrent(sc)))),
        lambda sc, ev: not concurrent(sc),
        _serialised),
    Row("Capture never reached",
        "capture on but `Ep.OnRunStart` or `Ep.OnRunEnd` NULL: runs eagerly after "
        f"{MAX_INTERNAL_RUNS} tries, with a `RuntimeWarning`",
        "`capture_not_reached` (per bound run of an uncaptured id; `graph_captured` per capture otherwise)", "—",
        (Count("session", "capture_not_reached", lambda sc, ev: ev.gave_up),
         Count("session", "graph_captured", lambda sc, ev: ev.captured)),
        lambda sc, ev: ev.gave_up > 0,
        lambda: capture_scenarios(state="never")),
    Row("Device-wide sync after replay",
        "synchronised replay on n = 3 or 4, or n >= 5 with `Ep.ReplayGraphWithSync` NULL: `ReplayGraph` then "
        "`Ep.Sync`",
        "`replay_device_sync` (per replay)", "`ep_device_sync` (per `Ep.Sync` call; none when `Ep.Sync` is NULL)",
        (Count("session", "replay_device_sync", lambda sc, ev: 0 if stream_sync(sc) else sync_replays(ev)),
         Count("plugin", "ep_device_sync",
               lambda sc, ev: 0 if stream_sync(sc) or not sc.ep_has("Sync") else sync_replays(ev))),
        lambda sc, ev: not stream_sync(sc) and sync_replays(ev) > 0,
        _device_sync),
    Row("Stream sync after replay",
        "synchronised replay on n >= 5: `ReplayGraphWithSync(id, 1)` syncs the EP's graph stream",
        "`replay_stream_sync` (per replay)", "`ep_stream_sync` (per replay)",
        (Count("session", "replay_stream_sync", lambda sc, ev: sync_replays(ev) if stream_sync(sc) else 0),
         Count("plugin", "ep_stream_sync", lambda sc, ev: sync_replays(ev) if stream_sync(sc) else 0)),
        lambda sc, ev: stream_sync(sc) and sync_replays(ev) > 0,
        _stream_sync),
    Row("Asynchronous replay", "`disable_synchronize_execution_providers=1`, n >= 3",
        "`replay_async` (per replay)", "—",
        (Count("session", "replay_async", lambda sc, ev: len(ev.replays) - sync_replays(ev)),),
        lambda sc, ev: len(ev.replays) > sync_replays(ev),
        lambda: capture_scenarios(sync=False)),
    Row("Untagged scratch",
        "n < 4 (no `EpApi.KernelContext_GetSyncStream`): host < 4 or plugin < 4", "—",
        "`untagged_scratch` (per kernel `Compute`)",
        (Count("plugin", "untagged_scratch", lambda sc, ev: ev.computes if sc.negotiated < SYNC_STREAM_VERSION else 0),),
        lambda sc, ev: sc.negotiated < SYNC_STREAM_VERSION and ev.computes > 0,
        _untagged),
    Row("Older host API",
        "host < plugin: the plugin asks `GetApi(host)` and installs only the slots of that version", "—",
        "`host_api_vN`, N = host version (once per registration)",
        (Count("plugin", lambda sc: f"host_api_v{sc.host}", lambda sc, ev: int(sc.host < sc.plugin)),),
        lambda sc, ev: sc.host < sc.plugin,
        _older_host),
    Row("Per-node kernels instead of compiled partitions",
        f"n < {COMPILE_VERSION}: a v{COMPILE_VERSION} host with an older plugin, or a plugin that implements "
        "`claim_fused` on an older host: the SDK never calls `claim_fused`, the nodes `claim()` takes run as "
        "per-node kernels (ExampleEP records it at every version below 6, fusing or not)",
        "nothing recorded", "`kernels_instead_of_compile` (per `GetCapability`: once per session)",
        (Count("plugin", "kernels_instead_of_compile", lambda sc, ev: int(sc.negotiated < COMPILE_VERSION)),),
        lambda sc, ev: sc.negotiated < COMPILE_VERSION,
        lambda: st.sampled_from([v for v in s.VERSIONS if v < COMPILE_VERSION]).flatmap(
            lambda n: _with_versions(n)).map(_fusing("fail"))),
    Row("Compile failed",
        f"n >= {COMPILE_VERSION}, `Ep.Compile` fails for a fused group (ExampleEP `compile_fails=all`): its nodes "
        "run as the EP's per-node kernels, with a `RuntimeWarning`",
        "`compile_failed` (per fused group)", "—",
        (Count("session", "compile_failed", lambda sc, ev: 0 if compile_null(sc) or not sc.opts.get("compile_fails")
               else fused_groups(sc)),),
        lambda sc, ev: fused_groups(sc) > 0 and not compile_null(sc) and bool(sc.opts.get("compile_fails")),
        lambda: _v6("fail")),
    Row("Fused groups without Compile",
        f"n >= {COMPILE_VERSION}, the EP claims fused groups but `Ep.Compile` is NULL: its per-node claims stand",
        "`fused_groups_without_compile` (per group)", "—",
        (Count("session", "fused_groups_without_compile", lambda sc, ev: fused_groups(sc) if compile_null(sc) else 0),),
        lambda sc, ev: fused_groups(sc) > 0 and compile_null(sc),
        lambda: _v6("null")),
    Row("Compiled partitions reloaded",
        f"n >= {CONTEXT_VERSION}: a session with `ep.context_enable=1` saved the model with EPContext nodes; a "
        "session made from that model rebuilds each partition with `Ep.CompileFromContext` (no optimization, no "
        "`Ep.Compile`)",
        "`context_loaded` (per EPContext node)", "—",
        (Count("session", "context_loaded", lambda sc, ev: saved_groups(sc, "loaded")),),
        lambda sc, ev: saved_groups(sc, "loaded") > 0,
        lambda: st.sampled_from(["reload", "external"]).flatmap(lambda m: _contexts(m, V7_PAIRS))),
    Row("No compiled contexts",
        f"n = {CONTEXT_VERSION - 1} (a v7 host with a v6 plugin, or a v6 host with a v7 plugin: "
        "`EpNodeComputeInfo.GetContext` is never called), or an EP that gives no context (ExampleEP "
        "`context=0`): the saved model keeps the group's nodes and loading compiles them as before",
        "`context_not_offered` (per fused group, when saving)", "—",
        (Count("session", "context_not_offered", lambda sc, ev: saved_groups(sc, "not offered")),),
        lambda sc, ev: saved_groups(sc, "not offered") > 0,
        lambda: st.one_of(_contexts("reload", V6_PAIRS), _contexts("reload", V7_PAIRS, blob=False))),
    Row("Damaged compiled context",
        f"n >= {CONTEXT_VERSION}, an EPContext blob is corrupt or truncated: `Ep.CompileFromContext` fails and "
        "the host compiles the subgraph kept in the node, with a `RuntimeWarning` (an EP that answers "
        "`EP_SUPPORTED_PREFER_RECOMPILATION`, or whose `Ep.CompileFromContext` is NULL, is recompiled the same "
        "way, without a warning)",
        "`context_recompiled` (per EPContext node)", "—",
        (Count("session", "context_recompiled", lambda sc, ev: saved_groups(sc, "recompiled")),),
        lambda sc, ev: saved_groups(sc, "recompiled") > 0,
        lambda: st.sampled_from(["corrupt", "truncated"]).flatmap(lambda m: _contexts(m, V7_PAIRS))),
)



@dataclass(frozen=True)
class HostRow:
    """A gate or fallback of the host alone (no version pair decides it): its README text and the property
    that exercises it in every CI run (`test`: "file.py::function" under tests/property), which draws its
    own scenarios (shapes, dtypes, bodies, cache damage, requests) and compares with onnxruntime."""

    title: str
    when: str
    host: str
    plugin: str
    test: str

    def markdown(self) -> str:
        return f"| {self.title} | {self.when} | {self.host} | {self.plugin} |"


HOST_ROWS: tuple[HostRow, ...] = (
    HostRow("Shape arithmetic on the host",
            "Shape/Size chains computable from the input shapes (Reshape targets of dynamic-axes exports): they "
            "leave the plan and run once per input-shape signature, `session.ephost.shape_cache_signatures` "
            "signatures kept (LRU, default 64); `0`: no shape program, the nodes run in the plan at every run",
            "`shape_program.evaluations` (per signature not cached)", "—",
            "test_shape_cache.py::test_shape_cache_bound_and_results"),
    HostRow("Half precision on the CPU EP",
            "a float16/bfloat16 node no plugin claims (ExampleEP claims float32/float64 inputs only): the CPU EP "
            "computes it in float32 and stores the type the graph declares",
            "nothing recorded (every output has its declared type)", "—",
            "test_half_split.py::test_declared_half_types_are_honoured_across_the_split"),
    HostRow("Control-flow bodies",
            "an If/Loop/Scan body is partitioned like a graph: its nodes are offered to every EP of the session "
            "(device EPs too; ExampleEP under `EPHOST_TEST_MOCK_DEVICE=1`), values stay on the device between "
            "iterations, and the body nodes no EP claims run on the CPU EP, device values copied in for them",
            "nothing recorded", "—",
            "test_control_flow_bodies.py::test_body_nodes_are_offered_to_every_ep"),
    HostRow("Optimized model cache miss",
            "no whole entry for (optimizer fingerprint, level, model bytes): missing, truncated, another "
            "format, any byte changed: the model is optimized again and the entry rewritten",
            "nothing recorded (`session.optimization` as if optimized now)", "—",
            "test_optimized_cache.py::test_hits_misses_and_damaged_entries"),
    HostRow("Serving: bad request",
            "a request whose body or tensors do not fit the model (JSON, datatype, shape, names, outputs): HTTP "
            "400 with the typed error's text, never joins a batch; another model: 404; a failing run: 500 for "
            "its requests, the replica serves on",
            "the replica's `stats` (`requests` counts only batched ones, `failed_runs`)", "—",
            "test_serving_errors.py::test_bad_requests_get_400_and_never_join_a_batch"),
    HostRow("Host-computed values at host-read inputs",
            "n >= 7: a value the shape program computes (`EpValueInfo.flags` `EP_VALUE_HOST_COMPUTED`) reaches a "
            "kernel in host memory at an input its op reads on the host (`abi/host_inputs.py`: a Reshape's shape, "
            "Slice bounds); n < 7, other inputs and compiled partitions: copied to the EP's device",
            "nothing recorded", "`Record.input_devices` (kernel inputs by device type, ExampleEP)",
            "test_host_values.py::test_host_computed_shapes_reach_v7_kernels_in_host_memory"),
    HostRow("CPU shape nodes beside a captured graph",
            "an EP with `GRAPH_ALLOW_CPU_FOR_SHAPES` (ExampleEP `graph_policy=shapes`, the CUDA EP): CPU nodes with "
            "int64 outputs of input shapes, constants and shape-program values run in the capture runs and are "
            "skipped by replays, the device copies of their results kept with that shape's graph; a CPU node "
            "reading data is a `GraphCaptureError` at session creation",
            "`graph_captured` (per shape's graph)", "—",
            "test_host_values.py::test_cpu_shape_nodes_beside_a_capture"),
)

HEADER = ("| Fallback | When (n = min(host API version, plugin ABI version)) | Host: `session.fallbacks` | "
          "Plugin: `Record.fallbacks` |\n|---|---|---|---|\n")


def markdown() -> str:
    """The README's fallback table, rendered from ROWS."""
    return HEADER + "".join(r.markdown() + "\n" for r in (*ROWS, *HOST_ROWS))


def expected(sc: Scenario, ev: Events) -> tuple[Counter, Counter]:
    """(session fallbacks, plugin Record fallbacks) the table predicts for a scenario."""
    by_where: dict[str, Counter] = {"session": Counter(), "plugin": Counter()}
    for row in ROWS:
        for c in row.counts:
            if c.where == "session" and not ev.created:
                continue  # a refused session has no Counter to read
            by_where[c.where][c.key_for(sc)] += c.count(sc, ev)
    return +by_where["session"], +by_where["plugin"]


def readme_table_matches(readme: Path = ROOT / "README.md") -> bool:
    return markdown() in readme.read_text(encoding="utf-8")


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        ok = readme_table_matches()
        print("README fallback table is up to date" if ok else "README fallback table differs from ROWS")
        sys.exit(0 if ok else 1)
    sys.stdout.write(markdown())
