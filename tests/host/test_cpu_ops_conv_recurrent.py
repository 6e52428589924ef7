"""CPU EP Conv fast paths (pointwise, depthwise either copy order, im2col with groups and batches), the
recurrent layers (RNN, GRU, LSTM) and ConvTranspose against onnx.reference.ReferenceEvaluator. The
attribute-by-attribute checks against onnxruntime are in test_cpu_rnn.py and test_cpu_conv_transpose.py;
the fast paths' own tests (taken or not, per input) in test_cpu_speed_paths.py."""

from __future__ import annotations

import pytest

from tests.host.test_cpu_ops import SUM_TOL, case, check_reference, f32

# Conv's fast paths (ops_nn.Conv._plan): pointwise, depthwise with the (taps, pixels) or the (pixels, taps) copy,
# im2col with groups and batches.
CONV_PATHS = [
    case("Conv", {"x": f32(2, 6, 5, 7), "w": f32(4, 6, 1, 1), "b": f32(4)}, tol=SUM_TOL, id="Conv-pointwise"),
    case("Conv", {"x": f32(1, 4, 20, 18), "w": f32(4, 1, 3, 3), "b": f32(4)}, group=4, pads=[1, 1, 1, 1],
         tol=SUM_TOL, id="Conv-depthwise-taps-pixels"),
    case("Conv", {"x": f32(2, 3, 9, 9), "w": f32(6, 1, 5, 5)}, group=3, pads=[2, 1, 2, 1], strides=[2, 1],
         tol=SUM_TOL, id="Conv-depthwise-multiplier2"),
    case("Conv", {"x": f32(1, 5, 6, 6), "w": f32(5, 1, 5, 5)}, group=5, pads=[2, 2, 2, 2], dilations=[1, 2],
         tol=SUM_TOL, id="Conv-depthwise-pixels-taps-dilated"),
    case("Conv", {"x": f32(2, 4, 9, 8), "w": f32(6, 2, 3, 3), "b": f32(6)}, group=2, strides=[2, 2],
         pads=[1, 0, 1, 1], tol=SUM_TOL, id="Conv-im2col-groups-batch2"),
    case("Conv", {"x": f32(1, 3, 16, 16), "w": f32(8, 3, 3, 3)}, strides=[2, 2], auto_pad="SAME_UPPER",
         tol=SUM_TOL, id="Conv-im2col-same-upper"),
]

# Recurrent layers and ConvTranspose (ops_rnn.py, ops_conv_transpose.py); the attribute-by-attribute checks
# against onnxruntime are in test_cpu_rnn.py and test_cpu_conv_transpose.py.
RECURRENT = [
    case("RNN", {"X": f32(3, 2, 4), "W": f32(1, 5, 4), "R": f32(1, 5, 5), "B": f32(1, 10)}, n_out=2, hidden_size=5,
         tol=SUM_TOL),
    case("GRU", {"X": f32(3, 2, 4), "W": f32(2, 9, 4), "R": f32(2, 9, 3), "B": f32(2, 18)}, n_out=2, hidden_size=3,
         direction="bidirectional", tol=SUM_TOL),
    case("LSTM", {"X": f32(3, 2, 4), "W": f32(1, 12, 4), "R": f32(1, 12, 3), "B": f32(1, 24)}, n_out=3,
         hidden_size=3, tol=SUM_TOL),
    # group 1: onnx's reference ConvTranspose fails on groups (test_cpu_conv_transpose.py checks them)
    case("ConvTranspose", {"x": f32(2, 4, 5, 6), "w": f32(4, 3, 3, 2), "b": f32(3)}, strides=[2, 1],
         pads=[1, 0, 0, 1], tol=SUM_TOL),
]


CASES = CONV_PATHS + RECURRENT


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)
