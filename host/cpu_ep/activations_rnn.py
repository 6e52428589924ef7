"""The activation functions of ONNX's recurrent layers (RNN, GRU, LSTM), with onnxruntime's parameters.

An `activations` attribute names one function per gate function and direction; `activation_alpha` and
`activation_beta` are consumed in that order, only by the functions that take them (Affine, LeakyRelu,
ThresholdedRelu, ScaledTanh, HardSigmoid, Elu). A function left without a value takes onnxruntime's
default: LeakyRelu alpha 0.01, HardSigmoid 0.2 / 0.5, Elu 1.0, and 0 for every other parameter
(onnxruntime's rnn_helpers; ONNX leaves them unspecified). Names match without regard to case, as in
onnxruntime. Each function works in place on an array the recurrence owns (a fresh gate block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from host.cpu_ep.ops_elementwise import sigmoid_inplace


def _relu(x, a, b):
    return np.maximum(x, 0, out=x)


def _tanh(x, a, b):
    return np.tanh(x, out=x)


def _sigmoid(x, a, b):
    return sigmoid_inplace(x)


def _affine(x, a, b):
    x *= a
    x += b
    return x


def _leaky_relu(x, a, b):
    return np.multiply(x, a, out=x, where=x < 0)


def _thresholded_relu(x, a, b):
    # onnxruntime keeps x where x > alpha (ONNX writes >=; they differ only at x == alpha).
    np.copyto(x, 0, where=x <= a)
    return x


def _scaled_tanh(x, a, b):
    x *= b
    np.tanh(x, out=x)
    x *= a
    return x


def _hard_sigmoid(x, a, b):
    x *= a
    x += b
    return np.clip(x, 0, 1, out=x)


def _elu(x, a, b):
    neg = np.expm1(x)
    neg *= a
    np.copyto(x, neg, where=x < 0)
    return x


def _softsign(x, a, b):
    return np.divide(x, np.abs(x) + 1, out=x)


def _softplus(x, a, b):
    return np.logaddexp(0, x, out=x)  # log(1 + e^x) without overflow


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
    """One activation function with its parameters; calling it overwrites its argument."""

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
    """Applies per direction the functions `fns` (one, or one per direction along x's first axis) to x in
    place; returns x."""
    if len(fns) == 1:
        fns[0](x)
    else:
        for d, fn in enumerate(fns):
            fn(x[d])
    return x
