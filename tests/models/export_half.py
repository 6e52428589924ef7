"""A small transformer block exported by torch from `model.half()` and `model.to(torch.bfloat16)`.

The block has what the half-precision paths must handle in a real export: LayerNorm, a Llama-style
RMSNorm that computes in float32 between Casts (`x.to(torch.float32)` ... `.to(dtype)`), attention
with softmax, GELU and residual adds. `export(torch, out_dir)` writes block_fp32.onnx, block_fp16.onnx,
block_bf16.onnx (TorchScript exporter, opset 17) and block.npz (input x, torch's float32 output y);
tests/host/test_half_models.py calls it where torch is installed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _block(torch, d: int = 64, heads: int = 4):
    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(d) + 0.5)

        def forward(self, x):
            dtype = x.dtype
            x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.w * x.to(dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.rms = nn.LayerNorm(d), RMSNorm()
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.rms(x)).split(d, -1)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), -1) @ v
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(nn.functional.gelu(self.up(self.ln(x))))

    return Block().eval()


def export(torch, out_dir: Path) -> Path:
    """Writes the three exports and block.npz into out_dir; returns out_dir."""
    import warnings

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = _block(torch)
    x = torch.randn(1, 16, 64)
    with torch.no_grad():
        y = model(x).numpy()
    np.savez(out_dir / "block.npz", x=x.numpy(), y=y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        for tag, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
            torch.onnx.export(model.to(dtype), (x.to(dtype),), str(out_dir / f"block_{tag}.onnx"), dynamo=False,
                              opset_version=17, input_names=["x"], output_names=["y"])
    return out_dir
