"""IOBinding: a session's inputs and outputs bound to fixed buffers, shaped like onnxruntime's."""

from __future__ import annotations

import itertools

import numpy as np

import abi
from abi.dtypes import to_onnx
from host.errors import InvalidArgument
from host.runtime.ortvalue import OrtValue, host_array_at
from host.runtime.tensor import DeviceTensor, as_device_tensor, tensor_from_pointer

_BINDING_SERIALS = itertools.count(1)


class IOBinding:
    """Inputs and outputs bound to fixed buffers (NumPy arrays, device buffers, DLPack objects)."""

    def __init__(self, session):
        self.session = session
        self.inputs: dict[str, object] = {}
        self.outputs: dict[str, object] = {}
        self._results: dict[str, object] = {}
        self._host_outputs: set[str] = set()  # bound with device_type='cpu' and no buffer
        self.version = 0  # bumped by every bind/clear: replay re-checks buffers only when it moved
        self.serial = next(_BINDING_SERIALS)  # unlike id(), never reused by a later binding

    def bind_input(self, name: str, value=None, device_id: int = 0, element_type=None, shape=None,
                   buffer_ptr: int | None = None, *, device_type: str | None = None) -> None:
        """Bind an array-like, or a device buffer given as (element_type, shape, buffer_ptr).

        onnxruntime's positional form `bind_input(name, device_type, device_id, element_type, shape,
        buffer_ptr)` works too: a string in place of the value is the device type.
        """
        if isinstance(value, str):
            device_type, value = value, None
        metas = self.session.input_metas
        if name not in metas:
            raise InvalidArgument(f"unknown input name {name!r}; model inputs: {sorted(metas)}")
        value = self._value(name, value, device_type, device_id, element_type, shape, buffer_ptr)
        self.inputs[name] = self.session.check_feed(metas[name], value)
        self.version += 1

    def bind_output(self, name: str, value=None, device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None, *, device_type: str | None = None) -> None:
        """Bind an output to a buffer; with no buffer, the EP allocates it on each run.

        onnxruntime's positional form `bind_output(name, device_type='cpu', device_id, element_type,
        shape, buffer_ptr)` works too; `device_type='cpu'` with no buffer hands the output back in
        host memory.
        """
        if isinstance(value, str):
            device_type, value = value, None
        if name not in self.session.plan.output_ids:
            raise InvalidArgument(f"unknown output name {name!r}; model outputs: "
                                  f"{sorted(self.session.plan.output_ids)}")
        self.version += 1
        if device_type == "cpu" and value is None and buffer_ptr is None:
            self._host_outputs.add(name)
        else:
            self._host_outputs.discard(name)
        if value is None and buffer_ptr is None:
            self.outputs[name] = None
            return
        self.outputs[name] = self._value(name, value, device_type, device_id, element_type, shape, buffer_ptr)

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        """Bind a host array (NumPy or array-like) to input `name`."""
        self.bind_input(name, np.asarray(arr_on_cpu))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self.bind_input(name, _ortvalue(ortvalue, "bind_ortvalue_input"))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Bind output `name` to the memory of `ortvalue`, which the run fills."""
        self.bind_output(name, _ortvalue(ortvalue, "bind_ortvalue_output"))

    @staticmethod
    def _value(name, value, device_type, device_id, element_type, shape, buffer_ptr):
        if isinstance(value, OrtValue):
            value = value.value
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InvalidArgument(f"binding {name!r} by pointer needs element_type and shape")
            if device_type == "cpu":
                return host_array_at(int(buffer_ptr), tuple(shape), element_type)
            if device_type not in ("cuda", "gpu"):
                raise InvalidArgument(f"binding {name!r} by pointer: device_type must be 'cuda'; got "
                                      f"{device_type!r} (bind host memory as a NumPy array)")
            return tensor_from_pointer(int(buffer_ptr), tuple(shape), to_onnx(np.dtype(element_type)),
                                       abi.DEVICE_GPU, device_id)
        if isinstance(value, (DeviceTensor, np.ndarray)):
            return value
        dev = as_device_tensor(value)
        if dev is not None:
            return dev
        if hasattr(value, "__dlpack__"):
            return np.from_dlpack(value)
        return np.asarray(value)

    def output_names(self) -> list[str]:
        return list(self.outputs) or [v.name for v in self.session.graph.outputs]

    def get_outputs(self) -> list[OrtValue]:
        """Outputs of the last run as OrtValues (over NumPy arrays or DeviceTensors)."""
        to_host = self.session.executor.to_host
        return [OrtValue(v, to_host) for v in self.get_output_values()]

    def get_output_values(self) -> list:
        """Outputs of the last run: NumPy arrays for host memory, DeviceTensors for device memory."""
        names = self.output_names()
        missing = [n for n in names if n not in self._results]
        if missing:
            if not self._results:
                raise InvalidArgument("IOBinding has no outputs yet: call run_with_iobinding(binding) before "
                                      "get_outputs()")
            raise InvalidArgument(f"output(s) {missing} were bound after the last run_with_iobinding(); "
                                  "run again before get_outputs()")
        values = [self._results[n] for n in names]
        if self._host_outputs:
            to_host = self.session.executor.to_host
            values = [to_host(v) if n in self._host_outputs else v for n, v in zip(names, values)]
        return values

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        ex = self.session.executor
        return [np.array(ex.to_host(v)) for v in self.get_output_values()]

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()
        self.version += 1

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()
        self.version += 1


def _ortvalue(value, where: str):
    if not isinstance(value, OrtValue):
        raise InvalidArgument(f"{where} needs an OrtValue; got {type(value).__name__} (use OrtValue.ortvalue_from_numpy)")
    return value.value


__all__ = ["IOBinding"]
