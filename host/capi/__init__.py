"""onnxruntime's `capi` package path, so `ort.capi.onnxruntime_pybind11_state.Fail` style code runs."""

from host.capi import onnxruntime_pybind11_state

__all__ = ["onnxruntime_pybind11_state"]
