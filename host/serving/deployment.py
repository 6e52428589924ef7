"""The Ray Serve deployment: one ephost session per replica, requests batched with `@serve.batch`.

HTTP (KServe v2 / Triton inference protocol):
    GET  /v2/health/live, /v2/health/ready       liveness, readiness
    GET  /v2/models/<name>                        metadata: inputs and outputs, datatype and shape (-1: any)
    GET  /v2/models/<name>/ready                  model readiness
    GET  /v2/models/<name>/stats                  this replica's counters (requests, batches, runs, buckets)
    POST /v2/models/<name>/infer                  JSON tensors, or an .npz body (Content-Type application/x-npz)
Bad requests are answered 400 with ephost's typed error text and never join a batch; a failing run
answers 500 for the requests it held, and the replica keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from host.errors import EphostError, InvalidArgument
from host.serving import protocol
from host.serving.backend import ModelSpec, open_session
from host.serving.batching import BatchPolicy, Piece, resolve_buckets
from host.serving.signature import Signature

# Starting values; every replica sets its deployment's own with the batch handler's setters.
_DEFAULT_MAX_BATCH = 8
_DEFAULT_WAIT_S = 0.005


class NotFound(EphostError):
    """No such route or model (HTTP 404)."""


@dataclass(frozen=True)
class Outcome:
    """What one request gets back from its batch: output values, or the error of its run."""

    values: list[np.ndarray] | None
    error: BaseException | None
    batch_requests: int
    run_rows: int


class ServedModel:
    """The replica: opens the session once, answers the protocol's routes, batches inference."""

    def __init__(self, spec: ModelSpec, model_name: str, max_batch_size: int, batch_wait_timeout_s: float,
                 buckets):
        self.name = model_name
        self.backend = spec.backend
        sizes = resolve_buckets(buckets, max_batch_size, spec.uses_gpu)
        self.session = open_session(spec, pad_batch=bool(sizes))  # the session's buckets: a graph per bucket
        self.signature = Signature.from_session(self.session)
        self.policy = BatchPolicy(self.signature, max_batch_size, sizes)
        self._infer_batch.set_max_batch_size(max_batch_size)
        self._infer_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.replica = _replica_name()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "batches": 0, "runs": 0, "padded_rows": 0, "failed_runs": 0}
        self.batch_sizes: Counter[int] = Counter()  # requests per batch -> batches
        self.run_rows: Counter[int] = Counter()     # rows per run after padding -> runs

    # -- routing ------------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except InvalidArgument as exc:
            return JSONResponse(protocol.error_body(exc), status_code=400)
        except NotFound as exc:
            return JSONResponse(protocol.error_body(exc), status_code=404)
        except EphostError as exc:
            return JSONResponse(protocol.error_body(exc), status_code=500)

    async def _route(self, request: Request) -> Response:
        parts = [p for p in _path(request).split("/") if p]
        method = request.method
        if parts[:2] == ["v2", "health"] and len(parts) == 3 and method == "GET":
            return JSONResponse({parts[2]: True})
        if parts == ["v2"] and method == "GET":
            return JSONResponse({"name": "ephost", "extensions": ["statistics", "npz"]})
        if len(parts) < 3 or parts[:2] != ["v2", "models"]:
            raise NotFound(f"no route {method} {_path(request)}; routes: /v2/health/ready, "
                           f"/v2/models/{self.name}[/ready|/stats|/infer]")
        if parts[2] != self.name:
            raise NotFound(f"model {parts[2]!r} is not served here; served: [{self.name!r}]")
        rest = parts[3:]
        if rest[:2] == ["versions", "1"]:  # /v2/models/<name>/versions/1/... is the same model
            rest = rest[2:]
        handler = {((), "GET"): self._metadata, (("ready",), "GET"): self._ready,
                   (("stats",), "GET"): self._stats, (("infer",), "POST"): self._infer}.get((tuple(rest), method))
        if handler is None:
            raise NotFound(f"no route {method} {_path(request)}")
        return await handler(request)

    async def _metadata(self, request: Request) -> Response:
        return JSONResponse(protocol.model_metadata(self.name, self.signature, f"{self.backend}_onnx"))

    async def _ready(self, request: Request) -> Response:
        return JSONResponse({"name": self.name, "ready": True})

    async def _stats(self, request: Request) -> Response:
        with self._lock:
            return JSONResponse({"model_name": self.name, "replica": self.replica, "pid": os.getpid(),
                                 "buckets": list(self.policy.buckets), **self.stats,
                                 "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                                 "run_rows": {str(k): v for k, v in sorted(self.run_rows.items())}})

    # -- inference ------------------------------------------------------------------------------------
    async def _infer(self, request: Request) -> Response:
        body = await request.body()
        binary = request.headers.get("content-type", "").split(";")[0].strip() == protocol.NPZ_CONTENT_TYPE
        if binary:
            decoded = protocol.InferRequest(request.headers.get("x-request-id"), protocol.decode_npz(body))
        else:
            decoded = protocol.decode_json(body)
        wanted = protocol.select_outputs(self.signature, decoded.outputs)
        rows = self.signature.check(decoded.feeds, pad_static=self.policy.pads_static)
        outcome = await self._infer_batch(Piece(decoded.feeds, rows))
        if outcome.error is not None:
            raise outcome.error
        names = [self.signature.output_names[i] for i in wanted]
        values = [outcome.values[i] for i in wanted]
        params = {"replica": self.replica, "batch_requests": outcome.batch_requests, "run_rows": outcome.run_rows}
        if binary:
            headers = {f"x-ephost-{k.replace('_', '-')}": str(v) for k, v in params.items()}
            if decoded.id is not None:  # Ray Serve's proxy echoes X-Request-Id itself; this one is ours
                headers["x-ephost-request-id"] = decoded.id
            return Response(protocol.encode_npz(names, values), media_type=protocol.NPZ_CONTENT_TYPE,
                            headers=headers)
        return JSONResponse(protocol.encode_json(self.name, decoded.id, names, values, params))

    @serve.batch(max_batch_size=_DEFAULT_MAX_BATCH, batch_wait_timeout_s=_DEFAULT_WAIT_S)
    async def _infer_batch(self, pieces: list[Piece]) -> list[Outcome]:
        # The session runs in a worker thread so the replica's event loop keeps taking requests
        # (and forming the next batch) meanwhile; serve.batch runs one batch at a time.
        return await asyncio.to_thread(self._run_batch, pieces)

    def _run_batch(self, pieces: list[Piece]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(pieces)
        for run in self.policy.plan(pieces):
            parts, error = self._execute(pieces, run)
            if error is not None and len(run.members) > 1:
                # A request's values (an index out of range, say) can fail a joined run: rerun each
                # request alone, so only the ones that fail by themselves get the error.
                for i in run.members:
                    (alone,) = self.policy.plan([pieces[i]])
                    (values,), own_error = self._execute([pieces[i]], alone)
                    outcomes[i] = Outcome(values, own_error, len(pieces), alone.padded_rows)
                continue
            for member, values in zip(run.members, parts):
                outcomes[member] = Outcome(values, error, len(pieces), run.padded_rows)
        with self._lock:
            self.stats["requests"] += len(pieces)
            self.stats["batches"] += 1
            self.batch_sizes[len(pieces)] += 1
        return outcomes

    def _execute(self, pieces: list[Piece], run) -> tuple[list, EphostError | None]:
        """One session run: each member's outputs, or Nones and the run's error (as an EphostError)."""
        with self._lock:
            self.stats["runs"] += 1
            self.stats["padded_rows"] += run.padded_rows - run.rows
            self.run_rows[run.padded_rows] += 1
        try:
            outputs = self.session.run(None, run.feeds)
            return self.policy.split(pieces, run, outputs), None
        except Exception as exc:  # noqa: BLE001 - the run's requests get the error; the replica lives on
            with self._lock:
                self.stats["failed_runs"] += 1
            error = exc if isinstance(exc, EphostError) else EphostError(f"{type(exc).__name__}: {exc}")
            return [None] * len(run.members), error


def _path(request: Request) -> str:
    """The request's path below the application's route prefix."""
    path, root = request.scope.get("path", "/"), request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _replica_name() -> str:
    """The replica's Ray actor name (`ray.get_actor(name, namespace="serve")` finds it)."""
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # noqa: BLE001 - outside a replica (a unit test constructing the class)
        return f"pid-{os.getpid()}"


def ephost_deployment(model_path, *, providers=None, provider_options=None, plugins=None, max_batch_size: int = 8,
                      batch_wait_timeout_s: float = 0.005, buckets="auto", num_replicas: int = 1,
                      name: str | None = None, backend: str = "ephost", num_gpus: float | None = None,
                      ray_actor_options: dict | None = None):
    """A bound Ray Serve deployment serving `model_path`; `serve.run(app, route_prefix="/")` runs it."""
    spec, name = _model_spec(model_path, providers, provider_options, plugins, backend, name)
    _check_batching(max_batch_size, batch_wait_timeout_s, num_replicas)
    resolve_buckets(buckets, max_batch_size, spec.uses_gpu)  # refuse a bad list here, not in every replica
    deployment = serve.deployment(ServedModel).options(
        name=name, **replica_options(spec, max_batch_size, num_replicas, num_gpus, ray_actor_options))
    return deployment.bind(spec, name, max_batch_size, batch_wait_timeout_s, buckets)


def replica_options(spec: ModelSpec, max_batch_size: int, num_replicas: int, num_gpus, ray_actor_options) -> dict:
    """Ray Serve's deployment options: replica count, resources per replica, requests per replica."""
    actor_options = dict(ray_actor_options or {})
    gpus = num_gpus if num_gpus is not None else (1 if spec.uses_gpu else 0)
    if gpus:  # a CUDA deployment's replicas each get a GPU (Ray sets CUDA_VISIBLE_DEVICES for it)
        actor_options["num_gpus"] = gpus
    # Room for one batch running and the next one forming (Ray warns below max_batch_size).
    return {"num_replicas": num_replicas, "ray_actor_options": actor_options,
            "max_ongoing_requests": max(2 * max_batch_size, 5)}


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _model_spec(model_path, providers, provider_options, plugins, backend, name) -> tuple[ModelSpec, str]:
    from pathlib import Path

    from host.errors import NoSuchFile
    from host.serving.backend import check_backend

    path = Path(model_path).resolve()  # replicas do not share the caller's working directory
    if not path.is_file():
        raise NoSuchFile(f"model '{model_path}' is not a file; a deployment serves an ONNX model file "
                         f"(the same path on every node of the cluster)")
    check_backend(backend)
    name = path.stem if name is None else name
    if not name or not set(name) <= _NAME_CHARS:
        raise InvalidArgument(f"model name {name!r} cannot be a URL path segment; use letters, digits, '_', '.', '-'")
    plugin_items = tuple((str(k), str(Path(v).resolve())) for k, v in (plugins or {}).items())
    return ModelSpec(str(path), tuple(providers or ()), tuple(provider_options or ()), plugin_items, backend), name


def _check_batching(max_batch_size, batch_wait_timeout_s, num_replicas) -> None:
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InvalidArgument(f"max_batch_size must be an int >= 1 (1 turns batching off); got {max_batch_size!r}")
    if not isinstance(batch_wait_timeout_s, int | float) or batch_wait_timeout_s < 0:
        raise InvalidArgument(f"batch_wait_timeout_s must be a number >= 0; got {batch_wait_timeout_s!r}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise InvalidArgument(f"num_replicas must be an int >= 1; got {num_replicas!r}")
