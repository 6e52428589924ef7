"""Export tiny recurrent and transposed-convolution models with torch.onnx (TorchScript exporter, opset 17).

Run where torch is installed (a CPU build is enough):

    python tests/models/export_recurrent.py --out tests/models/recurrent

Writes <name>.onnx and <name>.npz (the inputs under their ONNX input names, torch's outputs under
"out:<onnx output name>", as tests/models/export.py does) for:

- lstm: 2-layer bidirectional torch.nn.LSTM (input 8, hidden 12, batch_first) with explicit (h0, c0)
  inputs and a Linear head; outputs y, h_n, c_n. Dynamic batch and sequence axes.
- gru: 2-layer bidirectional torch.nn.GRU (input 8, hidden 10, sequence first) with no initial state
  (the exporter builds zeros); outputs y, h_n. Dynamic batch and sequence axes.
- convtranspose: a small decoder: ConvTranspose2d(8, 6, 4, stride 2, padding 1), ReLU,
  ConvTranspose2d(6, 4, 3, stride 2, padding 1, output_padding 1, groups 2, dilation 1),
  ConvTranspose2d(4, 2, 2, stride 2) (taps that do not overlap).

The fixtures live in a subfolder so that tests/models' real-architecture fixture list
(`tests.models.available_models`) stays as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SEED = 0
OPSET = 17
MAX_IR_VERSION = 10


def build_lstm(torch, rng):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)
            self.head = torch.nn.Linear(24, 4)

        def forward(self, x, h0, c0):
            y, (h, c) = self.rnn(x, (h0, c0))
            return self.head(y), h, c

    inputs = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32),
              "h0": 0.5 * rng.standard_normal((4, 2, 12)).astype(np.float32),
              "c0": 0.5 * rng.standard_normal((4, 2, 12)).astype(np.float32)}
    dynamic = {"x": {0: "batch", 1: "seq"}, "h0": {1: "batch"}, "c0": {1: "batch"},
               "y": {0: "batch", 1: "seq"}, "h_n": {1: "batch"}, "c_n": {1: "batch"}}
    return Model(), inputs, ["y", "h_n", "c_n"], dynamic


def build_gru(torch, rng):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(8, 10, num_layers=2, bidirectional=True)

        def forward(self, x):
            return self.rnn(x)

    inputs = {"x": rng.standard_normal((6, 3, 8)).astype(np.float32)}
    dynamic = {"x": {0: "seq", 1: "batch"}, "y": {0: "seq", 1: "batch"}, "h_n": {1: "batch"}}
    return Model(), inputs, ["y", "h_n"], dynamic


def build_convtranspose(torch, rng):
    nn = torch.nn
    model = nn.Sequential(nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
                          nn.ConvTranspose2d(4, 2, 2, stride=2))
    inputs = {"x": rng.standard_normal((1, 8, 5, 7)).astype(np.float32)}
    return model, inputs, ["y"], {}


BUILDERS = {"lstm": build_lstm, "gru": build_gru, "convtranspose": build_convtranspose}


def export_one(torch, onnx, name: str, out_dir: Path) -> dict:
    torch.manual_seed(SEED)
    model, inputs, output_names, dynamic = BUILDERS[name](torch, np.random.default_rng(SEED))
    model.eval()
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with torch.no_grad():
        expected = model(*args)
    path = out_dir / f"{name}.onnx"
    torch.onnx.export(model, args, str(path), input_names=list(inputs), output_names=output_names,
                      dynamic_axes=dynamic or None, opset_version=OPSET, dynamo=False, do_constant_folding=True)
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    onnx.save_model(proto, str(path))
    onnx.checker.check_model(str(path))
    outs = expected if isinstance(expected, tuple) else (expected,)
    arrays = dict(zip([i.name for i in proto.graph.input], inputs.values()))
    for out, value in zip([o.name for o in proto.graph.output], outs):
        arrays[f"out:{out}"] = value.detach().numpy()
    np.savez(out_dir / f"{name}.npz", **arrays)
    return {"ops": sorted({n.op_type for n in proto.graph.node}), "bytes": path.stat().st_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "recurrent"))
    ns = parser.parse_args(argv)
    import onnx
    import torch

    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, onnx {onnx.__version__}")
    for name in BUILDERS:
        facts = export_one(torch, onnx, name, out_dir)
        print(f"{name}: {facts['bytes']} bytes, ops {', '.join(facts['ops'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
