"""A served model's signature: input and output specs, its batch axis, and per-request checks.

Built from the backend's NodeArgs (ephost's and onnxruntime's look alike), so the checks a request
passes before it joins a batch are the same for both backends. A request that fails them gets an
InvalidArgument (HTTP 400) and never reaches a batch, so one bad request cannot fail its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host.errors import InvalidArgument
from host.serving import datatypes

# How the batch axis (axis 0 of every input and output) behaves: symbolic on all of them, one static
# size on all of them, or neither (requests then run one by one).
DYNAMIC, STATIC, UNBATCHED = "dynamic", "static", "unbatched"


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: name, dtype and shape (ints, symbolic names or None; None = unknown rank)."""

    name: str
    dtype: np.dtype
    shape: tuple | None

    @property
    def datatype(self) -> str:
        return datatypes.to_kserve(self.dtype)

    def metadata_shape(self) -> list[int]:
        """The shape as the KServe metadata writes it: -1 for a dimension that is not fixed."""
        return [d if isinstance(d, int) and d >= 0 else -1 for d in (self.shape or ())]

    def batch_dim(self):
        return self.shape[0] if self.shape else None


def _spec(node_arg) -> TensorSpec:
    shape = None if node_arg.shape is None else tuple(node_arg.shape)
    return TensorSpec(node_arg.name, datatypes.from_type_string(node_arg.type), shape)


def _batch_axis(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> tuple[str, int | None]:
    specs = inputs + outputs
    if not inputs or any(not s.shape for s in specs):  # unknown rank or scalars: no axis to join on
        return UNBATCHED, None
    dims = [s.batch_dim() for s in specs]
    if all(not isinstance(d, int) for d in dims):
        return DYNAMIC, None
    if all(isinstance(d, int) for d in dims) and len(set(dims)) == 1 and dims[0] > 0:
        return STATIC, dims[0]
    return UNBATCHED, None


@dataclass(frozen=True)
class Signature:
    """What a served model takes and returns, and how requests to it can be joined."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_kind: str
    static_batch: int | None

    @classmethod
    def from_session(cls, session) -> Signature:
        """From anything with get_inputs()/get_outputs() returning NodeArgs (ephost or onnxruntime)."""
        inputs = tuple(_spec(a) for a in session.get_inputs())
        outputs = tuple(_spec(a) for a in session.get_outputs())
        kind, size = _batch_axis(inputs, outputs)
        return cls(inputs, outputs, kind, size)

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    def check(self, feeds: dict[str, np.ndarray], pad_static: bool) -> int:
        """Validate one request's feeds; return its row count (its size on the batch axis, 1 if unbatched).

        `pad_static`: a static-batch model pads requests up to its batch, so fewer rows are allowed.
        """
        by_name = {s.name: s for s in self.inputs}
        unknown = sorted(set(feeds) - set(by_name))
        if unknown:
            raise InvalidArgument(f"unknown input name(s) {unknown}; model inputs: {sorted(by_name)}")
        missing = sorted(set(by_name) - set(feeds))
        if missing:
            raise InvalidArgument(f"missing input(s) {missing}; model inputs: {sorted(by_name)}")
        for name, value in feeds.items():
            _check_tensor(by_name[name], value, skip_batch=self.batch_kind == STATIC and pad_static)
        return self._rows(feeds, pad_static)

    def _rows(self, feeds: dict[str, np.ndarray], pad_static: bool) -> int:
        if self.batch_kind == UNBATCHED:
            return 1
        rows = {name: value.shape[0] for name, value in feeds.items()}
        if len(set(rows.values())) != 1:
            raise InvalidArgument(f"inputs disagree on the batch dimension (axis 0): {rows}; "
                                  f"every input of a request must have the same size there")
        count = next(iter(rows.values()))
        if self.batch_kind == STATIC and pad_static and not 1 <= count <= self.static_batch:
            raise InvalidArgument(f"batch dimension (axis 0) is {count}; this model's batch is fixed at "
                                  f"{self.static_batch}, so a request may carry 1..{self.static_batch} rows")
        return count


def _check_tensor(spec: TensorSpec, value: np.ndarray, skip_batch: bool) -> None:
    if spec.dtype != np.dtype(object) and value.dtype != spec.dtype:
        raise InvalidArgument(f"input '{spec.name}': expected datatype {spec.datatype} ({spec.dtype}), "
                              f"got {datatypes.to_kserve(value.dtype)} ({value.dtype})")
    if spec.shape is None:
        return
    if value.ndim != len(spec.shape):
        raise InvalidArgument(f"input '{spec.name}': expected rank {len(spec.shape)} (shape "
                              f"{spec.metadata_shape()}), got rank {value.ndim} (shape {list(value.shape)})")
    for axis, (want, got) in enumerate(zip(spec.shape, value.shape)):
        if skip_batch and axis == 0:
            continue
        if isinstance(want, int) and want >= 0 and want != got:
            raise InvalidArgument(f"input '{spec.name}': dimension {axis} must be {want}, got {got} "
                                  f"(expected shape {spec.metadata_shape()}, -1 = any; got {list(value.shape)})")
