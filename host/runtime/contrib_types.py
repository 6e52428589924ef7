"""Element types of com.microsoft ops' outputs that onnx's shape inference cannot give (it has no
schemas for that domain), so that plugin kernels can allocate them (KernelContext_GetOutput needs
the type): the quantized ops onnxruntime's quantizer emits, as onnxruntime's contrib schemas say;
and the ONNX-domain nodes after them, which inference leaves untyped once an input is (a
QLinearMatMul reading a QLinearAdd's output)."""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"
_FLOAT = 1

# op type -> which input's type the outputs take (an int), or a fixed element type (a str "float")
_SAME_AS_INPUT = {"QLinearAdd": 0, "QLinearMul": 0, "QLinearGlobalAveragePool": 0, "QLinearAveragePool": 0,
                  "QLinearSigmoid": 0, "QLinearLeakyRelu": 0, "QLinearSoftmax": 0, "QLinearConcat": 2,
                  "QLinearReduceMean": 0, "QLinearWhere": 2}
_FLOAT_OUT = {"MatMulIntegerToFloat", "DynamicQuantizeMatMul"}
_INT32 = 6
# ONNX-domain ops: the input whose type the first output takes (y_zero_point for the quantizing ones)
_ONNX_SAME_AS_INPUT = {"QLinearMatMul": 7, "QLinearConv": 7, "QuantizeLinear": 2, "DequantizeLinear": 1,
                       "Reshape": 0, "Flatten": 0, "Transpose": 0, "Squeeze": 0, "Unsqueeze": 0, "Identity": 0,
                       "MaxPool": 0, "Slice": 0, "Concat": 0, "Gather": 0, "Expand": 0, "Relu": 0}
_ONNX_FIXED = {"MatMulInteger": _INT32, "ConvInteger": _INT32}


def _qgemm(node, types: dict) -> int:
    """QGemm: the y_zero_point's type (quantized output), float without one."""
    y_zp = node.inputs[8] if len(node.inputs) > 8 else ""
    return types.get(y_zp, 0) if y_zp else _FLOAT


def fill(nodes, values: dict) -> None:
    """Give untyped outputs of the com.microsoft quantized ops in `nodes` their element type."""
    types = {name: v.elem_type for name, v in values.items() if v.elem_type}
    for node in nodes:
        if node.domain in ("", "ai.onnx"):
            _fill_onnx(node, values, types)
            continue
        if node.domain != MS_DOMAIN:
            continue
        if node.op_type in _SAME_AS_INPUT:
            src = node.inputs[_SAME_AS_INPUT[node.op_type]] if len(node.inputs) > _SAME_AS_INPUT[node.op_type] else ""
            elem = types.get(src, 0)
        elif node.op_type in _FLOAT_OUT:
            elem = _FLOAT
        elif node.op_type == "QGemm":
            elem = _qgemm(node, types)
        else:
            continue
        for out in node.outputs[:1]:
            meta = values.get(out)
            if out and elem and (meta is None or not meta.elem_type):
                values[out] = _typed(meta, out, elem)
                types[out] = elem


def _fill_onnx(node, values: dict, types: dict) -> None:
    """An ONNX node's first output left untyped by inference (after a com.microsoft node)."""
    out = node.outputs[0] if node.outputs else ""
    meta = values.get(out)
    if not out or (meta is not None and meta.elem_type):
        return
    if node.op_type in _ONNX_FIXED:
        elem = _ONNX_FIXED[node.op_type]
    elif node.op_type in _ONNX_SAME_AS_INPUT:
        pos = _ONNX_SAME_AS_INPUT[node.op_type]
        src = node.inputs[pos] if len(node.inputs) > pos else ""
        # QuantizeLinear without a zero point makes uint8 (ONNX's default)
        elem = types.get(src, 0) or (2 if node.op_type == "QuantizeLinear" and not src else 0)
    else:
        return
    if elem:
        values[out] = _typed(meta, out, elem)
        types[out] = elem


def _typed(meta, name: str, elem: int):
    from host.runtime.model import ValueMeta

    return ValueMeta(name, elem, None if meta is None else meta.shape)
