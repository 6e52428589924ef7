"""The CUDA plugin's compiled plans on a GPU: results, memory, kernel cache, capture, auto-graph.

References are independent: onnx.reference.ReferenceEvaluator for the numbers, the plugin's
per-node path for the session test. TF32 is off so float32 results compare tightly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host.cli import zoo
from tests.plugin_cuda.attention_models import CASES as ATTENTION_CASES
from tests.plugin_cuda.attention_models import attention_feeds, attention_model
from tests.plugin_cuda.layout_models import CASES as LAYOUT_CASES
from tests.plugin_cuda.layout_models import feeds as layout_feeds

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
ROOT = Path(__file__).resolve().parents[2]

MODELS = {
    "mlp-8x256-b1": lambda: zoo.mlp(layers=8, hidden=256, batch=1),  # generated GEMV + epilogue kernels
    "mlp-3x64-b32": lambda: zoo.mlp(layers=3, hidden=64, batch=32),  # generated tiled GEMMs + epilogues
    "mlp-2x512-b512": lambda: zoo.mlp(layers=2, hidden=512, batch=512),  # cuBLASLt GEMMs, RELU_BIAS epilogues
    "mlp-gemm-2x512-b512": lambda: zoo.mlp(layers=2, hidden=512, batch=512, use_gemm=True),  # Gemm's C as the bias
    "mlp-odd-b37": lambda: zoo.mlp(layers=2, hidden=70, batch=37, in_features=19),  # ragged 32x32 tile edges
    "mlp-wide-b512": lambda: zoo.mlp(layers=1, hidden=2000, batch=500, in_features=64),  # 64x64 tiles, ragged
    "mlp-gemm-b4": lambda: zoo.mlp(layers=3, hidden=48, batch=4, in_features=20, use_gemm=True),
    "transformer": lambda: zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128),
    "transformer-gelu20": lambda: zoo.transformer_block(seq=8, hidden=32, heads=2, ffn=64, opset=20),
}


def reference(model, feeds):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def build(model, **kw):
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan

    kw.setdefault("use_tf32", False)
    return Plan.build(spec_from_onnx(model), **kw)


class Runner:
    """Device buffers for a plan's inputs and outputs and a non-blocking stream to run it on."""

    def __init__(self, cp, plan):
        self.cp = cp
        self.plan = plan
        self.stream = cp.cuda.Stream(non_blocking=True)

    def __call__(self, feeds: list, fresh: bool = True):
        cp = self.cp
        ins = [cp.asarray(x) for x in feeds]
        outs = [cp.full(s, np.nan, np.float32) for s in self.plan.output_shapes]
        cp.cuda.Device().synchronize()  # the non-blocking stream must see the uploads
        self.plan.run(self.stream.ptr, [a.data.ptr for a in ins], [o.data.ptr for o in outs])
        self.stream.synchronize()
        self.keep = ins
        return outs


def feeds_for(model, seed=0):
    return zoo.random_inputs(model, seed=seed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_matches_onnx_reference(cp, name):
    model = MODELS[name]()
    feeds = feeds_for(model)
    with build(model) as plan:
        outs = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        want = reference(model, feeds)
        for got, exp in zip(outs, want):
            np.testing.assert_allclose(cp.asnumpy(got), exp, rtol=1e-4, atol=1e-4)
        assert plan.num_kernels + plan.num_cublas == len(plan.steps) < plan.num_nodes
        if "b512" in name and "wide" not in name:  # the bias (and ReLU) ran in cuBLASLt's epilogue
            assert {s.op.attrs.get("epilogue") for s in plan.steps if s.kind == "gemm"} <= {"bias", "relu_bias"}


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_plan_matches_onnx_reference(cp, name):
    """Attention-23 with an additive float attn_mask (broadcast, padded, with causal, GQA, 3-D)."""
    q, k, v, mask, attrs = ATTENTION_CASES[name]
    model = attention_model(q, k, v, mask, attrs)
    feeds = attention_feeds(model)
    with build(model) as plan:
        (got,) = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        np.testing.assert_allclose(cp.asnumpy(got), reference(model, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_layout_plan_matches_onnx_reference(cp, name):
    """Split and Concat (strided copies), Expand (a broadcast), RotaryEmbedding, convolutions (whole
    or split over channels, with their epilogues), pools, means."""
    model = LAYOUT_CASES[name]()
    feeds = layout_feeds(model)
    with build(model) as plan:
        outs = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        want = reference(model, feeds)
        assert len(outs) == len(want)
        for got, exp in zip(outs, want):
            # float32 sums of hundreds of products, added in another order: atol scales with the output
            np.testing.assert_allclose(cp.asnumpy(got), exp, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(exp).max())))


def _check_row_kernel(cp, model, x, want, kind: str, tolerance: tuple) -> None:
    """The plan of a one-row-kernel model gives `want` on `x`, from a warp per row where the row has at
    most codegen.WARP_ROW_COLS columns (in registers, WARP_ROWS_PER_BLOCK rows to a block), else a block's."""
    from plugin_cuda.plan import codegen

    rows, cols = x.shape
    with build(model) as plan:
        (got,) = Runner(cp, plan)([x])
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=tolerance[0], atol=tolerance[1])
        (spec,) = [s for s in plan.eager.specs if s is not None and s.step.kind == kind]
        warp = cols <= codegen.WARP_ROW_COLS
        assert spec.grid[0] == (-(-rows // codegen.WARP_ROWS_PER_BLOCK) if warp else rows)
        assert ("float v[" in spec.source) == warp


def _softmax_model(op: str, rows: int, cols: int):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op, ["X"], ["Y"], axis=-1)], "softmax",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, cols])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("cols", [1, 5, 33, 1024, 1025, 3000])
def test_softmax_rows_take_a_warp_up_to_1024_columns_and_a_block_beyond(cp, op, cols):
    """codegen.softmax_kernel: a row of up to WARP_ROW_COLS literal columns is one warp's (in registers,
    4 rows to a block; 7 rows leave the last block's last warp without a row), a longer row a block's;
    both give NumPy's float64 result, with large logits and a very negative one per row (onnx's reference
    gives -inf for its LogSoftmax: log of an exponential that underflowed, where x - max - log(sum) is finite)."""
    rows = 7
    model = _softmax_model(op, rows, cols)
    x = (np.random.default_rng(cols).standard_normal((rows, cols)) * 20).astype(np.float32)
    x[:, cols // 2] = -1e30
    shifted = x.astype(np.float64) - x.max(-1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = shifted - log_sum if op == "LogSoftmax" else np.exp(shifted - log_sum)
    _check_row_kernel(cp, model, x, want, "softmax", tolerance=(1e-5, 1e-6))


def _norm_model(op: str, rows: int, cols: int, rng):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, cols).astype(np.float32), "scale")]
    if op == "LayerNormalization":
        inits.append(numpy_helper.from_array(rng.standard_normal(cols).astype(np.float32), "bias"))
    node = helper.make_node(op, ["X"] + [t.name for t in inits], ["Y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "norm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, cols])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("op", ["LayerNormalization", "RMSNormalization"])
@pytest.mark.parametrize("cols", [20, 768, 1024, 1025, 2000])
def test_norm_rows_take_a_warp_up_to_1024_columns_and_a_block_beyond(cp, op, cols):
    """codegen.norm_kernel: LayerNorm (scale and bias) and RMSNorm rows of up to WARP_ROW_COLS columns in one
    warp's registers, longer ones in a block's passes; against NumPy's float64 statistics, on rows with a
    large offset (a one-pass variance would lose them)."""
    rows = 7
    rng = np.random.default_rng(cols)
    model = _norm_model(op, rows, cols, rng)
    x = (rng.standard_normal((rows, cols)) * 3 + 50).astype(np.float32)
    scale, *bias = [np.frombuffer(t.raw_data, np.float32) for t in model.graph.initializer]
    x64 = x.astype(np.float64)
    if op == "LayerNormalization":
        centred = x64 - x64.mean(-1, keepdims=True)
        want = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias[0]
    else:
        want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    _check_row_kernel(cp, model, x, want, "norm", tolerance=(1e-4, 1e-4))


def _projected_attention(batch=3, seq=5, kv_seq=7, heads=4, size=8, gqa=1, project_out=False):
    """X -> MatMul (Q), Y -> MatMul (K, V) -> 3-D Attention with an additive mask (-> MatMul with
    `project_out`): Q, K and V are plan values (arena addresses), as after a model's projections; the
    attention's output is the plan's output, or with `project_out` a plan value too."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    hidden, kv_hidden = heads * size, heads // gqa * size
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, n)) / 4).astype(np.float32), name)
             for name, n in (("wq", hidden), ("wk", kv_hidden), ("wv", kv_hidden), ("wo", hidden))]
    attended = "att" if project_out else "out"
    nodes = [helper.make_node("MatMul", ["X", "wq"], ["q"]), helper.make_node("MatMul", ["Y", "wk"], ["k"]),
             helper.make_node("MatMul", ["Y", "wv"], ["v"]),
             helper.make_node("Attention", ["q", "k", "v", "M"], [attended], q_num_heads=heads,
                              kv_num_heads=heads // gqa)]
    if project_out:
        nodes.append(helper.make_node("MatMul", ["att", "wo"], ["out"]))
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, seq, hidden]),
              helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, kv_seq, hidden]),
              helper.make_tensor_value_info("M", TensorProto.FLOAT, [batch, 1, seq, kv_seq])]
    graph = helper.make_graph(nodes, "projected", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _bgemm_steps(plan) -> list:
    """Each instance's two Attention products (plan._CublasStep), scores first."""
    from plugin_cuda.plan import plan as plan_module

    assert plan._instances
    found = []
    for inst in plan._instances.values():
        steps = [item for item, step in zip(inst.eager_seq, plan.eager.steps) if step.kind == "bgemm"]
        assert len(steps) == 2 and all(isinstance(s, plan_module._CublasStep) for s in steps)
        found.append(steps)
    return found


@pytest.mark.parametrize("project_out", [False, True], ids=["attention-out", "projected-out"])
@pytest.mark.parametrize("gqa", [1, 2])
def test_a_3d_attention_over_plan_values_is_one_pointer_batched_gemm_per_product(cp, gqa, project_out):
    """The 3-D layout needs one strided call per batch item (per kv head with GQA); a product whose operands
    are all plan values is one cublasGemmBatchedEx over all their matrices instead (plan._CublasStep.
    _pointer_batched). A product writing the plan's output (an address given per run) keeps the strided
    calls. Both give onnx's reference result."""
    model = _projected_attention(gqa=gqa, project_out=project_out)
    rng = np.random.default_rng(4)
    feeds = {"X": rng.standard_normal((3, 5, 32)).astype(np.float32),
             "Y": rng.standard_normal((3, 7, 32)).astype(np.float32),
             "M": rng.uniform(-2, 0, (3, 1, 5, 7)).astype(np.float32)}
    with build(model) as plan:  # 5 queries, 7 keys: the two-GEMM path (flash from 64 of each)
        (got,) = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        np.testing.assert_allclose(cp.asnumpy(got), reference(model, feeds)[0], rtol=1e-4, atol=1e-5)
        for scores, values in _bgemm_steps(plan):
            # the library's functions (cdata pointers: they compare by address, and have no name)
            batched, strided = scores.lib.cublasGemmBatchedEx, scores.lib.cublasGemmStridedBatchedEx
            assert [fn == batched for fn, _, _ in scores.calls] == [True]
            assert scores.calls[0][1][17] == 3 * 4  # every (batch item, query head) matrix in one call
            if project_out:
                assert [fn == batched for fn, _, _ in values.calls] == [True]
            else:  # one strided call per batch item (per kv head with GQA)
                assert [fn == strided for fn, _, _ in values.calls] == [True] * 3 * gqa


def test_attention_plan_fully_masked_row_is_zero(cp):
    model = attention_model((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4), (2, 3))
    feeds = attention_feeds(model)
    feeds["M"][0, :] = -np.inf
    with build(model) as plan:
        (got,) = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        got = cp.asnumpy(got)
    assert np.all(got[0, 0, 0] == 0)
    np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_steady_state_allocates_nothing(cp):
    model = MODELS["transformer"]()
    feeds = feeds_for(model)
    pool = cp.get_default_memory_pool()
    with build(model) as plan:
        run = Runner(cp, plan)
        x = cp.asarray(feeds["input"])
        out = cp.empty(plan.output_shapes[0], np.float32)
        cp.cuda.Device().synchronize()
        plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr])  # first run on this stream: the arena
        run.stream.synchronize()
        before = (pool.used_bytes(), pool.total_bytes(), dict(plan.stats))
        for _ in range(100):
            plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr])
        run.stream.synchronize()
        after = (pool.used_bytes(), pool.total_bytes(), dict(plan.stats))
        print(f"steady state: {after[0] - before[0]} bytes used, {after[1] - before[1]} bytes reserved, "
              f"{after[2]['allocations'] - before[2]['allocations']} allocations over 100 runs; "
              f"arena {plan.arena_bytes} bytes (one buffer each: {plan.naive_bytes})")
        assert after[0] == before[0] and after[1] == before[1]
        assert after[2]["allocations"] == before[2]["allocations"]
        assert plan.arena_bytes < plan.naive_bytes  # liveness let intermediates share bytes
        np.testing.assert_allclose(cp.asnumpy(out), reference(model, feeds)[0], rtol=1e-4, atol=1e-4)


def test_kernel_cache_hit_on_second_build(cp):
    from plugin_cuda.device import nvrtc

    model = MODELS["mlp-3x64-b32"]()
    with build(model) as first:
        loads = nvrtc.stats["compiles"]
        with build(model) as second:
            assert second.cache_hit
            assert nvrtc.stats["compiles"] == loads  # no second NVRTC compile in this process
            assert second.module is first.module


_DISK_SCRIPT = """
import sys, json
sys.path.insert(0, sys.argv[1])
from host.cli import zoo
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.plan.plan import Plan
from plugin_cuda.device import nvrtc
plan = Plan.build(spec_from_onnx(zoo.mlp(layers=2, hidden=24, batch=3, seed=7)), use_tf32=False)
print(json.dumps({k: v for k, v in nvrtc.stats.items() if k != "compile_seconds"}))
"""


def test_kernel_cache_on_disk_serves_a_new_process(cp, tmp_path):
    env = dict(os.environ, EPHOST_CACHE_DIR=str(tmp_path / "cache"), CUPY_CACHE_DIR=str(tmp_path / "cache" / "cupy"))

    def files():
        return sorted(p.name for p in (tmp_path / "cache" / "nvrtc").rglob("*") if p.is_file())

    stats = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _DISK_SCRIPT, str(ROOT)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        stats.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if _ == 0:
            first = files()
    assert first and files() == first  # the second process compiled nothing new: it loaded the binary
    assert stats[0]["compiles"] >= 1 and stats[1]["compiles"] == 0 and stats[1]["disk"] >= 1, stats


def test_capture_replays_the_same_launches(cp):
    from plugin_cuda.device import capture, driver

    model = MODELS["transformer"]()
    f1, f2 = feeds_for(model, 1), feeds_for(model, 2)
    with build(model) as plan:
        run = Runner(cp, plan)
        x = cp.asarray(f1["input"])
        out = cp.empty(plan.output_shapes[0], np.float32)
        cp.cuda.Device().synchronize()
        plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr])  # warm-up: the stream's arena
        run.stream.synchronize()
        eager1 = cp.asnumpy(out)
        handle = driver.stream(run.stream.ptr)
        graph = capture.Graph.capture(handle, lambda: plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr], True))
        try:
            x.set(f2["input"])
            out.fill(np.nan)
            cp.cuda.Device().synchronize()
            driver.check(driver.lib().cuGraphLaunch(graph.exec_handle, handle), "cuGraphLaunch")
            run.stream.synchronize()
            replay2 = cp.asnumpy(out)
        finally:
            graph.close()
        plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr], True)  # the launches a capture records
        run.stream.synchronize()
        np.testing.assert_array_equal(replay2, cp.asnumpy(out))  # the same launches: bit-identical
        plan.run(run.stream.ptr, [x.data.ptr], [out.data.ptr])  # eager: mid-size GEMMs as generated kernels
        run.stream.synchronize()
        np.testing.assert_allclose(replay2, cp.asnumpy(out), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(replay2, reference(model, f2)[0], rtol=1e-4, atol=1e-4)
        assert plan.graph is not plan.eager  # this model has two variants: both were exercised
        assert not np.allclose(eager1, replay2)  # the replay read the new input


def test_auto_graph_keeps_run_semantics(cp):
    model = MODELS["mlp-8x256-b1"]()
    with build(model, auto_graph=True, warmup=2) as plan:
        run = Runner(cp, plan)
        results = []
        for k in range(6):
            feeds = feeds_for(model, 10 + k)
            results.append((feeds, run([feeds["input"]])[0]))
        assert plan.stats["captures"] == 1
        for feeds, out in results:  # every call's output stayed its own (fresh outputs)
            np.testing.assert_allclose(cp.asnumpy(out), reference(model, feeds)[0], rtol=1e-4, atol=1e-4)


def test_wrong_pointer_count_is_refused(cp):
    from plugin_cuda.plan.errors import PlanError

    with build(MODELS["mlp-3x64-b32"]()) as plan:
        s = cp.cuda.Stream(non_blocking=True)
        with pytest.raises(PlanError, match=r"^plan run got 2 inputs and 1 outputs; the plan has 1 inputs \(input\)"):
            plan.run(s.ptr, [0, 0], [0])


def test_closed_plan_refuses_to_run(cp):
    from plugin_cuda.plan.errors import PlanError

    plan = build(MODELS["mlp-3x64-b32"]())
    plan.close()
    plan.close()  # twice is fine
    with pytest.raises(PlanError, match=r"^plan is closed; build a new one$"):
        plan.run(cp.cuda.Stream(non_blocking=True).ptr, [0], [0])


# -- through a session (ABI v6 host) -------------------------------------------------------------------


def _plan_functions():
    import abi
    from abi import sdk

    eps = [o for o in sdk.runtime(f"_ephost_cuda_v{abi.ABI_VERSION}")._objects.values()
           if type(o).__name__ == "CudaEp"]
    return eps[-1].__dict__.get("plan_functions", []) if eps else []


@pytest.mark.parametrize("name", ["mlp-8x256-b1", "transformer"])
@pytest.mark.parametrize("auto_graph", ["0", "1"])
def test_session_plan_equals_per_node_path(cp, genv, name, auto_graph):
    from host.runtime.session import InferenceSession

    model = MODELS[name]()
    per_node = InferenceSession(model, providers=[(CUDA, {"use_tf32": "0", "compiled_plan": "0"})], env=genv)
    planned = InferenceSession(model, providers=[(CUDA, {"use_tf32": "0", "plan_auto_graph": auto_graph})],
                               env=genv)
    fns = _plan_functions()
    assert fns, "the v6 host compiled no partition"
    for k in range(4):  # past the auto-graph warm-up: replays must see each call's new input
        feeds = feeds_for(model, 20 + k)
        a = per_node.run(None, feeds)
        b = planned.run(None, feeds)
        for x, y in zip(a, b):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(b[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    if auto_graph == "1":
        assert sum(fn.plan.stats["captures"] for fn in fns) >= 1
