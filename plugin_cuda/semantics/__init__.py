"""ONNX op semantics of the CUDA plugin, in one place: attribute parsing (attributes.py), shape
rules (shapes.py) and the GELU constants (gelu.py), shared by the per-node kernels
(plugin_cuda/kernels) and the compiled plan's lowering (plugin_cuda/plan). Pure Python and NumPy."""

from plugin_cuda.semantics.attributes import Attributes
from plugin_cuda.semantics.errors import OpError
from plugin_cuda.semantics.gelu import GELU_CUDA, GELU_TANH_COEFF, SQRT_2_OVER_PI, SQRT_HALF

__all__ = ["GELU_CUDA", "GELU_TANH_COEFF", "SQRT_2_OVER_PI", "SQRT_HALF", "Attributes", "OpError"]
