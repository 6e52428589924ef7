"""An application builder for Ray Serve config files and `serve run` (KubeRay's RayService uses the same).

    serve run host.serving.builder:app model_path=/models/mlp.onnx max_batch_size=16

or, in a Serve config (`serve deploy config.yaml`, a RayService's `serveConfigV2`):

    applications:
      - name: mlp
        route_prefix: /
        import_path: host.serving.builder:app
        args: {model_path: /models/mlp.onnx, providers: [CUDAExecutionProvider], num_replicas: 2}

Ray validates and converts the args (strings from the command line included) through the pydantic
model that `app`'s parameter is annotated with.
"""

# No `from __future__ import annotations`: Ray inspects the annotation of `app`'s parameter as a class.

from pydantic import BaseModel, ConfigDict

from host.serving.deployment import ephost_deployment


class ServeArgs(BaseModel):
    """The arguments of host.serving.ephost_deployment as a Serve config writes them."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not a silent default

    model_path: str
    providers: list[str] = []
    provider_options: list[dict[str, str]] = []
    plugins: dict[str, str] = {}
    max_batch_size: int = 8
    batch_wait_timeout_s: float = 0.005
    buckets: str | bool | list[int] = "auto"
    num_replicas: int = 1
    name: str | None = None
    backend: str = "ephost"
    num_gpus: float | None = None


def app(args: ServeArgs):
    """The bound deployment that the config's args describe."""
    return ephost_deployment(**args.model_dump())
