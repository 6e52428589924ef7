"""CPU EP math kernels added for real exports (HardSwish, Mish, IsInf, Mod, Pow with its scalar-exponent
shortcuts, Einsum) against onnx.reference.ReferenceEvaluator and onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

from tests.host.test_cpu_ops import (
    SUM_TOL,
    case,
    check_onnxruntime,
    check_reference,
    f32,
)

ELEMENTWISE = [
    case("HardSwish", {"x": f32(3, 5, low=-5, high=5)}),
    case("Mish", {"x": f32(3, 5, low=-10, high=10)}, opset=18),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)}),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan], np.float32)}, detect_positive=0, id="IsInf-neg"),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan], np.float32)}, detect_negative=0, id="IsInf-pos"),
    case("Mod", {"a": np.array([-7, 7, -7, 7, 5], np.int64), "b": np.array([3, -3, -3, 3, 5], np.int64)}),
    case("Mod", {"a": np.array([-7, 7, -7, 7], np.int32), "b": np.array([3, -3, -3, 3], np.int32)}, fmod=1,
         id="Mod-fmod-int"),
    case("Mod", {"a": f32(3, 4, low=-9, high=9), "b": f32(4, low=1, high=3)}, fmod=1, id="Mod-fmod-float"),
    # Pow by a scalar 2, 3, 0.5 or 1 takes products / sqrt (ops_elementwise.Pow); 1.5 and a (1, 1) exponent do not.
    case("Pow", {"a": f32(3, 4), "b": np.array(2.0, np.float32)}, id="Pow-square"),
    case("Pow", {"a": f32(3, 4), "b": np.array([3.0], np.float32)}, id="Pow-cube"),
    case("Pow", {"a": f32(3, 4, low=0.1, high=4), "b": np.array(0.5, np.float32)}, id="Pow-sqrt"),
    case("Pow", {"a": f32(3, 4), "b": np.array(1, np.int64)}, id="Pow-one-int"),
    case("Pow", {"a": f32(3, 4, low=0.1, high=4), "b": np.array(1.5, np.float32)}, id="Pow-1.5"),
    case("Pow", {"a": f32(4), "b": np.array([[2.0]], np.float32)}, id="Pow-square-broadcast-up"),
    case("Einsum", {"a": f32(2, 3, 4), "b": f32(2, 4, 5)}, equation="bij,bjk->bik", tol=SUM_TOL),
    case("Einsum", {"a": f32(3, 4)}, equation="ij->ji", id="Einsum-transpose"),
    case("Einsum", {"a": f32(3, 3)}, equation="ii", id="Einsum-trace-implicit"),
    case("Einsum", {"a": f32(2, 3, 4), "b": f32(4, 5), "c": f32(5)}, equation="...j,jk,k->...", tol=SUM_TOL,
         id="Einsum-ellipsis-3"),
]


CASES = ORT_CASES = ELEMENTWISE


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), ORT_CASES)
def test_matches_onnxruntime(node, feeds, opset, tol):
    check_onnxruntime(node, feeds, opset, tol)
