"""The session a replica runs: ephost's InferenceSession, or onnxruntime's CPU session (for comparison).

Both have get_inputs()/get_outputs()/run(None, feeds); the replica needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from host.errors import InvalidArgument, ModelError

BACKENDS = ("ephost", "onnxruntime")
CUDA_EP = "CUDAExecutionProvider"


@dataclass(frozen=True)
class ModelSpec:
    """What every replica needs to open the same session (plain data: Ray pickles it to each replica)."""

    model_path: str
    providers: tuple = ()
    provider_options: tuple = ()
    plugins: tuple[tuple[str, str], ...] = ()
    backend: str = "ephost"

    @property
    def uses_gpu(self) -> bool:
        return any((p if isinstance(p, str) else p[0]) == CUDA_EP for p in self.providers)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend {backend!r} is not known; allowed: {list(BACKENDS)}")


def open_session(spec: ModelSpec, pad_batch: bool = False):
    """The session of one replica, created once when the replica starts.

    `pad_batch` (the deployment pads runs to buckets): the ephost session gets the same batch buckets
    (`session.ephost.shape_buckets` = batch:pow2), so that with graph capture (`enable_cuda_graph=1`)
    run() replays each bucket's CUDA graph instead of running eagerly. A model the session's check
    refuses (its batch rows are not independent) opens without them, with a warning."""
    check_backend(spec.backend)
    if spec.backend == "onnxruntime":
        import onnxruntime

        return onnxruntime.InferenceSession(spec.model_path, providers=["CPUExecutionProvider"])
    from host.plugins.environment import Environment
    from host.runtime import buckets
    from host.runtime.options import SessionOptions
    from host.runtime.session import InferenceSession
    from host.runtime.warn import warn_caller

    env = Environment()
    for name, path in spec.plugins:
        env.register_plugin(name, path)

    def session(options):
        return InferenceSession(spec.model_path, options, providers=list(spec.providers) or None,
                                provider_options=list(spec.provider_options) or None, env=env)

    if not pad_batch:
        return session(None)
    options = SessionOptions()
    options.add_session_config_entry(buckets.CONFIG_KEY, "batch:pow2")
    try:
        return session(options)
    except ModelError as exc:
        if not str(exc).startswith(f"'{buckets.CONFIG_KEY}'"):
            raise
        warn_caller(f"{spec.model_path}: the session runs without batch buckets (no graph per bucket): {exc}")
        return session(None)
