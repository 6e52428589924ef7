"""CPU EP Resize against onnx.reference.ReferenceEvaluator and onnxruntime: every mode, coordinate
transformation, nearest mode, sizes with axes and aspect policies, antialias, tf_crop_and_resize, opset 10;
an unknown mode's error; random sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from host.errors import ModelError
from tests.host.test_cpu_ops import (
    SUM_TOL,
    case,
    check_onnxruntime,
    check_reference,
    f32,
    ours,
    reference,
)


def _resize(x, scales=None, sizes=None, roi=None, opset=19, **attrs):
    inputs = {"x": x, "roi": roi, "scales": scales, "sizes": sizes}
    tid = "Resize-" + "-".join(f"{k}={v}" for k, v in attrs.items()) + ("-sizes" if sizes is not None else "")
    return case("Resize", inputs, opset=opset, tol=SUM_TOL, id=tid, **attrs)


_IMG = f32(1, 2, 4, 5)
_UP = np.array([1, 1, 2, 1.5], np.float32)
_DOWN = np.array([1, 1, 0.6, 0.8], np.float32)
RESIZE = [
    _resize(_IMG, _UP, mode="nearest"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="floor", coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="ceil", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="round_prefer_ceil",
            coordinate_transformation_mode="half_pixel"),
    _resize(_IMG, _DOWN, mode="nearest"),
    _resize(_IMG, _UP, mode="linear"),
    _resize(_IMG, _DOWN, mode="linear"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _DOWN, mode="linear", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, _UP, mode="cubic"),
    _resize(_IMG, _DOWN, mode="cubic", exclude_outside=1),
    _resize(_IMG, _UP, mode="cubic", cubic_coeff_a=-0.5, coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, sizes=np.array([1, 2, 7, 3], np.int64), mode="linear"),
    _resize(_IMG, sizes=np.array([7, 8], np.int64), mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
    _resize(_IMG, sizes=np.array([7, 8], np.int64), mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_smaller"),
    _resize(f32(1, 1, 9, 11), np.array([1, 1, 0.4, 0.7], np.float32), mode="linear", antialias=1),
    _resize(f32(1, 1, 9, 11), np.array([1, 1, 0.4, 1.5], np.float32), mode="cubic", antialias=1),
    _resize(f32(1, 1, 9, 11), sizes=np.array([1, 1, 3, 4], np.int64), mode="cubic", antialias=1, exclude_outside=1),
    _resize(_IMG, np.array([1, 1, 0.8, 1.2], np.float32), roi=np.array([0, 0, 0.2, 0.1, 1, 1, 1.1, 0.9], np.float32),
            mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-3.0),
]
# Resize-10 takes (X, scales); onnx's reference fails on that form, so only onnxruntime checks it.
RESIZE_10 = case("Resize", {"x": _IMG, "scales": np.array([1, 1, 2, 3], np.float32)}, opset=10, mode="nearest",
                 id="Resize-opset10")

CASES = RESIZE


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)


# onnxruntime as a second reference on the three modes with their defaults, and on the opset 10 form.
ORT_CASES = [p for p in RESIZE if p.id in ("Resize-mode=linear", "Resize-mode=nearest", "Resize-mode=cubic")]
ORT_CASES.append(RESIZE_10)


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), ORT_CASES)
def test_matches_onnxruntime(node, feeds, opset, tol):
    check_onnxruntime(node, feeds, opset, tol)


def test_resize_rejects_an_unknown_mode():
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], name="rs", mode="bilinear")
    with pytest.raises(ModelError, match=r"^node 'rs' \(Resize\): attribute 'mode' is 'bilinear'; allowed: one of "
                                         r"'nearest', 'linear', 'cubic'$"):
        ours(node, {"x": f32(1, 1, 4, 4), "s": np.array([1, 1, 0.5, 0.5], np.float32)}, 19)




@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(1, 7), st.sampled_from(["nearest", "linear", "cubic"]),
       st.sampled_from(["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_resize_random(h, w, out_h, mode, coord, antialias, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((1, 1, h, w)).astype(np.float32)
    sizes = np.array([1, 1, out_h, int(r.integers(1, 9))], np.int64)
    extra = {"antialias": 1} if antialias and mode != "nearest" else {}
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="rs", mode=mode,
                            coordinate_transformation_mode=coord, **extra)
    feeds = {"x": x, "sizes": sizes}
    (want,) = reference(node, feeds, 19)
    (got,) = ours(node, feeds, 19)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


