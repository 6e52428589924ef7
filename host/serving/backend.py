"""The session a replica runs: ephost's InferenceSession, or onnxruntime's CPU session (for comparison).

Both have get_inputs()/get_outputs()/run(None, feeds); the replica needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from host.errors import InvalidArgument

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


def open_session(spec: ModelSpec):
    """The session of one replica, created once when the replica starts."""
    check_backend(spec.backend)
    if spec.backend == "onnxruntime":
        import onnxruntime

        return onnxruntime.InferenceSession(spec.model_path, providers=["CPUExecutionProvider"])
    from host.plugins.environment import Environment
    from host.runtime.session import InferenceSession

    env = Environment()
    for name, path in spec.plugins:
        env.register_plugin(name, path)
    return InferenceSession(spec.model_path, providers=list(spec.providers) or None,
                            provider_options=list(spec.provider_options) or None, env=env)
