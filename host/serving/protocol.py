"""The KServe v2 / Triton inference protocol's tensor forms: decode requests, encode answers.

JSON: `{"id": ..., "inputs": [{"name", "shape", "datatype", "data"}], "outputs": [{"name"}]}`, or
`"inputs"` as a dict `{name: {"shape", "datatype", "data"}}`; the answer is
`{"model_name", "id", "outputs": [{"name", "shape", "datatype", "data"}], "parameters"}`.
Binary: a body written by `numpy.savez` (Content-Type `application/x-npz`) answered the same way.
Everything wrong with a body is an InvalidArgument, which the deployment answers with HTTP 400.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass

import numpy as np

from host.errors import InvalidArgument
from host.serving import datatypes
from host.serving.signature import Signature

NPZ_CONTENT_TYPE = "application/x-npz"
JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True)
class InferRequest:
    """A decoded request: its id (echoed in the answer), feeds, and the outputs asked for (None = all)."""

    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[str] | None = None


def decode_json(body: bytes) -> InferRequest:
    """A KServe v2 JSON inference request."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"request body is not valid JSON ({exc}); expected "
                              f'{{"inputs": [{{"name", "shape", "datatype", "data"}}]}}') from None
    if not isinstance(doc, dict) or "inputs" not in doc:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise InvalidArgument(f'request body must be a JSON object with "inputs"; got {got}')
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument(f'"id" must be a string; got {type(request_id).__name__}')
    return InferRequest(request_id, _decode_inputs(doc["inputs"]), _requested_outputs(doc.get("outputs")))


def _decode_inputs(inputs) -> dict[str, np.ndarray]:
    if isinstance(inputs, dict):  # the {name: tensor} form
        items = [(name, tensor) for name, tensor in inputs.items()]
    elif isinstance(inputs, list):
        items = [(_name_of(tensor), tensor) for tensor in inputs]
    else:
        raise InvalidArgument(f'"inputs" must be a list of tensors or a dict of name to tensor; '
                              f"got {type(inputs).__name__}")
    feeds: dict[str, np.ndarray] = {}
    for name, tensor in items:
        if name in feeds:
            raise InvalidArgument(f"input '{name}' is given twice; each input once")
        feeds[name] = decode_tensor(name, tensor)
    return feeds


def _name_of(tensor) -> str:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise InvalidArgument(f'each entry of "inputs" must be an object with a string "name"; got {tensor!r:.80}')
    return tensor["name"]


def decode_tensor(name: str, tensor) -> np.ndarray:
    """One `{"shape", "datatype", "data"}` object as an array ("data" flat in row-major order, or nested)."""
    if not isinstance(tensor, dict):
        raise InvalidArgument(f"input '{name}': expected an object with shape, datatype and data; "
                              f"got {type(tensor).__name__}")
    absent = [k for k in ("shape", "datatype", "data") if k not in tensor]
    if absent:
        raise InvalidArgument(f"input '{name}': missing {absent}; a tensor has shape, datatype and data")
    shape = tensor["shape"]
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise InvalidArgument(f"input '{name}': shape must be a list of non-negative ints; got {shape!r}")
    dtype = datatypes.to_numpy(tensor["datatype"])
    try:
        flat = np.asarray(tensor["data"], dtype=dtype).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"input '{name}': data cannot be read as {tensor['datatype']} ({exc})") from None
    count = int(np.prod(shape, dtype=np.int64))
    if flat.size != count:
        raise InvalidArgument(f"input '{name}': shape {shape} holds {count} elements; data has {flat.size}")
    return flat.reshape(shape)


def _requested_outputs(outputs) -> list[str] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise InvalidArgument(f'"outputs" must be a list of objects with a string "name"; got {outputs!r:.80}')
    return [o["name"] for o in outputs]


def decode_npz(body: bytes) -> dict[str, np.ndarray]:
    """A `numpy.savez` archive of the inputs, by name (no pickled objects)."""
    try:
        archive = np.load(io.BytesIO(body), allow_pickle=False)
        if isinstance(archive, np.lib.npyio.NpzFile):
            with archive:
                return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidArgument(f"request body is not a readable .npz archive ({type(exc).__name__}: {exc}); "
                              f"expected numpy.savez(file, name=array, ...) with Content-Type "
                              f"{NPZ_CONTENT_TYPE}") from None
    raise InvalidArgument("request body is a single .npy array; expected an .npz archive "
                          "(numpy.savez(file, name=array, ...)) naming each input")


def encode_npz(names: list[str], values: list[np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **dict(zip(names, values)))
    return buffer.getvalue()


def select_outputs(signature: Signature, wanted: list[str] | None) -> list[int]:
    """Indexes of the requested outputs in the model's output order (all when none are named)."""
    names = signature.output_names
    if wanted is None:
        return list(range(len(names)))
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise InvalidArgument(f"unknown output name(s) {unknown}; model outputs: {names}")
    return [names.index(n) for n in wanted]


def _json_data(value: np.ndarray) -> list:
    flat = value.reshape(-1)
    if flat.dtype.kind in "SO":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    if flat.dtype == datatypes.KSERVE_TO_NUMPY["BF16"]:
        flat = flat.astype(np.float32)  # bfloat16 scalars are not JSON numbers
    return flat.tolist()


def encode_json(model_name: str, request_id: str | None, names: list[str], values: list[np.ndarray],
                parameters: dict) -> dict:
    """The KServe v2 inference answer."""
    outputs = [{"name": name, "shape": list(value.shape), "datatype": datatypes.to_kserve(value.dtype),
                "data": _json_data(value)} for name, value in zip(names, values)]
    answer = {"model_name": model_name, "outputs": outputs, "parameters": parameters}
    if request_id is not None:
        answer["id"] = request_id
    return answer


def model_metadata(model_name: str, signature: Signature, platform: str) -> dict:
    """`GET /v2/models/<name>`: inputs and outputs with datatype and shape (-1 where not fixed)."""
    def tensors(specs):
        return [{"name": s.name, "datatype": s.datatype, "shape": s.metadata_shape()} for s in specs]

    return {"name": model_name, "versions": ["1"], "platform": platform,
            "inputs": tensors(signature.inputs), "outputs": tensors(signature.outputs)}


def error_body(exc: BaseException) -> dict:
    """KServe's error answer, with ephost's error type in front of its message."""
    return {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__}
