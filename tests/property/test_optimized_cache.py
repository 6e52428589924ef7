"""The optimized-model cache (host/optimizer/cache.py): hits, misses, damaged entries, its key.

A random sequence of (model, level) openings, with random damage to stored entries in between
(truncated, the case of a letter flipped, emptied, overwritten by another entry's bytes or by garbage). The test
keeps its own model of the cache, by file: an opening is a hit exactly when its (model, level) was
stored and its file not damaged since; every miss calls the optimizer once and (re)writes one file.
Whatever the cache returns runs like the model itself (onnxruntime on both) and has the nodes, the report
and the counts of a fresh optimization. Then a session with the example plugin, optimizer on, over a damaged
entry: same outputs as onnxruntime, and the entry is whole again.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from host.errors import InvalidArgument
from host.optimizer import cache as oc
from host.optimizer import hooks
from host.optimizer.levels import GraphOptimizationLevel as Level
from host.runtime.session import InferenceSession
from tests.property import harness as h
from tests.property import strategies as s

V = 6
LEVELS = (Level.ORT_ENABLE_BASIC, Level.ORT_ENABLE_EXTENDED, Level.ORT_ENABLE_ALL)
DAMAGE = ("truncate", "flip", "empty", "garbage", "swap")


def _model(seed: int):
    """MatMul + Add (+ Identity) + Relu: something for every level to fuse or remove."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "b"], ["z"], name="add"),
             helper.make_node("Identity", ["z"], ["zi"], name="id"),
             helper.make_node("Relu", ["zi"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, f"g{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# The third one the optimizer leaves as it is: its entry stores no model bytes ("unchanged").
RELU = helper.make_model(helper.make_graph(
    [helper.make_node("Relu", ["x"], ["y"], name="relu")], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])]), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
MODELS = (_model(0), _model(1), RELU)
X = np.random.default_rng(9).standard_normal((2, 4)).astype(np.float32)
WANT = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
        for m in MODELS]
FRESH: dict[tuple[int, int], object] = {}  # (model, level) -> a fresh optimization, without the cache


def _fresh(m: int, level) -> object:
    if (m, int(level)) not in FRESH:
        FRESH[m, int(level)] = hooks._optimize(MODELS[m], level)
    return FRESH[m, int(level)]


def _damage(path: Path, how: str, at: int, other: bytes) -> None:
    data = path.read_bytes()
    cut = at % max(1, len(data))
    if how == "truncate":
        data = data[:cut]
    elif how == "flip":  # the case of one letter: JSON that still parses, or a name in the model
        letters = [i for i, c in enumerate(data) if chr(c).isascii() and chr(c).isalpha()]
        i = letters[at % len(letters)] if letters else cut
        data = data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1:]
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = bytes(range(256)) * 3
    else:  # another entry's bytes under this entry's name
        data = other
    path.write_bytes(data)


actions = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 2), st.sampled_from(LEVELS)),
    st.tuples(st.just("damage"), st.integers(0, 2), st.sampled_from(LEVELS), st.sampled_from(DAMAGE),
              st.integers(0, 1 << 16)))


@given(steps=st.lists(actions, min_size=1, max_size=8))
@example(steps=[("open", 0, LEVELS[0]), ("open", 0, LEVELS[2]), ("open", 0, LEVELS[0]), ("open", 1, LEVELS[0]),
                ("open", 0, LEVELS[0])])  # a key without the level or the model shows here
@example(steps=[("open", 0, LEVELS[1]), ("damage", 0, LEVELS[1], "flip", 110), ("open", 0, LEVELS[1]),
                ("open", 0, LEVELS[1])])  # a flipped byte in the entry's metadata
@example(steps=[("open", 2, LEVELS[0]), ("open", 2, LEVELS[0])])  # an unchanged model is a hit too
@settings(deadline=None, max_examples=s.budget(10))
def test_hits_misses_and_damaged_entries(steps):
    calls = []

    def optimize(proto, level):
        calls.append(level)
        return hooks._optimize(proto, level)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "not" / "yet"  # made with its parents on the first write
        cache = oc.OptimizedModelCache(folder, budget_bytes=1 << 30)
        files: dict[tuple[int, int], Path] = {}  # what the test saw each miss write
        valid: set[tuple[int, int]] = set()
        for step in steps:
            m, level = step[1], step[2]
            key = (m, int(level))
            if step[0] == "damage":
                if key in files and files[key].exists():
                    others = [p for k, p in files.items() if k != key and p.exists()]
                    _damage(files[key], step[3], step[4], others[0].read_bytes() if others else b"")
                    valid.discard(key)
                continue
            before = set(folder.glob(f"*{oc.SUFFIX}"))
            n = len(calls)
            result = oc.optimize_cached(MODELS[m], level, optimize, cache)
            hit = len(calls) == n
            assert hit is (key in valid), (step, hit)
            if not hit:
                written = set(folder.glob(f"*{oc.SUFFIX}")) - before
                files[key] = written.pop() if written else files[key]  # a rewritten entry keeps its name
                assert files[key].is_file()
                if _fresh(m, level).model is MODELS[m]:  # left as it is: the entry holds no copy of the model
                    assert MODELS[m].SerializeToString() not in files[key].read_bytes()
                valid.add(key)
            fresh = _fresh(m, level)
            # A model the optimizer leaves as it is comes back as the caller's own, also from an entry (which
            # stores no model bytes for it), never as a parsed copy.
            assert (result.model is MODELS[m]) is (fresh.model is MODELS[m])
            assert (result.nodes_before, result.nodes_after) == (fresh.nodes_before, fresh.nodes_after)
            assert (result.level, result.source_opsets) == (fresh.level, fresh.source_opsets)
            assert [vars(r) for r in result.report] == [vars(r) for r in fresh.report]
            assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in fresh.model.graph.node]
            got = ort.InferenceSession(result.model.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
            np.testing.assert_allclose(got, WANT[m], **h.LOOSE)
        # One file per (model, level): distinct keys never share an entry.
        assert len({files[k] for k in files}) == len(files)


@contextlib.contextmanager
def _cache_dir(path: str):
    old = os.environ.get("EPHOST_CACHE_DIR")
    os.environ["EPHOST_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EPHOST_CACHE_DIR", None)
        else:
            os.environ["EPHOST_CACHE_DIR"] = old


@given(how=st.sampled_from(DAMAGE), at=st.integers(0, 1 << 16), m=st.integers(0, 1))
@settings(deadline=None, max_examples=s.budget(4))
def test_a_session_over_a_damaged_entry_recovers(how, at, m):
    with tempfile.TemporaryDirectory() as tmp, _cache_dir(tmp), h.example_env(V, (V,)) as env:
        folder = oc.directory()
        assert folder.parent == Path(tmp)

        def session():
            return InferenceSession(MODELS[m], providers=[(h.EXAMPLE_EP, {"ops": "Relu"})], env=env)

        with session() as sess:
            np.testing.assert_allclose(sess.run(None, {"x": X})[0], WANT[m], **h.LOOSE)
        (entry,) = folder.glob(f"*{oc.SUFFIX}")
        _damage(entry, how, at, MODELS[1 - m].SerializeToString())
        with session() as sess:
            np.testing.assert_allclose(sess.run(None, {"x": X})[0], WANT[m], **h.LOOSE)
            assert [n.provider for n in sess.plan.nodes if n.op_type == "Relu"] == [h.EXAMPLE_EP]
            level = sess.optimization.level
        (again,) = folder.glob(f"*{oc.SUFFIX}")
        assert again == entry and oc._decode(again.read_bytes(), MODELS[m], level) is not None


@given(text=st.one_of(st.just(""), st.integers(0, 1 << 40).map(str),
                      st.sampled_from(["-1", "abc", "1.5", "1e3", "0x10", "12kb"])))
@settings(deadline=None, max_examples=s.budget(10))
def test_the_budget_is_a_byte_count(text):
    old = os.environ.get(oc.BUDGET_ENV)
    os.environ[oc.BUDGET_ENV] = text
    try:
        if text == "":
            assert oc.budget() == oc.DEFAULT_BUDGET == 512 << 20
        elif text.isdigit():
            assert oc.budget() == int(text)
        else:
            with pytest.raises(InvalidArgument, match=rf"^{oc.BUDGET_ENV} must be a byte count \(an integer >= 0\); "
                                                      rf"got '{re.escape(text)}'$"):
                oc.budget()
    finally:
        if old is None:
            os.environ.pop(oc.BUDGET_ENV, None)
        else:
            os.environ[oc.BUDGET_ENV] = old


@given(order=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(LEVELS)), min_size=2, max_size=7),
       room=st.integers(1, 3))
@settings(deadline=None, max_examples=s.budget(6))
def test_the_folder_stays_within_its_budget_least_recently_used_first(order, room):
    """A budget of `room` entries (the largest entry's size times room): after every opening the folder is
    within it, no temporary file is left, and the entry just used is kept (opening it again is a hit)."""
    sizes = []
    with tempfile.TemporaryDirectory() as probe:
        sizing = oc.OptimizedModelCache(Path(probe), budget_bytes=1 << 30)
        for m in range(len(MODELS)):
            for level in LEVELS:
                oc.optimize_cached(MODELS[m], level, hooks._optimize, sizing)
        sizes = [p.stat().st_size for p in Path(probe).glob(f"*{oc.SUFFIX}")]
    budget = max(sizes) * room
    with tempfile.TemporaryDirectory() as tmp:
        cache = oc.OptimizedModelCache(Path(tmp), budget_bytes=budget)
        for m, level in order:
            oc.optimize_cached(MODELS[m], level, hooks._optimize, cache)
            entries = list(Path(tmp).glob(f"*{oc.SUFFIX}"))
            assert sum(p.stat().st_size for p in entries) <= budget
            assert not list(Path(tmp).glob(".tmp-*")), "a temporary file was left behind"

            def refuse(proto, lvl):
                raise AssertionError("the entry just used was evicted: optimized again")

            oc.optimize_cached(MODELS[m], level, refuse, cache)  # a hit


def test_entries_are_written_through_a_file_in_the_cache_folder(monkeypatch):
    """The temporary file an entry is written to lies in the cache folder, whatever the process's temp dir:
    os.replace is atomic only within one file system (a tmpfs /tmp beside ~/.cache is common). Here the temp
    dir does not exist at all; the second opening is still a hit."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = oc.OptimizedModelCache(Path(tmp) / "cache", budget_bytes=1 << 30)
        monkeypatch.setattr(tempfile, "tempdir", str(Path(tmp) / "no_such_temp_dir"))
        oc.optimize_cached(MODELS[0], LEVELS[0], hooks._optimize, cache)

        def refuse(proto, lvl):
            raise AssertionError("no entry was written: optimized again")

        result = oc.optimize_cached(MODELS[0], LEVELS[0], refuse, cache)
    assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in _fresh(0, LEVELS[0]).model.graph.node]


def test_an_entry_that_cannot_be_written_is_skipped_cleanly():
    """A folder stands where the entry goes (os.replace fails): the optimized model is returned all the same,
    the temporary file is removed, and the next opening optimizes again."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = oc.OptimizedModelCache(Path(tmp), budget_bytes=1 << 30)
        cache.path(cache.key(oc.model_digest(MODELS[0]), LEVELS[0])).mkdir()
        calls = []

        def optimize(proto, level):
            calls.append(level)
            return hooks._optimize(proto, level)

        for _ in range(2):
            result = oc.optimize_cached(MODELS[0], LEVELS[0], optimize, cache)
            assert [n.op_type for n in result.model.graph.node] == \
                [n.op_type for n in _fresh(0, LEVELS[0]).model.graph.node]
            assert not list(Path(tmp).glob(".tmp-*")), "a temporary file was left behind"
        assert len(calls) == 2


def test_a_hit_makes_its_entry_the_last_to_be_evicted():
    """Entries of models 0 and 1 aged 100 s and 50 s (explicit mtimes: no tie of the file system's clock), a hit
    on model 0, then model 2's entry takes the folder one byte over its budget: model 1's entry, the least
    recently used, is the one removed."""
    with tempfile.TemporaryDirectory() as probe:
        sizing = oc.OptimizedModelCache(Path(probe), budget_bytes=1 << 30)
        for m in range(len(MODELS)):
            oc.optimize_cached(MODELS[m], LEVELS[0], hooks._optimize, sizing)
        total = sum(p.stat().st_size for p in Path(probe).glob(f"*{oc.SUFFIX}"))
    calls = []

    def optimize(proto, level):
        calls.append(proto.graph.name)
        return hooks._optimize(proto, level)

    with tempfile.TemporaryDirectory() as tmp:
        cache = oc.OptimizedModelCache(Path(tmp), budget_bytes=total - 1)
        now = time.time()
        for m, age in ((0, 100), (1, 50)):
            before = set(Path(tmp).glob(f"*{oc.SUFFIX}"))
            oc.optimize_cached(MODELS[m], LEVELS[0], optimize, cache)
            (written,) = set(Path(tmp).glob(f"*{oc.SUFFIX}")) - before
            os.utime(written, (now - age, now - age))
        for m in (0, 2, 0, 1):  # a hit, a write that evicts, a hit, a miss
            oc.optimize_cached(MODELS[m], LEVELS[0], optimize, cache)
    assert calls == ["g0", "g1", "relu", "g1"]


def test_a_model_protobuf_cannot_serialize_is_optimized_every_time():
    """Over 2 GiB, SerializeToString raises (a stand-in here: building such a model would take the machine's
    memory): the model and level go to the optimizer as they are, nothing is looked up or stored."""
    class Huge:
        def SerializeToString(self, deterministic=False):  # noqa: N802 - protobuf's name
            raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")

    huge, calls = Huge(), []

    def optimize(proto, level):
        calls.append((proto, level))
        return "optimized"

    with tempfile.TemporaryDirectory() as tmp:
        cache = oc.OptimizedModelCache(Path(tmp), budget_bytes=1 << 30)
        for _ in range(2):
            assert oc.optimize_cached(huge, LEVELS[1], optimize, cache) == "optimized"
        assert list(Path(tmp).iterdir()) == []
    assert calls == [(huge, LEVELS[1])] * 2
