"""Small random-weight exports of real architectures (made by tests/models/export.py with torch.onnx).

Each fixture is `<arch>_<exporter>.onnx` with `<arch>_<exporter>.npz` beside it: the inputs under
their ONNX input names and torch's outputs under "out:<onnx output name>".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from host.errors import InvalidArgument

MODELS_DIR = Path(__file__).parent
OUTPUT_PREFIX = "out:"


def available_models() -> list[str]:
    """Names ("bert_dynamo", ...) of the fixtures present (an .onnx with its .npz), sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.onnx") if p.with_suffix(".npz").exists())


def load(name: str) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(model_path, feeds, expected): feeds by ONNX input name, expected (torch's outputs) by output name."""
    names = available_models()
    if name not in names:
        raise InvalidArgument(f"unknown model fixture {name!r}; expected one of: {', '.join(names)}")
    path = MODELS_DIR / f"{name}.onnx"
    with np.load(path.with_suffix(".npz")) as data:
        arrays = {key: data[key] for key in data.files}
    feeds = {k: v for k, v in arrays.items() if not k.startswith(OUTPUT_PREFIX)}
    expected = {k[len(OUTPUT_PREFIX):]: v for k, v in arrays.items() if k.startswith(OUTPUT_PREFIX)}
    return path, feeds, expected
