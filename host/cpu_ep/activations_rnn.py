"""The activation functions of ONNX's recurrent layers (RNN, GRU, LSTM), with onnxruntime's parameters.

An `activations` attribute names one function per gate function and direction; `activation_alpha` and
`activation_beta` are consumed in that order, only by the functions that take them (Affine, LeakyRelu,
ThresholdedRelu, ScaledTanh, HardSigmoid, Elu). A function left without a value takes onnxruntime's
default: LeakyRelu alpha 0.01, HardSigmoid 0.2 / 0.5, Elu 1.0, and 0 for every other parameter
(onnxruntime's rnn_helpers; ONNX leaves them unspecified). Names match without regard to case, as in
onnxruntime.

Each function returns a new array and never writes into its argument, a strided view of the gate
block: NumPy 2.4's in-place unary loops (np.negative(v, out=v), np.exp...) can read the wrong elements
of a view such as gates[..., 0:1] (one hidden unit), so in-place work happens only on fresh arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from host.cpu_ep.ops_elementwise import sigmoid_inplace


def _relu(x, a, b):
    return np.maximum(x, 0)


def _tanh(x, a, b):
    return np.tanh(x)


def _sigmoid(x, a, b):
    return sigmoid_inplace(np.array(x))  # np.array: a fresh C-contiguous copy to work in


def _affine(x, a, b):
    y = x * a
    y += b
    return y


def _leaky_relu(x, a, b):
    return np.where(x < 0, x * a, x)


def _thresholded_relu(x, a, b):
    # onnxruntime keeps x where x > alpha (ONNX writes >=; they differ only at x == alpha).
    return np.where(x > a, x, 0)


def _scaled_tanh(x, a, b):
    y = x * b
    np.tanh(y, out=y)
    y *= a
    return y


def _hard_sigmoid(x, a, b):
    y = x * a
    y += b
    return np.clip(y, 0, 1, out=y)


def _elu(x, a, b):
    return np.where(x < 0, np.expm1(x) * a, x)


def _softsign(x, a, b):
    return x / (np.abs(x) + 1)


def _softplus(x, a, b):
    return np.logaddexp(0, x)  # log(1 + e^x) without overflow


# lower-case name -> (function, takes alpha, takes beta, default alpha, default beta)
_FUNCTIONS: dict[str, tuple[Callable, bool, bool, float, float]] = {
    "relu": (_relu, False, False, 0.0, 0.0),
    "tanh": (_tanh, False, False, 0.0, 0.0),
    "sigmoid": (_sigmoid, False, False, 0.0, 0.0),
    "affine": (_affine, True, True, 0.0, 0.0),
    "leakyrelu": (_leaky_relu, True, False, 0.01, 0.0),
    "thresholdedrelu": (_thresholded_relu, True, False, 0.0, 0.0),
    "scaledtanh": (_scaled_tanh, True, True, 0.0, 0.0),
    "hardsigmoid": (_hard_sigmoid, True, True, 0.2, 0.5),
    "elu": (_elu, True, False, 1.0, 0.0),
    "softsign": (_softsign, False, False, 0.0, 0.0),
    "softplus": (_softplus, False, False, 0.0, 0.0),
}
NAMES = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid",
         "Elu", "Softsign", "Softplus")


@dataclass(frozen=True)
class Activation:
    """One activation function with its parameters; calling it returns a new array."""

    name: str  # lower case
    alpha: float = 0.0
    beta: float = 0.0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return _FUNCTIONS[self.name][0](x, self.alpha, self.beta)


def parse_activations(names: list[str], alphas: list[float], betas: list[float]) -> list[Activation]:
    """The Activation of each name, taking alphas and betas in order; ValueError for an unknown name."""
    alpha_iter, beta_iter = iter(alphas), iter(betas)
    out = []
    for name in names:
        entry = _FUNCTIONS.get(str(name).lower())
        if entry is None:
            raise ValueError(f"activation {name!r} is not one of {', '.join(NAMES)}")
        _, takes_alpha, takes_beta, alpha, beta = entry
        if takes_alpha:
            alpha = float(next(alpha_iter, alpha))
        if takes_beta:
            beta = float(next(beta_iter, beta))
        out.append(Activation(str(name).lower(), alpha, beta))
    return out


def apply(fns: tuple[Activation, ...], x: np.ndarray) -> np.ndarray:
    """The functions `fns` (one, or one per direction along x's first axis) applied to x, as a new array."""
    if len(fns) == 1:
        return fns[0](x)
    out = np.empty(x.shape, dtype=x.dtype)
    for d, fn in enumerate(fns):
        out[d] = fn(x[d])
    return out
