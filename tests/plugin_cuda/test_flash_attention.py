"""The fused (flash) attention kernel on a GPU, against torch.nn.functional.scaled_dot_product_attention
(float32 math on the same rounded inputs, the mask and causal frontier given as one additive bias)
and against the plugin's two-GEMM path: float32, float16, bfloat16; bool and additive masks
(broadcast, shorter than the keys), causal with Sq != Skv, GQA, the 3-D form, every head size, odd
lengths; CUDA-graph capture and replay; per node in a session and inside a compiled plan."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from abi.dtypes import BFLOAT16_DTYPE
from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.kernels.attention import attention_plan, launch_attention

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16_DTYPE}
# Max abs error allowed per output dtype (outputs are averages of unit normals: O(1)); float32 sums
# in another order, the half types round the output once (and the two-GEMM path rounds P too);
# TF32 rounds both products' operands to 10 mantissa bits.
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "tf32": 6e-3}

# name -> (Q, K, V shapes, mask shape or None, mask kind 'bool' | 'float' | None, attributes)
CASES = {
    "4d-plain": ((2, 3, 70, 64), (2, 3, 70, 64), (2, 3, 70, 64), None, None, {}),
    "4d-causal-sq<skv": ((1, 2, 37, 64), (1, 2, 101, 64), (1, 2, 101, 64), None, None, {"is_causal": 1}),
    "4d-causal-sq>skv": ((1, 2, 90, 32), (1, 2, 41, 32), (1, 2, 41, 32), None, None, {"is_causal": 1}),
    "4d-gqa-bcast-mask": ((2, 8, 50, 128), (2, 2, 77, 128), (2, 2, 77, 128), (2, 1, 1, 77), "float", {}),
    "4d-bool-mask": ((1, 4, 33, 32), (1, 4, 65, 32), (1, 4, 65, 32), (1, 4, 33, 65), "bool", {}),
    "3d-gqa-causal": ((2, 45, 6 * 80), (2, 45, 2 * 80), (2, 45, 2 * 80), None, None,
                      {"is_causal": 1, "q_num_heads": 6, "kv_num_heads": 2}),
    "3d-padded-mask": ((1, 19, 2 * 96), (1, 130, 2 * 96), (1, 130, 2 * 96), (19, 100), "float",
                       {"q_num_heads": 2, "kv_num_heads": 2}),
    "4d-d96-scale-causal-mask": ((1, 2, 64, 96), (1, 2, 64, 96), (1, 2, 64, 96), (1, 2, 64, 64), "float",
                                 {"scale": 0.3, "is_causal": 1}),
    "4d-long-odd": ((1, 2, 301, 64), (1, 2, 1031, 64), (1, 2, 1031, 64), (1, 1, 301, 1031), "float", {}),
}


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="torch is the reference for the fused attention kernel")


def inputs(case: str, dtype_name: str, seed: int = 0) -> dict:
    """Host arrays (rounded to the dtype, kept as float32 for the reference) and the mask."""
    q, k, v, mshape, mkind, attrs = CASES[case]
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype_name]
    out = {n: rng.standard_normal(s).astype(np.float32).astype(dt) for n, s in (("Q", q), ("K", k), ("V", v))}
    if mkind == "bool":
        m = rng.random(mshape) > 0.3
        m[..., 0] = True  # every row keeps a key
        out["M"] = m
    elif mkind == "float":
        m = rng.uniform(-2, 1, mshape).astype(np.float32)
        m[..., 1] = -np.inf
        out["M"] = m.astype(dt)
    return out


def heads(shape, n):
    """(B, H, S, D) view of a 3-D (B, S, H * D) array."""
    return shape if len(shape) == 4 else (shape[0], n, shape[1], shape[2] // n)


def bias_for(case: str, feeds: dict, q4, k4) -> np.ndarray:
    """The additive bias (B or 1, H or 1, Sq, Skv) the ONNX op applies: mask (padded with -inf to
    Skv keys) plus the causal frontier j <= i."""
    _, _, _, _, mkind, attrs = CASES[case]
    sq, skv = q4[2], k4[2]
    bias = np.zeros((1, 1, sq, skv), np.float32)
    if mkind is not None:
        m = feeds["M"]
        m = np.where(m, 0.0, -np.inf).astype(np.float32) if m.dtype == np.bool_ else m.astype(np.float32)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        pad = np.full(m.shape[:3] + (skv - m.shape[3],), -np.inf, np.float32)
        bias = bias + np.concatenate([m, pad], axis=3)
    if attrs.get("is_causal"):
        bias = bias + np.where(np.tril(np.ones((sq, skv), bool)), 0.0, -np.inf).astype(np.float32)
    return bias


def torch_reference(torch, case: str, feeds: dict) -> np.ndarray:
    q, k, v, _, _, attrs = CASES[case]
    q4, k4 = heads(q, attrs.get("q_num_heads")), heads(k, attrs.get("kv_num_heads"))
    t = {n: torch.from_numpy(feeds[n].astype(np.float32)).cuda() for n in "QKV"}
    if len(q) == 3:  # (B, S, H * D) -> (B, H, S, D)
        t = {n: x.reshape(x.shape[0], x.shape[1], (q4 if n == "Q" else k4)[1], -1).transpose(1, 2)
             for n, x in t.items()}
    group = q4[1] // k4[1]
    kk, vv = (t[n].repeat_interleave(group, dim=1) for n in "KV")
    bias = torch.from_numpy(np.broadcast_to(bias_for(case, feeds, q4, k4), (q4[0], q4[1], q4[2], k4[2])).copy()).cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # plain float32 GEMMs and softmax (TF32 is off by default)
        y = torch.nn.functional.scaled_dot_product_attention(t["Q"], kk, vv, attn_mask=bias,
                                                             scale=attrs.get("scale"))
    if len(q) == 3:
        y = y.transpose(1, 2).reshape(q[0], q[1], -1)
    return y.cpu().numpy()


def plan_for(case: str, feeds: dict, dtype):
    q, k, v, _, _, a = CASES[case]
    m = feeds.get("M")
    return attention_plan(q, k, v, None if m is None else m.shape, None if m is None else m.dtype, a.get("q_num_heads"),
                          a.get("kv_num_heads"), a.get("is_causal", 0), a.get("scale"), a.get("softcap", 0.0), dtype)


def run_flash(cp, plan, dev: dict, y, mma=None) -> None:
    m = dev.get("M")
    flash.launch_flash(plan, dev["Q"].data.ptr, dev["K"].data.ptr, dev["V"].data.ptr, 0 if m is None else m.data.ptr,
                       y.data.ptr, mma)


def run_gemm(cp, plan, dev: dict, y) -> None:
    from plugin_cuda.device.cublas import CublasHandle

    handle = CublasHandle(cp.cuda.get_current_stream().ptr, use_tf32=False)
    work = cp.empty((plan.workspace_bytes,), np.uint8)
    m = dev.get("M")
    launch_attention(handle, plan, dev["Q"].data.ptr, dev["K"].data.ptr, dev["V"].data.ptr,
                     0 if m is None else m.data.ptr, y.data.ptr, work.data.ptr)
    cp.cuda.get_current_stream().synchronize()
    handle.close()


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), f"{what}: NaN in the output"
    err = float(np.abs(got - want).max())
    print(f"{what}: max abs error {err:.2e} (allowed {tol:.1e})")
    assert err <= tol, f"{what}: max abs error {err} > {tol}"


# dtype and kernel: the SIMT kernel for every dtype, the tensor-core ones (TF32 for float32)
VARIANTS = ["float32-simt", "float32-mma", "float16-simt", "float16-mma", "bfloat16-simt", "bfloat16-mma"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_matches_torch_sdpa_and_the_gemm_path(cp, torch, case, variant):
    dtype, kernel = variant.split("-")
    feeds = inputs(case, dtype)
    dev = {n: cp.asarray(x) for n, x in feeds.items()}
    plan = plan_for(case, feeds, DTYPES[dtype])
    assert flash.fits(plan)
    y = cp.full(plan.out_shape, np.nan, DTYPES[dtype])
    run_flash(cp, plan, dev, y, kernel == "mma")
    got = cp.asnumpy(y).astype(np.float32)
    tol = TOL["tf32" if variant == "float32-mma" else dtype]
    assert_close(got, torch_reference(torch, case, feeds), tol, f"{case} {variant} flash vs torch SDPA")
    y2 = cp.full(plan.out_shape, np.nan, DTYPES[dtype])
    run_gemm(cp, plan, dev, y2)
    assert_close(got, cp.asnumpy(y2).astype(np.float32), 2 * tol, f"{case} {variant} flash vs two-GEMM")


@pytest.mark.parametrize("head", [32, 64, 80, 96, 128])
def test_every_head_size_with_softcap_against_the_gemm_path(cp, head):
    """softcap (no torch counterpart): the two-GEMM path is the reference."""
    rng = np.random.default_rng(head)
    shapes = ((2, 4, 45, head), (2, 2, 83, head), (2, 2, 83, head))
    dev = [cp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    plan = attention_plan(*shapes, None, None, None, None, 1, None, 2.5, np.float32)
    ys = [cp.full(plan.out_shape, np.nan, np.float32) for _ in range(2)]
    named = dict(zip("QKV", dev))
    run_flash(cp, plan, named, ys[0])
    run_gemm(cp, plan, named, ys[1])
    assert_close(cp.asnumpy(ys[0]), cp.asnumpy(ys[1]), 2e-5, f"head {head} softcap")


def test_fully_masked_rows_give_zeros(cp):
    feeds = inputs("4d-bool-mask", "float32")
    feeds["M"][0, 1, 5, :] = False
    dev = {n: cp.asarray(x) for n, x in feeds.items()}
    plan = plan_for("4d-bool-mask", feeds, np.float32)
    y = cp.full(plan.out_shape, np.nan, np.float32)
    run_flash(cp, plan, dev, y)
    got = cp.asnumpy(y)
    assert np.all(got[0, 1, 5] == 0) and not np.isnan(got).any()


def test_half_types_take_the_tensor_cores(cp):
    capability = int(cp.cuda.Device().compute_capability)
    plan = plan_for("4d-plain", inputs("4d-plain", "float16"), np.float16)
    assert flash.tensor_cores(plan) == (capability >= 80)
    f32 = plan_for("4d-plain", inputs("4d-plain", "float32"), np.float32)
    assert not flash.tensor_cores(f32) and flash.tensor_cores(f32, tf32=True) == (capability >= 80)


def test_capture_and_replay(cp, torch):
    case, dtype = "3d-gqa-causal", "float16"
    feeds = inputs(case, dtype)
    dev = {n: cp.asarray(x) for n, x in feeds.items()}
    plan = plan_for(case, feeds, DTYPES[dtype])
    y = cp.zeros(plan.out_shape, DTYPES[dtype])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run_flash(cp, plan, dev, y)  # compiles and loads the module before the capture
        stream.synchronize()
        stream.begin_capture()
        run_flash(cp, plan, dev, y)
        graph = stream.end_capture()
    new = inputs(case, dtype, seed=5)
    for n in "QKV":
        dev[n][...] = cp.asarray(new[n])
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    assert_close(cp.asnumpy(y), torch_reference(torch, case, new), TOL[dtype], "replay on new inputs")


# ---- in sessions: per node and in a compiled plan -------------------------------------------------

def attention_block(batch=2, seq=160, hidden=256, heads=4, causal=1, seed=0):
    """A pre-norm attention block with an Attention-23 node in its 3-D form: x + Wo(Attn(LN(x)));
    batch and seq may be dim names (dynamic)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32), n)
             for n in ("Wq", "Wk", "Wv", "Wo")]
    inits += [numpy_helper.from_array(np.ones(hidden, np.float32), "g"),
              numpy_helper.from_array(np.zeros(hidden, np.float32), "b")]
    nodes = [helper.make_node("LayerNormalization", ["X", "g", "b"], ["N"], axis=-1),
             *(helper.make_node("MatMul", ["N", f"W{n}"], [n.upper()]) for n in "qkv"),
             helper.make_node("Attention", ["Q", "K", "V"], ["A"], q_num_heads=heads, kv_num_heads=heads,
                              is_causal=causal),
             helper.make_node("MatMul", ["A", "Wo"], ["O"]),
             helper.make_node("Add", ["X", "O"], ["Y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                             [batch, seq, hidden])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, seq, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def onnx_reference(model, feeds):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)[0]


def test_plan_with_flash_step_matches_onnx_reference(cp):
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan

    model = attention_block()
    x = np.random.default_rng(1).standard_normal((2, 160, 256)).astype(np.float32)
    want = onnx_reference(model, {"X": x})
    for choice, kind, tf32 in (("flash", "flash_attention", False), ("gemm", "bgemm", False),
                               ("flash", "flash_attention", True)):
        with flash.kernel_choice(choice), Plan.build(spec_from_onnx(model), use_tf32=tf32) as plan:
            steps = [s for s in plan.steps if s.kind == kind]
            assert steps and all(bool(s.op.attrs.get("tf32")) == tf32 for s in steps if kind == "flash_attention")
            stream = cp.cuda.Stream(non_blocking=True)
            xd, yd = cp.asarray(x), cp.full((2, 160, 256), np.nan, np.float32)
            cp.cuda.Device().synchronize()
            plan.run(stream.ptr, [xd.data.ptr], [yd.data.ptr])
            stream.synchronize()
            # TF32 (in the projections' GEMMs too): errors of a few 1e-3 on outputs of O(1)
            assert_close(cp.asnumpy(yd), want, 2e-2 if tf32 else 1e-4, f"plan ({choice}, tf32={tf32})")


@pytest.mark.parametrize("compiled_plan", ["0", "1"])
def test_session_capture_replay_with_flash(cp, genv, compiled_plan, monkeypatch):
    """attention_kernel=flash in a session (per node, or the compiled plan), CUDA graph replay on new data."""
    from host.runtime.session import InferenceSession

    calls = []
    original = flash.launch_flash
    monkeypatch.setattr(flash, "launch_flash", lambda *a, **kw: (calls.append(1), original(*a, **kw)))
    model = attention_block(seed=3)
    opts = {"attention_kernel": "flash", "use_tf32": "0", "enable_cuda_graph": "1", "compiled_plan": compiled_plan}
    s = InferenceSession(model, providers=[(CUDA, opts)], env=genv)
    assert set(s.node_assignment().values()) == {CUDA}
    rng = np.random.default_rng(2)
    xd = cp.asarray(rng.standard_normal((2, 160, 256)).astype(np.float32))
    yd = cp.zeros((2, 160, 256), np.float32)
    b = s.io_binding()
    b.bind_input("X", xd)
    b.bind_output("Y", yd)
    cp.cuda.get_current_stream().synchronize()
    s.run_with_iobinding(b)  # warm-up runs + capture
    assert_close(cp.asnumpy(yd), onnx_reference(model, {"X": cp.asnumpy(xd)}), 1e-4, "session first run")
    if compiled_plan == "0":
        assert calls, "the per-node Attention kernel did not take the fused kernel"
    new = rng.standard_normal((2, 160, 256)).astype(np.float32)
    xd[...] = cp.asarray(new)
    cp.cuda.get_current_stream().synchronize()
    s.run_with_iobinding(b)  # replay
    assert_close(cp.asnumpy(yd), onnx_reference(model, {"X": new}), 1e-4, "session replay")
    s.close()


def test_dynamic_shapes_plan_with_flash(cp, genv):
    """Dynamic batch and sequence: the compiled plans of two signatures share the flash step's source
    (sizes as kernel arguments) and both match the reference."""
    from host.runtime.session import InferenceSession

    model = attention_block(batch="B", seq="S", seed=4)
    opts = {"attention_kernel": "flash", "use_tf32": "0", "compiled_plan": "1"}
    s = InferenceSession(model, providers=[(CUDA, opts)], env=genv)
    rng = np.random.default_rng(6)
    for shape in ((2, 100, 256), (3, 77, 256)):
        x = rng.standard_normal(shape).astype(np.float32)
        (got,) = s.run(None, {"X": x})
        assert_close(got, onnx_reference(model, {"X": x}), 1e-4, f"dynamic {shape}")
    s.close()


@pytest.mark.parametrize("dtype,seq,tf32", [("float16", 128, "1"), ("float32", 1024, "1"), ("float32", 1024, "0")])
def test_auto_takes_flash_per_node(cp, genv, torch, monkeypatch, dtype, seq, tf32):
    """attention_kernel=auto (the default) in a per-node session: float16 at 128 keys, float32 at 1024
    (TF32 under use_tf32=1, exact SIMT under 0) run on the fused kernel and match torch's SDPA."""
    from host.runtime.session import InferenceSession

    shape = (1, 4, seq, 64)
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    names = ("Q", "K", "V")
    graph = helper.make_graph([helper.make_node("Attention", list(names), ["Y"], is_causal=1)], "attn",
                              [helper.make_tensor_value_info(n, elem, list(shape)) for n in names],
                              [helper.make_tensor_value_info("Y", elem, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    s = InferenceSession(model, providers=[(CUDA, {"compiled_plan": "0", "use_tf32": tf32})], env=genv)
    # Counted from here: the kernel's warm-up at session creation (plugin_cuda/kernel_warmup.py) ran it once.
    calls = []
    original = flash.launch_flash
    monkeypatch.setattr(flash, "launch_flash", lambda *a, **kw: (calls.append(kw.get("tf32")), original(*a, **kw)))
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal(shape).astype(dtype) for n in names}
    (got,) = s.run(None, feeds)
    s.close()
    assert calls == [tf32 == "1"], "auto did not take the fused kernel (or not with this use_tf32)"
    t = {n: torch.from_numpy(feeds[n].astype(np.float32)).cuda() for n in names}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(t["Q"], t["K"], t["V"], is_causal=True).cpu().numpy()
    tol = TOL["tf32"] if dtype == "float32" and tf32 == "1" else TOL[dtype]
    assert_close(got, want, tol, f"auto per node {dtype} S={seq} use_tf32={tf32}")
