"""Serving ephost models over HTTP with Ray Serve (optional extra: `pip install "ephost[serve]"`).

    from ray import serve
    from host.serving import ephost_deployment

    serve.run(ephost_deployment("mlp.onnx", max_batch_size=16, num_replicas=2), route_prefix="/")

`protocol`, `signature`, `batching` and `datatypes` need only NumPy; `deployment` needs Ray Serve.
docs/serving.md describes the HTTP protocol, batching and buckets, GPUs and clusters.
"""

from __future__ import annotations

from host.errors import EphostError

SERVE_EXTRA = 'pip install "ephost[serve]"'


class ServingUnavailable(EphostError, ImportError):
    """Ray Serve is not installed, so models cannot be served."""


def require_ray_serve():
    """The `ray.serve` module, or ServingUnavailable saying how to install it."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ServingUnavailable(f"serving needs Ray Serve, which cannot be imported ({exc}); "
                                 f"install it with {SERVE_EXTRA}") from exc
    return serve


def ephost_deployment(model_path, **options):
    """A bound Ray Serve deployment of `model_path` (see host.serving.deployment.ephost_deployment).

    Options: providers, provider_options, plugins ({name: path}), max_batch_size, batch_wait_timeout_s,
    buckets ('auto', True, False or a list of sizes), num_replicas, name, backend ('ephost' or
    'onnxruntime'), num_gpus, ray_actor_options.
    """
    require_ray_serve()
    from host.serving import deployment

    return deployment.ephost_deployment(model_path, **options)


__all__ = ["ServingUnavailable", "ephost_deployment", "require_ray_serve", "SERVE_EXTRA"]
