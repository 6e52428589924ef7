"""Element types of com.microsoft ops' outputs that onnx's shape inference cannot give (it has no
schemas for that domain), so that plugin kernels can allocate them (KernelContext_GetOutput needs
the type): the quantized ops onnxruntime's quantizer emits. Rules as onnxruntime's contrib schemas."""

from __future__ import annotations

MS_DOMAIN = "com.microsoft"
_FLOAT = 1

# op type -> which input's type the outputs take (an int), or a fixed element type (a str "float")
_SAME_AS_INPUT = {"QLinearAdd": 0, "QLinearMul": 0, "QLinearGlobalAveragePool": 0, "QLinearAveragePool": 0,
                  "QLinearSigmoid": 0, "QLinearLeakyRelu": 0, "QLinearSoftmax": 0, "QLinearConcat": 2,
                  "QLinearReduceMean": 0, "QLinearWhere": 2}
_FLOAT_OUT = {"MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


def _qgemm(node, types: dict) -> int:
    """QGemm: the y_zero_point's type (quantized output), float without one."""
    y_zp = node.inputs[8] if len(node.inputs) > 8 else ""
    return types.get(y_zp, 0) if y_zp else _FLOAT


def fill(nodes, values: dict) -> None:
    """Give untyped outputs of the com.microsoft quantized ops in `nodes` their element type."""
    types = {name: v.elem_type for name, v in values.items() if v.elem_type}
    for node in nodes:
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


def _typed(meta, name: str, elem: int):
    from host.runtime.model import ValueMeta

    return ValueMeta(name, elem, None if meta is None else meta.shape)
