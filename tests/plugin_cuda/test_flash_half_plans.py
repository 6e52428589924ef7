"""Flash attention inside float16 / bfloat16 compiled plans on a GPU (the CPU side is
tests/plugin_cuda/test_flash_half_plans_cpu.py).

BERT-like (3-D Attention, padding mask in the half type, post-norm) and Llama-like (RMSNorm, GQA 8:2,
causal) attention blocks (tests/plugin_cuda/flash_half_models.py) in float16 and bfloat16, at odd
sequence lengths (50, 77):
- plans built directly with attention_kernel=flash and =gemm: the flash plan has its fused step (on
  tensor cores from sm_80 on), and both match onnxruntime CPU on the float32 model fed the same
  half-rounded inputs, within 2e-2 of the largest output (test_half_plans' tolerance), and each other;
- sessions (compiled_plan=1, attention_kernel=flash, enable_cuda_graph=1) through IOBinding: the
  captured run, then a replay on new inputs;
- a dynamic-shape (batch, sequence) plan at two shapes.

Each test appends one line per case to $HALF_PLANS_REPORT when set (gpu_smoke.sh prints them).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.plan import flash_step
from tests.plugin_cuda.flash_half_models import bert_block, block_feeds, llama_block
from tests.plugin_cuda.half_models import HALVES, retyped
from tests.plugin_cuda.test_half_plans import TOL, half_dtype, relative_error, report, rounded, run_plan

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
PRECISIONS = list(HALVES)
OPTIONS = {"attention_kernel": "flash", "use_tf32": "0", "compiled_plan": "1"}


def models(block: str, batch, seq) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(the float32 model ephost runs in half, the float32 model onnxruntime runs): onnxruntime's
    Attention wants a mask with Sq rows, so its BERT block takes the padding mask broadcast to (B, 1, S, S)."""
    if block == "llama":
        return llama_block(batch, seq), llama_block(batch, seq)
    return bert_block(batch, seq), bert_block(batch, seq, mask_shape=(batch, 1, seq, seq))


def ort_reference(model32: onnx.ModelProto, as_float: dict) -> np.ndarray:
    import onnxruntime

    feeds = dict(as_float)
    if "M" in feeds:  # the half-rounded padding mask, broadcast to the reference model's shape
        shape = [d.dim_value for d in model32.graph.input[1].type.tensor_type.shape.dim]
        feeds["M"] = np.ascontiguousarray(np.broadcast_to(feeds["M"], shape))
    try:
        session = onnxruntime.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - an onnxruntime without Attention-23 / RMSNormalization-23
        from onnx.reference import ReferenceEvaluator

        report(f"flash-half reference: onnxruntime {onnxruntime.__version__} refused the model "
               f"({str(exc)[:120]}); onnx.reference instead")
        return ReferenceEvaluator(model32).run(None, feeds)[0]
    return session.run(None, feeds)[0]


def tensor_cores(cp) -> bool:
    return int(cp.cuda.Device().compute_capability) >= 80


CASES = [("bert", 50), ("llama", 77)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block,seq", CASES)
def test_plan_flash_matches_gemm_and_onnxruntime(cp, block, seq, precision):
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan

    dtype = half_dtype(precision)
    model, model_ort = models(block, 2, seq)
    half, as_float = rounded(block_feeds(model), dtype)
    want = ort_reference(model_ort, as_float)
    got = {}
    for choice, kind in (("flash", "flash_attention"), ("gemm", "bgemm")):
        with flash.kernel_choice(choice), Plan.build(spec_from_onnx(retyped(model, HALVES[precision])),
                                                     use_tf32=False) as plan:
            steps = [s for s in plan.steps if s.kind == kind]
            assert steps, f"{block} {precision} {choice}: steps {sorted({s.kind for s in plan.steps})}"
            if kind == "flash_attention":
                assert all(s.op.attrs["mma"] == tensor_cores(cp) for s in steps)
            (got[choice],) = run_plan(cp, plan, [half[n] for n in plan.input_names])
        assert got[choice].dtype == dtype
    errors = {c: relative_error(g.astype(np.float32), want) for c, g in got.items()}
    between = relative_error(got["flash"].astype(np.float32), got["gemm"].astype(np.float32))
    report(f"flash-half plan {block} S={seq} {precision}: vs onnxruntime flash {errors['flash']:.2e} "
           f"gemm {errors['gemm']:.2e}; flash vs gemm {between:.2e}")
    assert max(errors.values()) <= TOL and between <= TOL, (errors, between)


@pytest.fixture
def generated(monkeypatch):
    """The flash steps generated while the test runs: (element type of Q, on tensor cores)."""
    seen = []
    original = flash_step.kernel

    def spy(prog, step, name):
        seen.append((str(prog.values[step.op.inputs[0]].dtype), bool(step.op.attrs.get("mma"))))
        return original(prog, step, name)

    monkeypatch.setattr(flash_step, "kernel", spy)
    return seen


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block,seq", [("bert", 77), ("llama", 50)])
def test_session_captures_and_replays_half_flash(cp, genv, generated, block, seq, precision):
    from host.runtime.session import InferenceSession

    dtype = half_dtype(precision)
    model, model_ort = models(block, 2, seq)
    session = InferenceSession(retyped(model, HALVES[precision]).SerializeToString(),
                               providers=[(CUDA, {**OPTIONS, "enable_cuda_graph": "1"})], env=genv)
    binding = session.io_binding()
    ins = out = None
    errors = []
    for seed in (0, 7):  # the first run captures, the second replays on new inputs
        half, as_float = rounded(block_feeds(model, seed), dtype)
        if ins is None:
            ins = {k: cp.asarray(v) for k, v in half.items()}
            out = cp.zeros(half["X"].shape, dtype)
            for k, arr in ins.items():
                binding.bind_input(k, arr)
            binding.bind_output("Y", out)
        else:
            for k, v in half.items():
                ins[k][...] = cp.asarray(v)
        cp.cuda.get_current_stream().synchronize()
        session.run_with_iobinding(binding)
        cp.cuda.get_current_stream().synchronize()
        errors.append(relative_error(cp.asnumpy(out).astype(np.float32), ort_reference(model_ort, as_float)))
    captured = session.fallbacks["graph_captured"]
    session.close()
    report(f"flash-half session {block} S={seq} {precision}: flash steps {generated}, captured {captured}, "
           f"error (capture run, replay) {errors[0]:.2e} {errors[1]:.2e}")
    assert (str(dtype), tensor_cores(cp)) in generated, generated
    assert captured == 1, "the session was not captured"
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block", ["bert", "llama"])
def test_dynamic_half_plan_with_flash_at_two_shapes(cp, genv, generated, block, precision):
    from host.runtime.session import InferenceSession

    dtype = half_dtype(precision)
    model, _ = models(block, "B", "S")
    session = InferenceSession(retyped(model, HALVES[precision]).SerializeToString(), providers=[(CUDA, OPTIONS)],
                               env=genv)
    errors = []
    for batch, seq in ((2, 50), (3, 77)):
        static, model_ort = models(block, batch, seq)  # the same weights (same seed), the shapes' inputs
        half, as_float = rounded(block_feeds(static, seed=batch), dtype)
        (got,) = session.run(None, half)
        assert got.dtype == dtype and got.shape == half["X"].shape
        errors.append(relative_error(got.astype(np.float32), ort_reference(model_ort, as_float)))
    session.close()
    report(f"flash-half dynamic {block} {precision}: flash steps {generated}, error at (2, 50) {errors[0]:.2e}, "
           f"(3, 77) {errors[1]:.2e}")
    assert generated and all(g == (str(dtype), tensor_cores(cp)) for g in generated), generated
    assert max(errors) <= TOL, errors
