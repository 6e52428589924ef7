"""The CUDA EP's quantized kernels, checked without a GPU: what they claim (every quantized node of the
models onnxruntime's quantizer makes from the small CNN and transformer of tests/host/test_quantized.py),
the int8 GEMM's zero-point correction and im2col packing in NumPy mirrors of the device code, and the
CUDA C of every kernel body compiled with nvcc -ptx."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from plugin_cuda import kernels
from plugin_cuda.device import int8gemm
from plugin_cuda.kernels import quant_gemm

U8, I8, F, I32 = "uint8", "int8", "float32", "int32"
QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
             "QLinearMatMul", "QLinearConv", "QGemm", "QLinearAdd", "QLinearMul", "MatMulIntegerToFloat",
             "DynamicQuantizeMatMul", "QLinearGlobalAveragePool"}


@pytest.mark.parametrize("op, domain, dtypes, claimed", [
    ("QuantizeLinear", "", [F, F, U8], True),
    ("QuantizeLinear", "", [F, F, "int16"], True),
    ("QuantizeLinear", "", ["float16", "float16", U8], False),  # half inputs stay on the CPU EP
    ("QuantizeLinear", "", [F, F, "int4"], False),
    ("DequantizeLinear", "", [I8, F, I8], True),
    ("DequantizeLinear", "", [I32, F], True),
    ("DequantizeLinear", "", ["float8e4m3fn", F], False),
    ("MatMulInteger", "", [U8, I8, U8, I8], True),
    ("MatMulInteger", "", ["int16", I8], False),
    ("QLinearMatMul", "", [U8, F, U8, I8, F, I8, F, U8], True),
    ("QLinearConv", "", [U8, F, U8, I8, F, I8, F, U8, I32], True),
    ("QLinearConv", "", [U8, F, U8, I8, F, I8, F, U8, "int64"], False),
    ("QGemm", "com.microsoft", [U8, F, U8, I8, F, I8, I32, F, U8], True),
    ("QLinearAdd", "com.microsoft", [I8, F, I8, I8, F, I8, F, I8], True),
    ("DynamicQuantizeMatMul", "com.microsoft", [F, I8, F, I8, F], True),
    ("QLinearSoftmax", "com.microsoft", [U8, F, U8, F, U8], False),  # not on the GPU yet
])
def test_claims(op, domain, dtypes, claimed):
    assert kernels.claimable(op, {}, dtypes, 1 if domain else 21, domain=domain) is claimed


def test_attributes_outside_the_kernels_range_are_not_claimed():
    assert not kernels.claimable("QuantizeLinear", {"output_dtype": TensorProto.INT4}, [F, F], 21)
    assert kernels.claimable("QuantizeLinear", {"output_dtype": TensorProto.INT8}, [F, F], 21)
    assert not kernels.claimable("QGemm", {"transA": 2}, [U8, F, U8, I8, F, I8], 1, domain="com.microsoft")


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    """{(model, format): ModelProto} from onnxruntime's quantizer (QOperator, QDQ, dynamic)."""
    from tests.plugin_cuda.test_quant_gpu import quantized_model

    out = str(tmp_path_factory.mktemp("quant_claims"))
    return {(name, fmt): onnx.shape_inference.infer_shapes(onnx.load(quantized_model(out, name, fmt)))
            for name in ("cnn", "transformer") for fmt in ("qop", "qdq", "dynamic")}


def _element_types(model) -> dict:
    types = {i.name: i.data_type for i in model.graph.initializer}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    return types


def test_every_quantized_node_of_the_quantizers_models_is_claimed(quantized_models):
    seen = set()
    for (name, fmt), model in quantized_models.items():
        types = _element_types(model)
        opsets = {o.domain: o.version for o in model.opset_import}
        for node in model.graph.node:
            if node.op_type not in QUANT_OPS:
                continue
            dtypes = [types.get(i) if i else None for i in node.input]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            domain = node.domain if node.domain not in ("", "ai.onnx") else ""
            assert kernels.claimable(node.op_type, attrs, dtypes, opsets.get(node.domain, 1), domain=domain,
                                     num_outputs=len(node.output)), (name, fmt, node.op_type, dtypes)
            seen.add(node.op_type)
    assert {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "MatMulInteger", "ConvInteger",
            "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear", "QLinearGlobalAveragePool"} <= seen


class _Ctx:
    def __init__(self, *inputs):
        self.inputs = list(inputs)


def test_shape_errors_name_what_arrived_and_what_is_allowed():
    """Raised before any device work (NumPy arrays stand in for the device ones)."""
    from plugin_cuda.kernels import quant, quant_conv, quant_ms

    q = quant.QuantizeLinear({"axis": 1}, 21, "q")
    with pytest.raises(ValueError, match=r"^QuantizeLinear node 'q': a per-axis parameter of length 3 for axis 1 of "
                                         r"input shape \(2, 4\); allowed: length 4 \(one per element of the axis\)$"):
        q.param(np.zeros(3, np.float32), (2, 4))
    with pytest.raises(ValueError, match=r"^QuantizeLinear node 'q': a parameter of shape \(2, 2\) with block_size 0"):
        q.param(np.zeros((2, 2), np.float32), (2, 4))
    with pytest.raises(ValueError, match=r"^integer MatMul of shapes \(2, 3\) and \(4, 5\): the inner dimensions 3 "
                                         r"and 4 must match$"):
        quant_gemm.matmul(np.zeros((2, 3), np.uint8), np.zeros((4, 5), np.int8))
    with pytest.raises(ValueError, match=r"^a_zero_point of shape \(6,\) for 4 rows in a batch of 3; allowed: a "
                                         r"scalar, one per row, or one per row of each matrix$"):
        quant.per_row(np.zeros(6, np.uint8), (3, 4, 5))
    gemm = quant_ms.QGemm({}, 1, "g")
    with pytest.raises(ValueError, match=r"^QGemm node 'g': A \(1, 2, 3\) and B \(3, 4\); allowed: two 2-D matrices"):
        gemm.compute(_Ctx(np.zeros((1, 2, 3), np.uint8), None, None, np.zeros((3, 4), np.int8), None, None))
    conv = quant_conv.ConvInteger({"group": 2}, 13, "c")
    with pytest.raises(ValueError, match=r"^ConvInteger node 'c': input \(1, 3, 5, 5\), weight \(4, 2, 3, 3\) and "
                                         r"group 2 do not agree"):
        conv.compute(_Ctx(np.zeros((1, 3, 5, 5), np.uint8), np.zeros((4, 2, 3, 3), np.int8)))


# ---- NumPy mirrors of the device arithmetic ----------------------------------------------------


def _shift(dtype) -> int:
    return 128 if np.dtype(dtype) == np.uint8 else 0


def mirror_pack(x, rows: int, k: int, buffer_rows: int) -> np.ndarray:
    """quant_gemm's "pack" of a (rows, k) operand: int8 codes, a row of ones at `rows`, zero padding."""
    kp = int8gemm.round_up(max(k, 1))
    out = np.zeros((buffer_rows, kp), np.int64)
    out[:rows, :k] = x.astype(np.int64) - _shift(x.dtype)
    out[rows, :k] = 1
    assert out.min() >= -128 and out.max() <= 127
    return out


def mirror_int_matmul(a, b, a_zp, b_zp) -> np.ndarray:
    """The device's (a - a_zp) @ (b - b_zp): the GEMM on packed int8 operands, then q_acc."""
    m, k = a.shape
    n = b.shape[1]
    rows_a, rows_b, kp = int8gemm.padded_dims(m, n, k)
    assert rows_a % 4 == 0 and rows_b % 4 == 0 and kp % 4 == 0 and rows_a > m and rows_b > n and kp >= k
    d = mirror_pack(a, m, k, rows_a) @ mirror_pack(b.T, n, k, rows_b).T  # (rows_a, rows_b), int32 on the GPU
    p, ra, cb = d[:m, :n], d[:m, n:n + 1], d[m:m + 1, :n]
    za = np.asarray(a_zp, np.int64).reshape(-1, 1) - _shift(a.dtype)
    zb = np.asarray(b_zp, np.int64).reshape(1, -1) - _shift(b.dtype)
    return p - zb * ra - za * cb + k * za * zb  # q_acc


@pytest.mark.parametrize("a_type, b_type", [(np.uint8, np.int8), (np.int8, np.int8), (np.uint8, np.uint8),
                                            (np.int8, np.uint8)])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (5, 7, 9), (4, 8, 12), (33, 3, 130)])
def test_zero_point_correction_is_exact(a_type, b_type, m, n, k):
    rng = np.random.default_rng(m * n * k)
    info_a, info_b = np.iinfo(a_type), np.iinfo(b_type)
    a = rng.integers(info_a.min, info_a.max + 1, (m, k)).astype(a_type)
    b = rng.integers(info_b.min, info_b.max + 1, (k, n)).astype(b_type)
    a_zp = rng.integers(info_a.min, info_a.max + 1, (m,)).astype(a_type)  # per row
    b_zp = rng.integers(info_b.min, info_b.max + 1, (n,)).astype(b_type)  # per column
    expected = (a.astype(np.int64) - a_zp.astype(np.int64)[:, None]) @ (b.astype(np.int64) - b_zp.astype(np.int64))
    np.testing.assert_array_equal(mirror_int_matmul(a, b, a_zp, b_zp), expected)
    np.testing.assert_array_equal(mirror_int_matmul(a, b, a_zp[:1], b_zp[:1]),
                                  (a.astype(np.int64) - int(a_zp[0])) @ (b.astype(np.int64) - int(b_zp[0])))


def mirror_im2col(x, zp, kernel, stride, pad, dilation, group) -> tuple[np.ndarray, int, int]:
    """quant_gemm's "im2col" for a 2-D convolution, element by element as the device code indexes it."""
    n, c, h, w = x.shape
    kh, kw = kernel
    oh = (h + 2 * pad - dilation * (kh - 1) - 1) // stride + 1
    ow = (w + 2 * pad - dilation * (kw - 1) - 1) // stride + 1
    cg, rows = c // group, n * oh * ow
    k = cg * kh * kw
    rp, _, kp = int8gemm.padded_dims(rows, 1, k)
    col = np.zeros((group, rp, kp), np.int64)
    flat = x.reshape(-1)
    for i in range(col.size):
        t = i
        cc = t % kp
        t //= kp
        r, g = t % rp, t // rp
        if cc >= k or r > rows:
            continue
        if r == rows:
            col[g, r, cc] = 1
            continue
        ox, oy, nn = r % ow, (r // ow) % oh, r // ow // oh
        kx, ky, ch = cc % kw, (cc // kw) % kh, g * cg + cc // kw // kh
        iy, ix = oy * stride - pad + ky * dilation, ox * stride - pad + kx * dilation
        inside = 0 <= iy < h and 0 <= ix < w
        value = int(flat[((nn * c + ch) * h + iy) * w + ix]) if inside else int(zp)
        col[g, r, cc] = value - _shift(x.dtype)
    return col, oh, ow


def test_im2col_packing_gives_the_integer_convolution():
    pytest.importorskip("onnxruntime")
    import onnxruntime

    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 4, 5, 6)).astype(np.uint8)
    w = rng.integers(-128, 128, (6, 2, 3, 3)).astype(np.int8)
    x_zp, w_zp, group = np.uint8(131), np.int8(-3), 2
    col, oh, ow = mirror_im2col(x, x_zp, (3, 3), 2, 1, 1, group)
    m, ocg, k = 6, 3, 2 * 9
    rows = x.shape[0] * oh * ow
    out = np.empty((2, m, oh, ow), np.int64)
    for g in range(group):
        wt = mirror_pack(w[g * ocg:(g + 1) * ocg].reshape(ocg, k), ocg, k, int8gemm.padded_dims(rows, ocg, k)[1])
        d = col[g] @ wt.T
        za, zb = int(x_zp) - 128, int(w_zp)
        acc = d[:rows, :ocg] - zb * d[:rows, ocg:ocg + 1] - za * d[rows:rows + 1, :ocg] + k * za * zb
        out[:, g * ocg:(g + 1) * ocg] = acc.reshape(2, oh, ow, ocg).transpose(0, 3, 1, 2)
    node = onnx.helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2],
                                 group=group)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", TensorProto.UINT8, x.shape)],
        [onnx.helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(np.array(x_zp), "xz"),
         onnx.numpy_helper.from_array(np.array(w_zp), "wz")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = 8
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(out, expected)


# ---- the CUDA C ---------------------------------------------------------------------------------

_CTYPES = {"int32": "int", "int64": "long long", "float32": "float", "int8": "signed char", "uint8": "unsigned char"}


def _wrapped(name: str, in_params: str, out_params: str, body: str, variant: int) -> str:
    """One ElementwiseKernel body as a plain CUDA kernel: raw inputs as pointers, the others as
    values, outputs as references to element i (what CuPy generates, minus its CArray)."""
    generic = "float" if variant == 0 else "unsigned char"
    small = "unsigned char" if variant == 0 else "signed char"
    args, refs = ["long long n"], []
    for spec in in_params.split(","):
        words = spec.split()
        raw = words[0] == "raw"
        ctype, pname = (words[1], words[2]) if raw else (words[0], words[1])
        args.append(f"const {_CTYPES.get(ctype, ctype)}{'*' if raw else ''} {pname}")
    for spec in out_params.split(","):
        ctype, pname = spec.split()
        args.append(f"{_CTYPES.get(ctype, ctype)}* {pname}_out")
        refs.append(f"{_CTYPES.get(ctype, ctype)}& {pname} = {pname}_out[i];")
    return (f"namespace {name}_{variant} {{\ntypedef {generic} T;\ntypedef {small} A;\ntypedef {small} B;\n"
            f"typedef {small} Y;\n__global__ void kernel({', '.join(args)}) {{\n"
            f"for (ptrdiff_t i = blockIdx.x * (ptrdiff_t)blockDim.x + threadIdx.x; i < n; "
            f"i += (ptrdiff_t)gridDim.x * blockDim.x) {{\n{' '.join(refs)}\n{body}\n}}\n}}\n}}\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: cannot compile the CUDA C")
def test_kernel_bodies_compile_with_nvcc(tmp_path):
    source = "#include <cstddef>\n" + quant_gemm.PREAMBLE + "".join(
        _wrapped(name, *spec, variant) for name, spec in quant_gemm.SOURCES.items() for variant in (0, 1))
    path = tmp_path / "quant.cu"
    path.write_text(source)
    proc = subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "-o", str(tmp_path / "quant.ptx"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ptx = (tmp_path / "quant.ptx").read_text()
    # every float operation is an explicit round-to-nearest one: no fused multiply-add in the kernels
    assert not re.search(r"\bfma\.rn\.f32\b", ptx)
    assert ptx.count(".entry") == 2 * len(quant_gemm.SOURCES)
