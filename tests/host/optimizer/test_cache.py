"""The optimized-model cache (host/optimizer/cache.py): a hit gives the model and the outputs an
uncached session gives, a changed model or level misses, damage is survived, the bound evicts, and the
session option turns it off."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from host.cli import zoo
from host.errors import InvalidArgument
from host.optimizer import cache, hooks
from host.optimizer.levels import GraphOptimizationLevel as Level
from host.optimizer.result import OptimizeResult, PassReport
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

ALL = Level.ORT_ENABLE_ALL


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private cache for the sessions of one test."""
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path))
    return tmp_path / "optimized"


@pytest.fixture
def optimizer_calls(monkeypatch):
    """How many times the session really optimized (a cache hit does not)."""
    calls = []
    real = hooks._optimize

    def counting(proto, level):
        calls.append(int(level))
        return real(proto, level)

    monkeypatch.setattr(hooks, "_optimize", counting)
    return calls


def _block(seed: int = 0) -> onnx.ModelProto:
    # LayerNormalization, Gelu, attention and MatMul+Add: several fusions fire, so the cached model
    # differs from the input.
    return zoo.transformer_block(seq=8, hidden=32, heads=4, ffn=64, seed=seed)


def _options(level=ALL, cached: str | None = None, path: str = "") -> SessionOptions:
    so = SessionOptions()
    so.graph_optimization_level = level
    if cached is not None:
        so.add_session_config_entry(cache.CONFIG_KEY, cached)
    if path:
        so.optimized_model_filepath = path
    return so


def _run(sess: InferenceSession, feeds: dict) -> list[np.ndarray]:
    return sess.run(None, feeds)


def _reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _entries(folder) -> list:
    return sorted(folder.glob(f"*{cache.SUFFIX}"))


def test_a_hit_gives_the_uncached_model_report_and_outputs(cache_dir, optimizer_calls):
    model = _block()
    feeds = zoo.random_inputs(model)
    uncached = InferenceSession(model.SerializeToString(), _options(cached="0"))
    first = InferenceSession(model.SerializeToString(), _options())
    assert optimizer_calls == [int(ALL), int(ALL)] and len(_entries(cache_dir)) == 1
    second = InferenceSession(model.SerializeToString(), _options())
    assert optimizer_calls == [int(ALL), int(ALL)]  # read back, not optimized again
    assert second.optimization.report and second.optimization.nodes_after < second.optimization.nodes_before
    for sess in (first, second):
        assert sess.optimization.model.SerializeToString() == uncached.optimization.model.SerializeToString()
        assert sess.optimization.report == uncached.optimization.report
        assert sess.optimization.source_opsets == uncached.optimization.source_opsets
        assert sess.optimization.summary() == uncached.optimization.summary()
    expected = _reference(model, feeds)
    for sess in (uncached, first, second):
        for got, want in zip(_run(sess, feeds), expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_changed_model_or_level_misses(cache_dir, optimizer_calls):
    InferenceSession(_block(seed=0).SerializeToString(), _options())
    InferenceSession(_block(seed=1).SerializeToString(), _options())  # other weights
    InferenceSession(_block(seed=0).SerializeToString(), _options(level=Level.ORT_ENABLE_BASIC))
    assert optimizer_calls == [int(ALL), int(ALL), int(Level.ORT_ENABLE_BASIC)]
    assert len(_entries(cache_dir)) == 3
    InferenceSession(_block(seed=0).SerializeToString(), _options(level=Level.ORT_ENABLE_BASIC))
    InferenceSession(_block(seed=1).SerializeToString(), _options())
    assert len(optimizer_calls) == 3


def _meta(entry) -> dict:
    import json

    data = entry.read_bytes()
    body = data[len(cache.MAGIC) + 32:]
    (length,) = cache._LENGTH.unpack_from(body, 0)
    return json.loads(body[4:4 + length])


def test_weights_the_optimizer_kept_are_not_stored_twice(cache_dir, optimizer_calls):
    """An entry holds placeholders for the large weights that are the source's bytes (a hit fills them from
    the source); weights the passes made are stored whole. The hit is the uncached model, byte for byte."""
    model = zoo.transformer_block(seq=8, hidden=64, heads=4, ffn=256)
    weights = {t.name: t.raw_data for t in model.graph.initializer if len(t.raw_data) >= cache.SHARED_MIN_BYTES}
    uncached = InferenceSession(model.SerializeToString(), _options(cached="0"))
    InferenceSession(model.SerializeToString(), _options())
    (entry,) = _entries(cache_dir)
    data = entry.read_bytes()
    kept = {t.name: t.raw_data for t in uncached.optimization.model.graph.initializer}
    shared = [n for n, raw in weights.items() if kept.get(n) == raw]
    assert shared and sorted(_meta(entry)["shared"]) == sorted(shared)
    assert all(weights[n] not in data for n in shared)
    made = [raw for n, raw in kept.items() if len(raw) >= cache.SHARED_MIN_BYTES and n not in shared]
    assert all(raw in data for raw in made)  # a weight the optimizer made (none or some) is in the entry
    assert len(data) < sum(len(weights[n]) for n in shared) // 4
    second = InferenceSession(model.SerializeToString(), _options())
    assert len(optimizer_calls) == 2
    assert second.optimization.model.SerializeToString() == uncached.optimization.model.SerializeToString()


def test_an_entry_whose_source_lacks_a_shared_weight_is_a_miss(cache_dir):
    model = zoo.transformer_block(seq=8, hidden=64, heads=4, ffn=256)
    InferenceSession(model.SerializeToString(), _options())
    (entry,) = _entries(cache_dir)
    assert cache._decode(entry.read_bytes(), model, ALL) is not None
    name = _meta(entry)["shared"][0]
    other = onnx.ModelProto()
    other.CopyFrom(model)
    (t,) = [t for t in other.graph.initializer if t.name == name]
    other.graph.initializer.remove(t)
    assert cache._decode(entry.read_bytes(), other, ALL) is None


def test_the_model_digest_reads_every_byte_of_the_weights():
    model = zoo.transformer_block(seq=8, hidden=64, heads=4, ffn=256)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    assert cache.model_digest(copy) == cache.model_digest(model)
    (big,) = [t for t in copy.graph.initializer if len(t.raw_data) >= 16384][:1]
    raw = bytearray(big.raw_data)
    raw[len(raw) // 2] ^= 1
    big.raw_data = bytes(raw)
    assert cache.model_digest(copy) != cache.model_digest(model)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    renamed.graph.node[0].name = "another"
    assert cache.model_digest(renamed) != cache.model_digest(model)


def test_the_key_covers_the_optimizer_fingerprint(monkeypatch):
    data = _block().SerializeToString()
    before = cache.OptimizedModelCache.key(data, ALL)
    monkeypatch.setattr(cache, "fingerprint", lambda: b"another optimizer")
    assert cache.OptimizedModelCache.key(data, ALL) != before


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped byte in the model", "empty"])
def test_a_damaged_entry_is_a_miss_and_is_written_again(cache_dir, optimizer_calls, damage):
    model = _block()
    feeds = zoo.random_inputs(model)
    InferenceSession(model.SerializeToString(), _options())
    (entry,) = _entries(cache_dir)
    data = entry.read_bytes()
    entry.write_bytes({"garbage": b"not an entry at all" * 10, "truncated": data[:len(data) // 2],
                       "flipped byte in the model": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
                       "empty": b""}[damage])
    sess = InferenceSession(model.SerializeToString(), _options())
    assert len(optimizer_calls) == 2  # the damaged entry was not used
    for got, want in zip(_run(sess, feeds), _reference(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert entry.read_bytes() == data  # rewritten whole
    InferenceSession(model.SerializeToString(), _options())
    assert len(optimizer_calls) == 2


def test_the_off_switch_neither_reads_nor_writes(cache_dir, optimizer_calls):
    model = _block().SerializeToString()
    InferenceSession(model, _options(cached="0"))
    assert not cache_dir.exists()
    InferenceSession(model, _options())
    InferenceSession(model, _options(cached="0"))
    assert len(optimizer_calls) == 3 and len(_entries(cache_dir)) == 1


def test_a_bad_switch_value_is_refused(cache_dir):
    with pytest.raises(InvalidArgument, match="^session config entry 'session.ephost.optimized_model_cache' "
                                              "must be \"0\" or \"1\"; got 'yes'$"):
        InferenceSession(_block().SerializeToString(), _options(cached="yes"))


def test_optimized_model_filepath_is_written_on_a_hit(cache_dir, optimizer_calls, tmp_path):
    model = _block().SerializeToString()
    InferenceSession(model, _options(path=str(tmp_path / "first.onnx")))
    InferenceSession(model, _options(path=str(tmp_path / "second.onnx")))
    assert len(optimizer_calls) == 1
    first, second = (onnx.load(str(tmp_path / f"{n}.onnx")) for n in ("first", "second"))
    assert first.SerializeToString() == second.SerializeToString()
    assert len(second.graph.node) < len(_block().graph.node)


def test_a_model_the_optimizer_leaves_alone_is_stored_without_a_copy(cache_dir, optimizer_calls):
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)  # 16 KiB the entry must not copy
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [2, 64])],
                              [helper.make_tensor_value_info("y", 1, [2, 64])], [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    InferenceSession(model.SerializeToString(), _options())
    (entry,) = _entries(cache_dir)
    assert entry.stat().st_size < 1024  # the report only
    sess = InferenceSession(model.SerializeToString(), _options())
    assert len(optimizer_calls) == 1 and sess.optimization.report == []
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)
    source = onnx.load_from_string(model.SerializeToString())
    hit = cache.OptimizedModelCache().lookup(entry.name[:-len(cache.SUFFIX)], source, ALL)
    assert hit.model is source


def test_a_result_that_is_not_cacheable_is_not_stored(tmp_path):
    store = cache.OptimizedModelCache(tmp_path, budget_bytes=1 << 20)
    model = _block()
    result = OptimizeResult(model, ALL, [], 1, 1, cacheable=False)
    assert cache.optimize_cached(model, ALL, lambda proto, level: result, store) is result
    assert _entries(tmp_path) == []


def _result(seed: int) -> tuple[onnx.ModelProto, OptimizeResult]:
    source = _block(seed)
    optimized = _block(seed + 100)  # any model: the cache stores what it is given
    return source, OptimizeResult(optimized, ALL, [PassReport("p", 3, 2, {"A": 1})], 3, 2, {"": 17})


def test_the_bound_evicts_the_least_recently_used(tmp_path):
    entries = [_result(seed) for seed in range(3)]
    size = len(cache._encode(entries[0][1], unchanged=False))
    store = cache.OptimizedModelCache(tmp_path, budget_bytes=int(2.5 * size))
    keys = [store.key(src.SerializeToString(), ALL) for src, _ in entries]
    for i, (key, (src, res)) in enumerate(zip(keys[:2], entries)):
        store.store(key, res, src)
        os.utime(store.path(key), ns=(10**18 + i, 10**18 + i))  # the order does not rest on the clock
    assert store.lookup(keys[0], *entries[0][0:1], ALL) is not None  # used: now the most recent
    store.store(keys[2], entries[2][1], entries[2][0])
    assert store.path(keys[0]).exists() and store.path(keys[2]).exists()
    assert not store.path(keys[1]).exists()  # the least recently used went
    hit = store.lookup(keys[2], entries[2][0], ALL)
    assert hit.model.SerializeToString() == entries[2][1].model.SerializeToString()
    assert hit.report == entries[2][1].report and hit.source_opsets == {"": 17}


def test_an_entry_over_the_whole_budget_is_not_written(tmp_path):
    src, res = _result(0)
    store = cache.OptimizedModelCache(tmp_path, budget_bytes=100)
    store.store(store.key(src.SerializeToString(), ALL), res, src)
    assert _entries(tmp_path) == []


def test_a_folder_that_cannot_be_written_costs_only_the_cache(tmp_path, monkeypatch, optimizer_calls):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(blocker))
    model = _block()
    feeds = zoo.random_inputs(model)
    sess = InferenceSession(model.SerializeToString(), _options())
    for got, want in zip(_run(sess, feeds), _reference(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_bad_budget_is_refused(monkeypatch):
    monkeypatch.setenv(cache.BUDGET_ENV, "lots")
    with pytest.raises(InvalidArgument, match="^EPHOST_OPTIMIZED_CACHE_BYTES must be a byte count "
                                              r"\(an integer >= 0\); got 'lots'$"):
        cache.budget()


def test_entries_written_by_another_process_are_counted_at_the_next_scan(tmp_path):
    entries = [_result(seed) for seed in range(4)]
    size = len(cache._encode(entries[0][1], unchanged=False))
    store = cache.OptimizedModelCache(tmp_path, budget_bytes=int(2.5 * size))
    keys = [store.key(src.SerializeToString(), ALL) for src, _ in entries]
    store.store(keys[0], entries[0][1], entries[0][0])  # the first write counts the folder
    other = store.path("written-by-another-process")
    other.write_bytes(store.path(keys[0]).read_bytes())
    for i, path in enumerate((store.path(keys[0]), other)):
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    store.store(keys[1], entries[1][1], entries[1][0])
    assert len(_entries(tmp_path)) == 3  # within the budget as this process counts: no scan
    store.store(keys[2], entries[2][1], entries[2][0])  # over it: the scan sees all four
    assert sorted(_entries(tmp_path)) == sorted([store.path(keys[1]), store.path(keys[2])])
