"""ONNX kernels of the CUDA plugin, in CuPy, registered in one table.

Importing this package needs neither CuPy nor a GPU: kernels resolve CuPy objects when they are
built or run, so a machine without CUDA can load the plugin and report zero devices.
"""

from __future__ import annotations

# Each op module registers its kernels with @register when imported: the explicit list below is
# the whole registration (no scanning).
from . import (  # noqa: F401
    attention,
    conv,
    conv_transpose,
    elementwise,
    fused,
    indexing,
    linalg,
    nn,
    quant,
    quant_conv,
    quant_ms,
    reduce,
    rnn,
    shape,
)
from .base import (
    EPHOST_DOMAIN,
    KERNELS,
    MS_DOMAIN,
    CudaKernel,
    UnsupportedOpError,
    claimable,
    lookup,
    register,
    supported_ops,
)

__all__ = ["EPHOST_DOMAIN", "KERNELS", "MS_DOMAIN", "CudaKernel", "UnsupportedOpError", "claimable", "lookup", "register", "supported_ops"]
