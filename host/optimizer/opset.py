"""Converting a model's ai.onnx opset up, through onnx-ir's model API.

onnxscript's `version_converter.convert_version(ModelProto, ...)` copies only the converted graph
back into the proto and keeps the old `opset_import`, so the proto claims the old opset while its
nodes use the new forms (seen on a Llama export; tests/host/optimizer pin it). Converting the
ir.Model in place and serializing that model avoids it.
"""

from __future__ import annotations

import onnx_ir as ir

TARGET_OPSET = 23


def onnx_opset(model: ir.Model) -> int:
    """The model's ai.onnx opset ('' or 'ai.onnx')."""
    imports = model.opset_imports
    return int(imports.get("", imports.get("ai.onnx", 0)))


def convert_opset(model: ir.Model, target: int = TARGET_OPSET) -> bool:
    """Convert `model` in place to ai.onnx `target`; False (model left as it was) when that fails.

    From opset 18 up onnxscript's own converter does it; below 18 it falls back to the onnx C API.
    """
    if onnx_opset(model) >= target:
        return True
    # Imported here: most models need no conversion, and a first session should not pay its import.
    from onnxscript.version_converter import ConvertVersionPass

    try:
        ConvertVersionPass(target, fallback=True)(model)
    except Exception:  # noqa: BLE001 - any converter failure means: keep the model's opset
        return False
    return onnx_opset(model) == target
