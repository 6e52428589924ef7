"""What InferenceSession calls: `prepare` before partitioning, `expand_unclaimed` after claiming."""

from __future__ import annotations

import onnx

from host.errors import EphostError, InvalidArgument
from host.optimizer.levels import GraphOptimizationLevel, as_level
from host.optimizer.quick import nothing_to_do
from host.optimizer.result import OptimizeResult
from host.runtime.warn import warn_caller

# The opsets the session loads (host/runtime/model.py); outside them the session reports the model.
MIN_OPSET, MAX_OPSET = 1, onnx.defs.onnx_opset_version()


def _default_opset(proto: onnx.ModelProto) -> int | None:
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return None


def _loadable(proto: onnx.ModelProto) -> bool:
    """Whether the session would accept the model as it is; others go through unchanged so the
    session's loader reports what is wrong with them, not the optimizer."""
    from host.runtime.model import check_text, check_weights, typed_inputs

    opset = _default_opset(proto)
    if opset is None or not MIN_OPSET <= opset <= MAX_OPSET:
        return False
    try:
        check_text(proto)  # a name that is not UTF-8 passes the checker but fails onnx-ir's serializer
        check_weights(proto.graph)
        onnx.checker.check_model(typed_inputs(proto))  # without serialising the weights
    except Exception:  # noqa: BLE001 - the loader turns the same failure into a ModelError
        return False
    return True


def prepare(model, level, optimized_model_filepath: str = "", *,
            cache: bool = True) -> tuple[object, OptimizeResult | None]:
    """The model the session partitions, and the optimizer's result (None when it did not run).

    `model` is what the session was given (path, bytes or ModelProto). A failure inside the
    optimizer (an onnxscript bug on some export) is a warning, and the model runs unoptimized.
    With `cache`, a model optimized before at this level is read back from the optimized-model cache
    (host/optimizer/cache.py) instead of optimized again.
    """
    level = as_level(level)
    if level == GraphOptimizationLevel.ORT_DISABLE_ALL and not optimized_model_filepath:
        return model, None
    from host.runtime.model import load_model

    proto = load_model(model)
    if cache and level != GraphOptimizationLevel.ORT_DISABLE_ALL:
        from host.optimizer.cache import optimize_cached

        result = optimize_cached(proto, level, _optimize)
    else:
        result = _optimize(proto, level)
    if result is None:
        return proto, None
    if optimized_model_filepath:
        save(result.model, optimized_model_filepath)
    return result.model, result


def _optimize(proto: onnx.ModelProto, level: GraphOptimizationLevel) -> OptimizeResult | None:
    """The optimizer's result for a loaded model; None when the model is left as it is (one the
    session's loader will refuse, or a failure inside the optimizer, which is a warning)."""
    if not _loadable(proto):
        return None
    # What optimize() returns for these, without importing onnxscript and onnx-ir.
    if level == GraphOptimizationLevel.ORT_DISABLE_ALL or nothing_to_do(proto):
        count = len(proto.graph.node)
        result = OptimizeResult(proto, level, [], count, count)
    else:
        result = _run_optimizer(proto, level)
        if result is None:
            return None
    result.source_opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
    return result


def _run_optimizer(proto: onnx.ModelProto, level: GraphOptimizationLevel) -> OptimizeResult | None:
    from host.optimizer.pipeline import optimize  # onnxscript and onnx-ir: about 0.1 s to import

    try:
        return optimize(proto, level)
    except EphostError:
        raise
    except Exception as exc:  # noqa: BLE001 - optimization must never make a model unrunnable
        warn_caller(f"graph optimization failed ({type(exc).__name__}: {exc}); the model runs unoptimized")
        return None


def save(model: onnx.ModelProto, path) -> None:
    """Write the optimized model (as onnxruntime does for optimized_model_filepath)."""
    from host.runtime.model import save_model

    try:
        save_model(model, path)
    except OSError as exc:
        raise InvalidArgument(f"optimized_model_filepath '{path}': cannot write the optimized model ({exc}); "
                              "expected a writable file path") from exc
