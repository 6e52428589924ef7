"""Plans per input-shape signature, without a GPU: the LRU of plans, the shared constants, the
specialization of a fused graph and the claim of nodes with symbolic dims (plugin_cuda/plan/signatures.py,
plan/lower.py's probe). The GPU side is tests/plugin_cuda/test_dynamic_plans.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugin_cuda.plan import codegen
from plugin_cuda.plan.fuse import build_steps
from plugin_cuda.plan.lower import PROBE_DIM, lower, partition_io, unsupported_reason
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.plan.partition import fusable_groups
from plugin_cuda.plan.signatures import ConstantStore, PlanCache, is_dynamic, specialize


class FakePlan:
    def __init__(self, signature, arena_bytes=100):
        self.signature = signature
        self.arena_bytes = arena_bytes
        self.const_bytes = 0
        self.closed = False

    def close(self):
        self.closed = True


def make_cache(max_plans=2, max_bytes=10**9, arena=100):
    built = []

    def build(signature):
        plan = FakePlan(signature, arena)
        built.append(plan)
        return plan

    return PlanCache(build, max_plans, max_bytes), built


def use(cache, signature):
    plan = cache.acquire(signature)
    cache.release(signature, plan)
    return plan


def test_a_signature_seen_before_reuses_its_plan():
    cache, built = make_cache(max_plans=4)
    a = use(cache, ((1, 16),))
    b = use(cache, ((8, 128),))
    assert use(cache, ((1, 16),)) is a and use(cache, ((8, 128),)) is b
    assert len(built) == 2 and cache.stats == {"builds": 2, "hits": 2, "evictions": 0}


def test_the_least_recently_used_plan_is_evicted_and_closed():
    cache, built = make_cache(max_plans=2)
    a = use(cache, ("a",))
    b = use(cache, ("b",))
    use(cache, ("a",))  # a is now the most recent
    c = use(cache, ("c",))
    assert cache.signatures() == [("a",), ("c",)]
    assert b.closed and not a.closed and not c.closed
    assert cache.stats["evictions"] == 1


def test_the_byte_bound_evicts_too_but_keeps_the_plan_just_built():
    cache, built = make_cache(max_plans=10, max_bytes=250, arena=100)
    for s in "abc":
        use(cache, (s,))
    assert cache.signatures() == [("b",), ("c",)] and cache.bytes == 200
    big = PlanCache(lambda s: FakePlan(s, 1000), 10, 250)
    use(big, ("x",))
    use(big, ("y",))
    assert big.signatures() == [("y",)]  # over the budget alone: kept, the others go


def test_a_plan_evicted_while_a_run_holds_it_closes_at_release():
    cache, built = make_cache(max_plans=1)
    held = cache.acquire(("a",))
    use(cache, ("b",))  # evicts a while it runs
    assert not held.closed
    cache.release(("a",), held)
    assert held.closed
    assert cache.plans() == [built[1]]


def test_close_closes_every_plan_held_or_retired():
    cache, built = make_cache(max_plans=1)
    held = cache.acquire(("a",))
    use(cache, ("b",))
    cache.close()
    assert all(p.closed for p in built) and held.closed and len(cache) == 0


def test_a_failed_build_leaves_the_cache_unchanged():
    def build(signature):
        raise ValueError(f"cannot plan {signature}")

    cache = PlanCache(build, 2, 10**9)
    with pytest.raises(ValueError, match="^cannot plan"):
        cache.acquire(("a",))
    assert len(cache) == 0 and cache.bytes == 0


def test_threads_share_one_plan_per_signature():
    cache, built = make_cache(max_plans=8)
    errors = []

    def worker(k):
        try:
            for i in range(200):
                use(cache, ((i + k) % 4,))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(built) == 4 and not any(p.closed for p in built)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="^max_plans must be >= 1, got 0"):
        PlanCache(lambda s: None, 0, 1)


class Block:
    def __init__(self, data, base):
        self.data = data.copy()
        self.ptr = base


def make_store():
    uploads = []

    def upload(host):
        block = Block(host, 4096 * (len(uploads) + 1) * 1000)
        uploads.append(block)
        return block

    return ConstantStore(upload), uploads


def test_constants_are_uploaded_once_across_plans():
    store, uploads = make_store()
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones(5, np.float32)
    first = store.addresses([("w", w), ("b", b)], 256)
    assert len(uploads) == 1 and first[1] - first[0] == 256  # one block, aligned
    assert np.array_equal(uploads[0].data[:48].view(np.float32), w.reshape(-1))
    again = store.addresses([("b", b), ("w", w)], 256)
    assert again == [first[1], first[0]] and len(uploads) == 1


def test_a_derived_constant_with_the_same_contents_is_shared_and_a_different_one_is_not():
    store, uploads = make_store()
    w = np.arange(6, dtype=np.float32)
    (a,) = store.addresses([("t", w)], 256)
    (b,) = store.addresses([("t", w.copy())], 256)  # equal contents, another array
    assert a == b and len(uploads) == 1
    (c,) = store.addresses([("t", w + 1)], 256)
    assert c != a and len(uploads) == 2
    assert store.nbytes == 512


def _dynamic_model():
    """x[batch, seq, 8] -> MatMul(W) + b -> Relu -> Softmax -> Reshape(0, 0, 2, 4) -> Transpose."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0, 0, 2, 4], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["s"], name="sm", axis=-1),
             helper.make_node("Reshape", ["s", "shape"], ["h"], name="rs"),
             helper.make_node("Transpose", ["h"], ["y"], name="tr", perm=[0, 2, 1, 3])]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_nodes_with_symbolic_dims_are_claimed_only_with_a_probe():
    spec = spec_from_onnx(_dynamic_model())
    assert fusable_groups(spec) == []
    groups = fusable_groups(spec, dynamic=True)
    assert [len(g) for g in groups] == [6]
    mm = spec.nodes[0]
    assert unsupported_reason(spec, mm) == "input 0 has no static shape"
    assert unsupported_reason(spec, mm, probe=PROBE_DIM) == ""


def test_a_probe_still_refuses_what_no_size_makes_valid():
    model = _dynamic_model()
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.array([0, 0, 3, 4], np.int64), "shape"))
    spec = spec_from_onnx(model)
    reshape = spec.nodes[4]
    assert "Reshape" in unsupported_reason(spec, reshape, probe=PROBE_DIM)
    assert [len(g) for g in fusable_groups(spec, dynamic=True)] == [4, 1]  # Transpose alone after it


@pytest.mark.parametrize("batch,seq", [(1, 16), (3, 50), (8, 128)])
def test_a_specialized_graph_lowers_to_the_signatures_shapes(batch, seq):
    spec = spec_from_onnx(_dynamic_model())
    ins, outs = partition_io(spec)
    assert is_dynamic(spec, ins)
    special = specialize(spec, ins, [(batch, seq, 8)])
    assert not is_dynamic(special, ins)
    assert spec.values[ins[0]].shape == (-1, -1, 8)  # the original is untouched
    prog = lower(special, [special.values[i] for i in ins], [special.values[o] for o in outs])
    assert prog.values[prog.outputs[0]].shape == (batch, 2, seq, 4)
    w = next(v for v in special.values if v.name == "W")
    assert next(v for v in spec.values if v.name == "W").constant is w.constant  # shared, not copied
    assert [s.expr for s in prog.symbols] == ["S0", "S1"] and list(prog.symbols) == [batch, seq]


def _source(batch, seq, symbolic=True):
    spec = spec_from_onnx(_dynamic_model())
    ins, outs = partition_io(spec)
    special = specialize(spec, ins, [(batch, seq, 8)], symbolic=symbolic)
    prog = lower(special, [special.values[i] for i in ins], [special.values[o] for o in outs])
    return codegen.generate(prog, build_steps(prog, tiled=True), "ep_k")[0]


def test_the_source_of_a_symbolic_plan_is_the_same_for_every_signature_that_plans_alike():
    a, b = _source(3, 50), _source(8, 128)
    assert a == b  # one NVRTC compile serves both
    assert _source(1, 16) == a  # a batch of 1 is not taken for a broadcast
    assert "const int S0, const int S1, " in a and "(S0*S1)" in a
    assert _source(3, 50, symbolic=False) != _source(8, 128, symbolic=False)  # literals: one module each
    assert "400" in _source(8, 50, symbolic=False)  # 8 * 50 rows, baked


def test_a_graph_without_symbolic_dims_is_not_dynamic():
    model = _dynamic_model()
    for d, v in zip(model.graph.input[0].type.tensor_type.shape.dim, (2, 3, 8)):
        d.dim_value = v
    spec = spec_from_onnx(model)
    ins, _ = partition_io(spec)
    assert not is_dynamic(spec, ins)
    assert [len(g) for g in fusable_groups(spec)] == [6]


def test_index_expressions_hold_for_every_size_of_a_symbolic_dim():
    from plugin_cuda.plan.codegen import index_expr
    from plugin_cuda.plan.symint import SymInt

    b1, s = SymInt(1, "S0"), SymInt(5, "S1")
    assert index_expr((b1, s, 4), (s, 4)) == "(i % (S1*4))"  # as for any batch, not "i"
    assert index_expr((b1, s, 4), (b1, s, 4)) == "i"
    assert index_expr((SymInt(8, "S0"), s, 4), (SymInt(1, "S2"), s, 4)) == "(((i / 4) % S1) * 4 + ((i / 1) % 4) * 1)"
    assert index_expr((1, 5, 4), (5, 4)) == "i"  # literal sizes keep the shortest form


def _masked_attention_model(shape_is_input: bool = True, extra_use: bool = False):
    """q, k, v [B, H, S, D]; mask [B, 1, 1, S] -> Expand(mask, rows) -> Attention's mask (the
    optimizer's Attention fusion writes this Expand for onnxruntime's sake)."""
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, f, ["batch", 2, "seq", 4]) for n in ("q", "k", "v")]
    ins.append(helper.make_tensor_value_info("mask", f, ["batch", 1, 1, "seq"]))
    inits = []
    if shape_is_input:
        ins.append(helper.make_tensor_value_info("rows", TensorProto.INT64, [2]))
    else:
        inits.append(numpy_helper.from_array(np.array([1, 1], np.int64), "rows"))
    nodes = [helper.make_node("Expand", ["mask", "rows"], ["m4"], name="expand"),
             helper.make_node("Attention", ["q", "k", "v", "m4"], ["att"], name="attn"),
             helper.make_node("Relu", ["att"], ["y"], name="relu")]
    outs = [helper.make_tensor_value_info("y", f, None)]
    if extra_use:
        nodes.append(helper.make_node("Neg", ["m4"], ["n"], name="neg"))
        outs.append(helper.make_tensor_value_info("n", f, None))
    graph = helper.make_graph(nodes, "g", ins, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_an_expand_that_only_feeds_attention_masks_is_read_unexpanded():
    spec = spec_from_onnx(_masked_attention_model())
    assert [len(g) for g in fusable_groups(spec, dynamic=True)] == [3]  # the Expand joins the group
    ins, outs = partition_io(spec)
    shapes = {"q": (3, 2, 5, 4), "k": (3, 2, 5, 4), "v": (3, 2, 5, 4), "mask": (3, 1, 1, 5), "rows": (2,)}
    special = specialize(spec, ins, [shapes[spec.values[i].name] for i in ins])
    prog = lower(special, [special.values[i] for i in ins], [special.values[o] for o in outs])
    expand = next(op for op in prog.ops if op.node == "expand")
    assert expand.kind == "alias" and prog.values[expand.outputs[0]].shape == (3, 1, 1, 5)
    assert prog.values[prog.outputs[0]].shape == (3, 2, 5, 4)


def test_an_expand_with_other_readers_still_needs_a_constant_shape():
    spec = spec_from_onnx(_masked_attention_model(extra_use=True))
    expand = next(n for n in spec.nodes if n.name == "expand")
    assert unsupported_reason(spec, expand, probe=PROBE_DIM) == "input 1 must be a constant"
    const = spec_from_onnx(_masked_attention_model(shape_is_input=False, extra_use=True))
    expand = next(n for n in const.nodes if n.name == "expand")
    assert unsupported_reason(const, expand, probe=PROBE_DIM) == ""  # a constant shape: the usual Expand


def _symbolic_source(nodes, inputs, shapes, inits=(), opset=23) -> str:
    """The CUDA source of the plan of `nodes` over `inputs` (value infos with symbolic dims), for the
    signature `shapes` (one per input)."""
    y = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [y], list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    spec = spec_from_onnx(model)
    ins, outs = partition_io(spec)
    special = specialize(spec, ins, shapes)
    prog = lower(special, [special.values[i] for i in ins], [special.values[o] for o in outs])
    return codegen.generate(prog, build_steps(prog, tiled=True), "ep_k")[0]


def _norm_source(batch, seq):
    """x[batch, seq, 8] -> LayerNormalization -> RMSNormalization: row kernels over symbolic row counts."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    inits = [numpy_helper.from_array(np.full(8, 1.5, np.float32), "g"),
             numpy_helper.from_array(np.full(8, 0.5, np.float32), "b")]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], name="ln", axis=-1),
             helper.make_node("RMSNormalization", ["n", "g"], ["y"], name="rms", axis=-1)]
    return _symbolic_source(nodes, [x], [(batch, seq, 8)], inits)


def _rotary_source(batch, seq):
    """x[batch, seq, 2 heads x 8] -> RotaryEmbedding with cos/sin caches [batch, seq, 4] (as a Llama
    export computes them from its positions) -> Relu."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])
    caches = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", 4]) for n in ("cos", "sin")]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["r"], name="rope", num_heads=2),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    return _symbolic_source(nodes, [x, *caches], [(batch, seq, 16), (batch, seq, 4), (batch, seq, 4)])


def test_norm_kernels_bound_their_warps_by_the_symbolic_row_count():
    # one warp per row, the last block's spare warps leaving at the row count: an expression of S0 and
    # S1, never the signature's number (which would compile a module per shape)
    a = _norm_source(3, 50)
    assert a == _norm_source(8, 128)
    assert "150" not in a and "S0*S1" in a


def test_a_rotary_kernel_is_bounded_by_the_symbolic_element_count():
    # The Llama export's plan compiled its RotaryEmbedding again at every new (batch, seq): the thread
    # bound was the signature's element count (153600 at 3x50), not an expression of the symbols
    a = _rotary_source(3, 50)
    assert a == _rotary_source(8, 128)
    assert "2400" not in a and "if (i >= ((S0*S1)*16)) return;" in a
