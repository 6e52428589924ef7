"""LSTM, GRU and RNN on the CUDA EP (plugin_cuda/kernels/rnn.py) against onnxruntime CPU: the attribute grid
of rnn_cases (directions, layouts, activations with alpha/beta, clip, sequence_lens, initial states,
peepholes, input_forget, linear_before_reset, absent outputs) in float32 and float16, CUDA-graph capture
and replay on new inputs, and torch.nn.LSTM / torch.nn.GRU exports (TorchScript exporter, opset 17)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import host
from tests.plugin_cuda.rnn_cases import CASES, Case, build, ort_outputs, reference

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
FP32 = {"use_tf32": "0"}


def _session(model, genv, **options):
    return host.InferenceSession(model.SerializeToString(), providers=[(CUDA, {**FP32, **options})], env=genv)


def _assert_on_cuda(s, *op_types):
    placed = {n.op_type: (n.ep.name if n.ep is not None else "CPU") for n in s.plan.nodes if n.op_type in op_types}
    assert placed and set(placed.values()) == {CUDA}, placed


def _compare(got: dict, want: dict, tol: float, what: str):
    assert sorted(got) == sorted(want), what
    errors = {name: float(np.abs(got[name].astype(np.float32) - ref).max()) if ref.size else 0.0
              for name, ref in want.items()}
    print(f"{what}: max abs error " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    for name, ref in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), ref, rtol=tol, atol=tol, err_msg=f"{what}: {name}")


def _run(s, feeds) -> dict:
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_float32_matches_onnxruntime(genv, case):
    model, feeds = build(case)
    s = _session(model, genv)
    _assert_on_cuda(s, case.op)
    _compare(_run(s, feeds), reference(case, feeds), 1e-4, case.id())


@pytest.mark.parametrize("case", [c for i, c in enumerate(CASES) if i % 4 == 0], ids=lambda c: c.id())
def test_float16_matches_onnxruntime_in_float32(genv, case):
    model, feeds = build(case, dtype=np.float16)
    s = _session(model, genv)
    _assert_on_cuda(s, case.op)
    got = _run(s, feeds)
    assert all(v.dtype == np.float16 for v in got.values())
    _compare(got, reference(case, feeds), 1e-2, case.id() + " fp16")


@pytest.mark.parametrize("case", [
    Case("LSTM", "bidirectional", 0, lens=(5, 2, 0), h0=True, c0=True, peephole=True, seed=50),
    Case("GRU", "bidirectional", 1, lens=(4, 5, 1), h0=True, seed=51),
    Case("RNN", "reverse", 0, seed=52),
], ids=lambda c: c.id())
def test_capture_and_replay_on_new_inputs(cp, genv, case):
    model, feeds = build(case)
    second = build(Case(**{**case.__dict__, "seed": case.seed + 100}))[1]
    g = _session(model, genv, enable_cuda_graph="1")
    want = reference(case, feeds)
    b = g.io_binding()
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = {k: cp.zeros(v.shape, v.dtype) for k, v in want.items()}
    for k, v in ins.items():
        b.bind_input(k, v)
    for k, v in outs.items():
        b.bind_output(k, v)
    cp.cuda.get_current_stream().synchronize()
    g.run_with_iobinding(b)
    assert g.fallbacks["graph_captured"] == 1, dict(g.fallbacks)
    _compare({k: cp.asnumpy(v) for k, v in outs.items()}, want, 1e-4, case.id() + " capture")
    for k, v in second.items():
        ins[k][...] = cp.asarray(v)
    cp.cuda.get_current_stream().synchronize()
    g.run_with_iobinding(b)
    _compare({k: cp.asnumpy(v) for k, v in outs.items()}, reference(case, second), 1e-4, case.id() + " replay")


# -- torch exports --------------------------------------------------------------------------------


def _export(torch, module, args, names):
    """Static shapes: the exporter's shape arithmetic (initial states built from x's shape) folds away, so
    every float node can be on the CUDA EP and the session can be captured."""
    f = io.BytesIO()
    torch.onnx.export(module, args, f, input_names=names[0], output_names=names[1], opset_version=17, dynamo=False)
    import onnx

    return onnx.load_from_string(f.getvalue())


def _torch_models(torch):
    torch.manual_seed(0)

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)

        def forward(self, x, h0, c0):
            y, (h, c) = self.rnn(x, (h0, c0))
            return y, h, c

    class Gru(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(8, 10, num_layers=2, bidirectional=True, batch_first=True)

        def forward(self, x):
            return self.rnn(x)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 8)).astype(np.float32)
    lstm_feeds = {"x": x, "h0": rng.standard_normal((4, 3, 12)).astype(np.float32),
                  "c0": rng.standard_normal((4, 3, 12)).astype(np.float32)}
    lstm = _export(torch, Lstm().eval(), tuple(torch.from_numpy(v) for v in lstm_feeds.values()),
                   (["x", "h0", "c0"], ["y", "h", "c"]))
    gru = _export(torch, Gru().eval(), (torch.from_numpy(x),), (["x"], ["y", "h"]))
    return {"LSTM": (lstm, lstm_feeds), "GRU": (gru, {"x": x})}


@pytest.fixture(scope="module")
def torch_models():
    torch = pytest.importorskip("torch", reason="the export tests need torch.onnx (TorchScript exporter)")
    return _torch_models(torch)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_torch_export_runs_on_cuda_and_captures(cp, genv, torch_models, op):
    model, feeds = torch_models[op]
    want = ort_outputs(model, feeds)
    s = _session(model, genv)
    _assert_on_cuda(s, op)
    layers = [n.name for n in s.plan.nodes if n.op_type == op]
    assert len(layers) == 2 and all(s.node_assignment()[name] == CUDA for name in layers)  # two layers, on CUDA
    off = sorted(f"{k}" for k, v in s.node_assignment().items() if v != CUDA)
    print(f"torch {op}: {len(s.plan.nodes)} nodes, off the CUDA EP: {off}")
    _compare(_run(s, feeds), want, 1e-4, f"torch {op}")
    g = _session(model, genv, enable_cuda_graph="1")
    b = g.io_binding()
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = {k: cp.zeros(v.shape, v.dtype) for k, v in want.items()}
    for k, v in ins.items():
        b.bind_input(k, v)
    for k, v in outs.items():
        b.bind_output(k, v)
    cp.cuda.get_current_stream().synchronize()
    g.run_with_iobinding(b)
    g.run_with_iobinding(b)
    assert g.fallbacks["graph_captured"] == 1, dict(g.fallbacks)
    _compare({k: cp.asnumpy(v) for k, v in outs.items()}, want, 1e-4, f"torch {op} replay")
