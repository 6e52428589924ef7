"""An `onnx.backend.base.Backend` over InferenceSession, so onnx's backend test suite can drive ephost.

    rep = EphostBackend.prepare(model)                # path, bytes or ModelProto
    outputs = rep.run([x, y])                          # positional inputs, in graph-input order
    outputs = EphostBackend.run_node(node, [x, y])     # one node, through a model built around it

`prepare` and `run_model` accept `providers=` and `env=` (and `sess_options=`) to run through plugin EPs;
without them the built-in CPU EP runs every node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from host.errors import InvalidArgument
from host.runtime.model import MAX_OPSET, MIN_OPSET
from host.runtime.session import InferenceSession

_SESSION_KWARGS = ("sess_options", "providers", "env")


def _outputs_tuple(names: Sequence[str], values: Sequence[np.ndarray]) -> tuple[Any, ...]:
    """onnx's namedtupledict: index by position or by output name (`out[0]`, `out["y"]`, `out.y`)."""
    return namedtupledict("Outputs", list(names))(*values)


def _typed_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its graph outputs typed by shape inference (the checker wants typed outputs)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 - inference raises several types
        raise InvalidArgument(f"run_node: the node's output types could not be inferred ({exc}); "
                              "pass outputs_info=[(dtype, shape), ...]") from exc
    untyped = [o.name for o in inferred.graph.output if not o.type.tensor_type.elem_type]
    if untyped:
        raise InvalidArgument(f"run_node: no type could be inferred for output(s) {untyped}; "
                              "pass outputs_info=[(dtype, shape), ...]")
    del inferred.graph.value_info[:]
    return inferred


class EphostBackendRep(BackendRep):
    """A prepared model: one InferenceSession, run with positional or named inputs."""

    def __init__(self, session: InferenceSession):
        self.session = session
        self.input_names = [a.name for a in session.get_inputs()]
        self.output_names = [a.name for a in session.get_outputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Runs the model; `inputs` is a list in graph-input order, a dict by name, or one array.

        kwargs: `output_names=` (a subset, in the order wanted) and `run_options=`.
        Returns a namedtuple of NumPy arrays that can also be indexed by output name.
        """
        feeds = self._feeds(inputs)
        output_names = list(kwargs.get("output_names") or self.output_names)
        values = self.session.run(output_names, feeds, kwargs.get("run_options"))
        return _outputs_tuple(output_names, values)

    def _feeds(self, inputs: Any) -> dict[str, Any]:
        if isinstance(inputs, Mapping):
            return dict(inputs)
        if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
            inputs = [inputs]
        if len(inputs) != len(self.input_names):
            raise InvalidArgument(f"the model has {len(self.input_names)} input(s) {self.input_names}; "
                                  f"got {len(inputs)} positional input(s)")
        return dict(zip(self.input_names, inputs))

    def close(self) -> None:
        self.session.close()


class EphostBackend(Backend):
    """The onnx backend API over ephost: the CPU EP, plus plugin EPs named through `providers=`."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        """Whether the model's default opset is one ephost loads and the device is supported.

        Cheap check only: a model that passes may still fail in `prepare` (an op no EP supports).
        """
        if not cls.supports_device(device):
            return False
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                return MIN_OPSET <= o.version <= MAX_OPSET
        return False

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> EphostBackendRep:
        """Builds an InferenceSession; model is a ModelProto, serialized bytes or a path."""
        if not cls.supports_device(device):
            raise InvalidArgument(f"device {device!r} is not supported by the ephost backend; use 'CPU' "
                                  "(plugin EPs are chosen with providers=)")
        session_kwargs = {k: kwargs[k] for k in _SESSION_KWARGS if k in kwargs}
        return EphostBackendRep(InferenceSession(model, **session_kwargs))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        rep = cls.prepare(model, device, **kwargs)
        try:
            return rep.run(inputs, **{k: v for k, v in kwargs.items() if k in ("output_names", "run_options")})
        finally:
            rep.close()

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """Runs one node, through a model built around it (onnx's default `run_node` only checks it).

        kwargs: `opset_version=` (default: the newest opset ephost loads), plus those of `prepare`.
        """
        super().run_node(node, inputs, device=device, outputs_info=outputs_info, **kwargs)
        if isinstance(inputs, Mapping):
            arrays = [np.asarray(inputs[name]) for name in node.input if name]
        else:
            arrays = [np.asarray(x) for x in inputs]
        present = [name for name in node.input if name]
        if len(arrays) != len(present):
            raise InvalidArgument(f"node '{node.name or node.op_type}' has {len(present)} input(s) "
                                  f"{present}; got {len(arrays)}")
        graph_inputs = [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                                           a.shape)
                        for name, a in zip(present, arrays)]
        output_names = [name for name in node.output if name]
        if outputs_info is not None:
            graph_outputs = [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(
                np.dtype(dtype)), shape) for name, (dtype, shape) in zip(output_names, outputs_info)]
        else:
            graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in output_names]
        opset = int(kwargs.pop("opset_version", MAX_OPSET))
        graph = onnx.helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, graph_outputs)
        opset_imports = [onnx.helper.make_opsetid("", opset)]
        if node.domain not in ("", "ai.onnx"):
            opset_imports.append(onnx.helper.make_opsetid(node.domain, 1))
        model = onnx.helper.make_model(graph, opset_imports=opset_imports)
        if outputs_info is None:
            model = _typed_outputs(model)
        return cls.run_model(model, dict(zip(present, arrays)), device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """True for the CPU (the host's device); plugin devices are reached through providers=."""
        try:
            return Device(device).type == DeviceType.CPU
        except (ValueError, KeyError, AttributeError):
            return False


prepare = EphostBackend.prepare
run_model = EphostBackend.run_model
run_node = EphostBackend.run_node
supports_device = EphostBackend.supports_device

__all__ = ["EphostBackend", "EphostBackendRep", "prepare", "run_model", "run_node", "supports_device"]
