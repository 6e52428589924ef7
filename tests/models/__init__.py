"""Small random-weight exports of real architectures (made by tests/models/export.py with torch.onnx).

Each fixture is `<arch>_<exporter>.onnx` with `<arch>_<exporter>.npz` beside it: the inputs under
their ONNX input names and torch's outputs under "out:<onnx output name>".

Architectures too large to check in (`generated_models()`: ResNet-18) are exported by the same code on
first use, into `generated_dir()` (EPHOST_GENERATED_MODELS, default <tmp>/ephost_models); that needs
torch, torchvision and onnx (the GPU machine has them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from host.errors import InvalidArgument

MODELS_DIR = Path(__file__).parent
OUTPUT_PREFIX = "out:"


def available_models() -> list[str]:
    """Names ("bert_dynamo", ...) of the fixtures present (an .onnx with its .npz), sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.onnx") if p.with_suffix(".npz").exists())


GENERATED_ARCHS = ("resnet18",)
EXPORTERS = ("dynamo", "torchscript")


def generated_models() -> list[str]:
    """Names of the fixtures exported on first use (not checked in)."""
    return [f"{arch}_{exporter}" for arch in GENERATED_ARCHS for exporter in EXPORTERS]


def generated_dir() -> Path:
    return Path(os.environ.get("EPHOST_GENERATED_MODELS") or Path(tempfile.gettempdir()) / "ephost_models")


def ensure_generated(name: str) -> Path:
    """The path of generated fixture `name`, exported now (torch.onnx) unless already there."""
    arch, exporter = name.rsplit("_", 1)
    out = generated_dir()
    path = out / f"{name}.onnx"
    if not (path.exists() and path.with_suffix(".npz").exists()):
        import onnx
        import torch

        from tests.models import export

        out.mkdir(parents=True, exist_ok=True)
        # Exported in a private directory, then moved in (the model first, the .npz that marks it done
        # last), each move atomic: parallel test workers never read a half-written file.
        with tempfile.TemporaryDirectory(dir=out) as private:
            export.export_one(torch, onnx, arch, exporter, Path(private))
            for suffix in (".onnx", ".npz"):
                os.replace(Path(private) / f"{name}{suffix}", path.with_suffix(suffix))
    return path


def load(name: str) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(model_path, feeds, expected): feeds by ONNX input name, expected (torch's outputs) by output name."""
    names = available_models() + generated_models()
    if name not in names:
        raise InvalidArgument(f"unknown model fixture {name!r}; expected one of: {', '.join(names)}")
    path = ensure_generated(name) if name in generated_models() else MODELS_DIR / f"{name}.onnx"
    with np.load(path.with_suffix(".npz")) as data:
        arrays = {key: data[key] for key in data.files}
    feeds = {k: v for k, v in arrays.items() if not k.startswith(OUTPUT_PREFIX)}
    expected = {k[len(OUTPUT_PREFIX):]: v for k, v in arrays.items() if k.startswith(OUTPUT_PREFIX)}
    return path, feeds, expected
