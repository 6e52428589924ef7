"""The CUDA EP's recurrent layers without a GPU: plugin_cuda.kernels.rnn's step logic (projection GEMM,
biases, state layouts, per-step GEMMs, the order of gate launches, Y_h zeroing) run with NumPy and a NumPy
twin of the gate kernels (same index arithmetic as rnn_cells' CUDA: time index per direction and length,
Y position per layout), against onnxruntime CPU. The CUDA source itself is compiled and run by
test_rnn_gpu.py; here it is only checked to be generated for every case."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from plugin_cuda.kernels import claimable
from plugin_cuda.kernels.rnn import GRU, LSTM, RNN, Weights
from plugin_cuda.kernels.rnn_cells import CELL_KINDS
from plugin_cuda.semantics.errors import OpError
from tests.plugin_cuda.rnn_cases import CASES, build, reference

KERNELS = {"RNN": RNN, "GRU": GRU, "LSTM": LSTM}

_NP_ACTS = {
    "relu": lambda x, a, b: np.maximum(x, 0),
    "tanh": lambda x, a, b: np.tanh(x),
    "sigmoid": lambda x, a, b: 1 / (1 + np.exp(-x)),
    "affine": lambda x, a, b: a * x + b,
    "leakyrelu": lambda x, a, b: np.where(x < 0, a * x, x),
    "thresholdedrelu": lambda x, a, b: np.where(x > a, x, 0),
    "scaledtanh": lambda x, a, b: a * np.tanh(b * x),
    "hardsigmoid": lambda x, a, b: np.clip(a * x + b, 0, 1),
    "elu": lambda x, a, b: np.where(x < 0, a * np.expm1(x), x),
    "softsign": lambda x, a, b: x / (1 + np.abs(x)),
    "softplus": lambda x, a, b: np.logaddexp(0, x),
}


def numpy_launcher(kernel):
    """The gate kernels of rnn_cells in NumPy, over the same (direction, batch, unit) index grid."""
    gates = CELL_KINDS[kernel.recurrence.kind][0]
    clip = kernel.clip

    def act(k, v):
        fns = kernel.acts[k]
        return np.stack([_NP_ACTS[fns[min(d, len(fns) - 1)].name](v[d], fns[min(d, len(fns) - 1)].alpha,
                                                                  fns[min(d, len(fns) - 1)].beta)
                         for d in range(v.shape[0])])

    def clipped(v):
        return v if clip is None else np.clip(v, -clip, clip)

    def launch(name, buf, t, hr):
        s, batch, hidden, dirs, layout, rev_mask = buf.dims
        d = np.arange(dirs)[:, None, None]
        b = np.arange(batch)[None, :, None]
        j = np.arange(hidden)[None, None, :]
        length = np.full(batch, s) if buf.lens is None else buf.lens
        length = length[b]
        valid = np.broadcast_to(t < length, (dirs, batch, hidden))
        tt = np.where((t < length) & (((rev_mask >> d) & 1) == 1), length - 1 - t, t)
        xrow = b * s + tt if layout else tt * batch + b

        def xg(g):
            return buf.xw[xrow, d * gates * hidden + g * hidden + j] + buf.bias[d, g * hidden + j]

        def hrg(g):
            return hr[:, :, g * hidden:(g + 1) * hidden]

        h = buf.h
        if name == "gru_zr":
            buf.z[...] = act(0, clipped(xg(0) + hrg(0)))
            buf.rh[...] = np.where(valid, act(0, clipped(xg(1) + hrg(1))) * h, 0)
            return
        if name == "rnn":
            hn = act(0, clipped(xg(0) + hrg(0)))
        elif name == "gru_h":
            hh = act(1, clipped(xg(2) + hrg(0)))
            hn = (1 - buf.z) * hh + buf.z * h
        elif name == "gru_lbr":
            z, r = act(0, clipped(xg(0) + hrg(0))), act(0, clipped(xg(1) + hrg(1)))
            rec = hrg(2) + (0 if buf.extra is None else buf.extra[:, None, :])
            hh = act(1, clipped(xg(2) + r * rec))
            hn = (1 - z) * hh + z * h
        else:
            hn = _lstm_cell(buf, xg, hrg, act, clipped, kernel, valid)
        h[...] = np.where(valid, hn, h)
        if buf.y is not None:
            yt = np.broadcast_to(tt, valid.shape)
            bb, dd, jj = np.broadcast_to(b, valid.shape), np.broadcast_to(d, valid.shape), np.broadcast_to(j, valid.shape)
            index = (bb, yt, dd, jj) if layout else (yt, dd, bb, jj)
            buf.y[index] = np.where(valid, hn, 0)

    return launch


def _lstm_cell(buf, xg, hrg, act, clipped, kernel, valid):
    hidden = buf.h.shape[2]
    cp = buf.c.copy()
    gi, go, gf, gc = (xg(g) + hrg(g) for g in range(4))
    p = None if buf.extra is None else buf.extra[:, None, :]
    if p is not None:
        gi = gi + p[..., :hidden] * cp
        gf = gf + p[..., 2 * hidden:] * cp
    i = act(0, clipped(gi))
    f = 1 - i if kernel._input_forget() else act(0, clipped(gf))
    cn = f * cp + i * act(1, clipped(gc))
    if p is not None:
        go = go + p[..., hidden: 2 * hidden] * cn
    buf.c[...] = np.where(valid, cn, cp)
    return act(0, clipped(go)) * act(2, cn)


def run_numpy(case, model, feeds) -> dict:
    node = model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kernel = KERNELS[case.op](attrs, 14, "n")
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    a = Weights(*(feeds.get(n) for n in names))
    want = [bool(n) for n in node.output] + [False] * 3
    y, h, c = kernel.recurrence.run(np, lambda p, q, out: np.matmul(p, q.T, out=out),
                                    lambda p, q, out: np.matmul(p, q, out=out), numpy_launcher(kernel), a, want[0])
    got = {"Y": y, "Y_h": kernel.recurrence.final_state(np, h, a.lens)}
    if c is not None:
        got["Y_c"] = kernel.recurrence.final_state(np, c, a.lens)
    return {n: got[n] for n in node.output if n}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_step_logic_with_numpy_matches_onnxruntime(case):
    model, feeds = build(case)
    want = reference(case, feeds)
    got = run_numpy(case, model, feeds)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=f"{case.id()}: {name}")


def test_claims_float_inputs_and_int32_lengths_only():
    f, h, i32, i64 = 1, 10, 6, 7
    assert claimable("LSTM", {"hidden_size": 4}, [f, f, f, f, i32, f, f, f], 14, num_outputs=3)
    assert claimable("GRU", {"hidden_size": 4}, [h, h, h], 14, num_outputs=2)
    assert not claimable("GRU", {}, [f, f, f, None, i64], 14)  # sequence_lens is int32 in ONNX
    assert not claimable("LSTM", {}, [f, h, f], 14)  # one float type for every float input
    assert not claimable("RNN", {}, [f, f, f], 14, num_outputs=3)  # RNN has two outputs
    assert not claimable("LSTM", {"direction": "sideways"}, [f, f, f], 14)


@pytest.mark.parametrize("attrs,message", [
    ({"direction": "sideways"}, "^RNN node 'n': attribute 'direction' is 'sideways'; allowed: 'forward', 'reverse', "
                                "'bidirectional'$"),
    ({"activations": ["Tanh", "Tanh"]}, r"^RNN node 'n': attribute 'activations' is \['Tanh', 'Tanh'\]; allowed: a "
                                        r"list of 1 names \(1 per direction, 1 direction\(s\)\)$"),
    ({"activations": ["Swish"]}, r"^RNN node 'n': attribute 'activations' is \['Swish'\]; allowed: names among Relu, "),
    ({"clip": -1.0}, "^RNN node 'n': attribute 'clip' is -1.0; allowed: a float > 0$"),
    ({"layout": 2}, "^RNN node 'n': attribute 'layout' is 2; allowed: 0 or 1$"),
])
def test_bad_attributes_are_refused_with_what_is_allowed(attrs, message):
    with pytest.raises(OpError, match=message):
        RNN(attrs, 14, "n")


def test_wrong_weight_shape_names_the_input_and_the_expected_shape():
    kernel = GRU({"hidden_size": 4}, 14, "n")
    x, w, r = np.zeros((2, 1, 3), np.float32), np.zeros((1, 12, 5), np.float32), np.zeros((1, 12, 4), np.float32)
    with pytest.raises(ValueError, match=r"^W must have shape \(1, 12, 3\) \(1 direction\(s\), hidden_size 4, 3 "
                                         r"gate\(s\)\), got \(1, 12, 5\)$"):
        kernel.recurrence.run(np, None, None, None, Weights(x, w, r), True)


class _Ctx:
    """The KernelCall surface a kernel uses (inputs, wants, output), in host memory."""

    def __init__(self, inputs, names):
        self.inputs, self.names, self.outs, self.cublas = inputs, names, {}, None

    def wants(self, index):
        return index < len(self.names) and bool(self.names[index])

    def output(self, index, shape, dtype):
        self.outs[index] = np.full(shape, np.nan, dtype)
        return self.outs[index]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", CASES[::5], ids=lambda c: c.id())
def test_compute_wires_inputs_outputs_and_dtypes(monkeypatch, case, dtype):
    """The kernel's _compute (float32 casts, absent inputs and outputs, Y_h/Y_c layout, casts back) with NumPy
    standing in for CuPy, cuBLAS and the gate kernels: only the device calls are replaced."""
    import types

    import plugin_cuda.kernels.rnn as rnn

    fake = types.SimpleNamespace(ascontiguousarray=np.ascontiguousarray, copyto=np.copyto, empty=np.empty,
                                 zeros=np.zeros, array=np.array,
                                 cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    model, feeds = build(case, dtype=dtype)
    node = model.graph.node[0]
    kernel = KERNELS[case.op]({a.name: helper.get_attribute_value(a) for a in node.attribute}, 14, "n")
    monkeypatch.setattr(rnn, "cupy", fake)
    monkeypatch.setattr(rnn, "nvrtc", types.SimpleNamespace(load=lambda *args: None))
    monkeypatch.setattr(rnn, "cublas", types.SimpleNamespace(
        gemm=lambda h, a, b, c, alpha, beta, ta, tb, out: np.matmul(a, b.T, out=out),
        matmul=lambda h, a, b, out: np.matmul(a, b, out=out)))
    monkeypatch.setattr(rnn, "_device_launcher", lambda module: numpy_launcher(kernel))
    ctx = _Ctx([feeds.get(n) if n else None for n in node.input], list(node.output))
    kernel.compute(ctx)
    got = {node.output[i]: v for i, v in ctx.outs.items()}
    want = reference(case, feeds)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == dtype
        tol = 1e-5 if dtype == np.float32 else 1e-2
        np.testing.assert_allclose(got[name].astype(np.float32), ref, rtol=tol, atol=tol, err_msg=name)


def test_the_launcher_passes_the_arguments_in_the_kernels_order():
    """_device_launcher's argument tuple against the ARGS of the CUDA source (names and order), with
    recognisable fake device addresses."""
    import re
    import types

    from plugin_cuda.kernels import rnn, rnn_cells

    params = re.search(r"#define ARGS (.*?)\n(?!\s)", rnn_cells._PRELUDE, re.S).group(1)
    names = [p.strip().split()[-1].lstrip("*") for p in params.replace("\\", " ").split(",")]
    assert names == ["xw", "bias", "hr", "h", "c", "extra", "y", "lens", "z", "rh", "t", "S", "B", "H", "D", "layout",
                     "rev_mask"]
    addresses = {n: 0x1000 * (k + 1) for k, n in enumerate(names[:10])}

    def array(name):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=addresses[name]))

    buf = rnn.Buffers(*(array(n) for n in ("xw", "bias", "h", "c", "extra", "y", "lens", "z", "rh")),
                      dims=(5, 3, 7, 2, 1, 2))
    calls = []
    module = types.SimpleNamespace(kernel=lambda name: lambda grid, block, args: calls.append((name, args)))
    launch = rnn._device_launcher(module)
    for t in (0, 1):
        launch("lstm", buf, t, array("hr"))
    assert [name for name, _ in calls] == ["lstm", "lstm"]
    for t, (_, args) in enumerate(calls):
        assert [int(a) for a in args] == [addresses[n] for n in names[:10]] + [t, 5, 3, 7, 2, 1, 2]
        # 8-byte pointers and 4-byte ints, as the kernel's parameters (CuPy passes NumPy scalars by size)
        assert [type(a) for a in args] == [np.uint64] * 10 + [np.int32] * 7
