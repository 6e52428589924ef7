"""Export a model with a data-dependent loop through torch.onnx (TorchScript exporter, opset 17): a
scripted function whose `while` runs until the state's norm passes a bound (so the trip count depends on
the input's values) becomes an ONNX `Loop` whose body holds the float work (MatMul, Tanh, Add, Mul,
ReduceSum, Sqrt...) and the condition. Static shapes (x is (2, 6)), so the body's values have static shapes
and a device EP can compile the body into one plan. Run where torch is installed (a CPU build is enough):

    python tests/models/export_loop.py --out tests/models/control_flow

Writes loop.onnx and loop.npz (inputs under their ONNX names, torch's outputs under "out:<name>").
Used by tests/host/test_cpu_control_flow_export.py (CPU EP) and tests/plugin_cuda/test_control_flow_gpu.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SEED = 0
OPSET = 17
MAX_IR_VERSION = 10


def build(torch):
    @torch.jit.script
    def grow(x: torch.Tensor, w: torch.Tensor, bound: float):
        h = x
        steps = torch.zeros(1)
        while bool(torch.sqrt((h * h).sum()) < bound):
            h = torch.tanh(h @ w) + h * 1.25
            steps = steps + 1.0
        return h, steps

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(0.5 * torch.randn(6, 6))
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):
            h, steps = grow(x, self.w, 40.0)
            return self.head(h), steps

    return Model()


def export(torch, onnx, out_dir: Path) -> dict:
    torch.manual_seed(SEED)
    model = build(torch).eval()
    x = np.random.default_rng(SEED).standard_normal((2, 6)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x))
    path = out_dir / "loop.onnx"
    torch.onnx.export(model, (torch.from_numpy(x),), str(path), input_names=["x"], output_names=["y", "steps"],
                      opset_version=OPSET, dynamo=False)
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    onnx.save_model(proto, str(path))
    onnx.checker.check_model(str(path))
    np.savez(out_dir / "loop.npz", x=x, **{f"out:{n}": v.numpy() for n, v in zip(["y", "steps"], expected)})
    return {"ops": sorted({n.op_type for n in proto.graph.node}), "bytes": path.stat().st_size,
            "steps": float(expected[1][0])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "control_flow"))
    ns = parser.parse_args(argv)
    import onnx
    import torch

    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, onnx {onnx.__version__}: {export(torch, onnx, out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
