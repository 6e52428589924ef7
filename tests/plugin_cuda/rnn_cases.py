"""LSTM / GRU / RNN single-node models over the attribute combinations, and onnxruntime's CPU results for
them: shared by the CPU check of the CUDA kernels' step logic (test_rnn_cpu.py, NumPy) and the GPU tests
(test_rnn_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
OUTPUTS = {"RNN": ("Y", "Y_h"), "GRU": ("Y", "Y_h"), "LSTM": ("Y", "Y_h", "Y_c")}


@dataclass
class Case:
    op: str
    direction: str = "forward"
    layout: int = 0
    seq: int = 5
    batch: int = 3
    inp: int = 4
    hidden: int = 6
    bias: bool = True
    lens: tuple | None = None  # sequence_lens, one per batch entry
    h0: bool = False
    c0: bool = False
    peephole: bool = False
    outputs: tuple = (True, True, True)  # which of Y, Y_h, Y_c the node has
    attrs: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def dirs(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    def id(self) -> str:
        bits = [self.op, self.direction[:3], f"L{self.layout}"]
        bits += [k for k, v in (("nobias", not self.bias), ("lens", self.lens), ("h0", self.h0), ("c0", self.c0),
                                ("P", self.peephole)) if v]
        bits += ["out" + "".join("1" if o else "0" for o in self.outputs[: len(OUTPUTS[self.op])])]
        bits += [f"{k}={v}" for k, v in sorted(self.attrs.items()) if k not in ("activation_alpha", "activation_beta")]
        return "-".join(str(b) for b in bits).replace(" ", "")


def _inputs(case: Case) -> list[tuple[str, np.ndarray | None]]:
    rng = np.random.default_rng(case.seed)
    g, d, h, s, b = GATES[case.op], case.dirs, case.hidden, case.seq, case.batch

    def arr(*shape, scale=0.5):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    x = arr(b, s, case.inp, scale=1.0) if case.layout else arr(s, b, case.inp, scale=1.0)
    state = (b, d, h) if case.layout else (d, b, h)
    ins = [("X", x), ("W", arr(d, g * h, case.inp)), ("R", arr(d, g * h, h)),
           ("B", arr(d, 2 * g * h) if case.bias else None),
           ("sequence_lens", None if case.lens is None else np.array(case.lens, np.int32)),
           ("initial_h", arr(*state) if case.h0 else None)]
    if case.op == "LSTM":
        ins += [("initial_c", arr(*state) if case.c0 else None), ("P", arr(d, 3 * h) if case.peephole else None)]
    while ins[-1][1] is None:
        ins.pop()
    return ins


def _output_shape(case: Case, name: str) -> tuple:
    s, b, d, h = case.seq, case.batch, case.dirs, case.hidden
    if name == "Y":
        return (b, s, d, h) if case.layout else (s, d, b, h)
    return (b, d, h) if case.layout else (d, b, h)


def build(case: Case, opset: int = 14, dtype=np.float32):
    """(model, feeds): one node with every present input a graph input (float inputs in `dtype`)."""
    ins = [(n, v.astype(dtype) if v is not None and v.dtype == np.float32 else v) for n, v in _inputs(case)]
    outs = [n if want else "" for n, want in zip(OUTPUTS[case.op], case.outputs)]
    while outs and not outs[-1]:
        outs.pop()
    node = helper.make_node(case.op, [n if v is not None else "" for n, v in ins], outs, hidden_size=case.hidden,
                            direction=case.direction, **({"layout": case.layout} if case.layout else {}), **case.attrs)
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
             np.dtype(np.int32): TensorProto.INT32}
    graph = helper.make_graph(
        [node], "rnn", [helper.make_tensor_value_info(n, types[v.dtype], v.shape) for n, v in ins if v is not None],
        [helper.make_tensor_value_info(n, types[np.dtype(dtype)], _output_shape(case, n)) for n in outs if n])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, {n: v for n, v in ins if v is not None}


def ort_outputs(model, feeds) -> dict:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def reference(case: Case, feeds: dict) -> dict:
    """onnxruntime CPU's outputs for `case` on `feeds` (float16 feeds computed in float32). onnxruntime refuses layout 1, so a layout-1 case
    runs as its layout-0 twin on transposed X / initial states, with the outputs transposed back."""
    feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
    if not case.layout:
        return ort_outputs(build(case)[0], feeds)
    twin = Case(**{**case.__dict__, "layout": 0})
    moved = {"X": (1, 0, 2), "initial_h": (1, 0, 2), "initial_c": (1, 0, 2)}
    out = ort_outputs(build(twin)[0], {k: v.transpose(moved[k]) if k in moved else v for k, v in feeds.items()})
    back = {"Y": (2, 0, 1, 3), "Y_h": (1, 0, 2), "Y_c": (1, 0, 2)}
    return {k: v.transpose(back[k]) for k, v in out.items()}


def _grid() -> list[Case]:
    out = []
    for op in ("RNN", "GRU", "LSTM"):
        for direction in ("forward", "reverse", "bidirectional"):
            for layout in (0, 1):
                out.append(Case(op, direction, layout, h0=True, c0=op == "LSTM", seed=len(out)))
        out.append(Case(op, "bidirectional", 0, lens=(5, 2, 0), h0=True, c0=True, seed=len(out)))
        out.append(Case(op, "reverse", 1, lens=(3, 5, 1), bias=False, seed=len(out)))
        out.append(Case(op, "forward", 0, outputs=(False, True, True), attrs={"clip": 0.7}, seed=len(out)))
        out.append(Case(op, "bidirectional", 0, outputs=(True, False, True), seed=len(out)))
    out.append(Case("GRU", "bidirectional", 1, lens=(4, 5, 2), h0=True, attrs={"linear_before_reset": 1}))
    out.append(Case("GRU", "forward", 0, attrs={"linear_before_reset": 1, "clip": 0.5}, seed=31))
    out.append(Case("LSTM", "bidirectional", 0, peephole=True, h0=True, c0=True, seed=32))
    out.append(Case("LSTM", "forward", 1, peephole=True, lens=(2, 5, 4), attrs={"input_forget": 1}, seed=33))
    out.append(Case("LSTM", "bidirectional", 0, seed=34, attrs={
        "activations": ["HardSigmoid", "Elu", "ScaledTanh", "Sigmoid", "Softsign", "Softplus"],
        "activation_alpha": [0.3, 0.9, 1.5], "activation_beta": [0.4, 0.7]}))
    out.append(Case("GRU", "bidirectional", 0, seed=35, attrs={
        "activations": ["Sigmoid", "LeakyRelu", "HardSigmoid", "Relu"], "activation_alpha": [0.2, 0.25],
        "activation_beta": [0.55]}))
    out.append(Case("RNN", "bidirectional", 0, seed=36, attrs={
        "activations": ["Affine", "ThresholdedRelu"], "activation_alpha": [0.8, 0.1], "activation_beta": [0.3]}))
    out.append(Case("RNN", "forward", 0, seed=37, attrs={"activations": ["Relu"]}))
    return out


CASES = _grid()
