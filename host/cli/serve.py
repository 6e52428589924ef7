"""`ephost serve MODEL`: serve a model over HTTP with Ray Serve (KServe v2 protocol; docs/serving.md).

    ephost serve mlp.onnx --replicas 2 --max-batch-size 16            # a local Ray instance, port 8000
    ephost serve mlp.onnx --ep cuda --address auto --host 0.0.0.0     # join a running cluster
    curl -s localhost:8000/v2/models/mlp
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from host.errors import InvalidArgument


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `ephost serve` (a row of host.cli.app.COMMANDS)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("model", help="ONNX model file (the same path on every node of a cluster)")
    p.add_argument("--plugin", action="append", default=[], metavar="[NAME=]PATH",
                   help="register an EP plugin library in every replica")
    p.add_argument("--ep", action="append", default=[], metavar="NAME",
                   help="execution provider, in priority order (cuda, cpu, or an EP name)")
    p.add_argument("--ep-option", action="append", default=[], metavar="[EP:]KEY=VALUE",
                   help="provider option for the first chosen EP, or for EP with the EP: prefix")
    p.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas (sessions) to run (default 1)")
    p.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                   help="most requests (and rows) one run joins; 1 turns batching off (default 8)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, metavar="MS",
                   help="how long a batch waits for more requests (default 5)")
    p.add_argument("--buckets", default="auto", metavar="auto|on|off|N,N,...",
                   help="pad each run's batch to a bucket: auto (powers of two on a GPU, none on the CPU), "
                        "on (powers of two up to --max-batch-size), off, or a list of sizes")
    p.add_argument("--name", help="model name in the URLs (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--address", metavar="ADDR",
                   help="join a running Ray cluster (auto, or HEAD_IP:6379); default: start a local Ray instance")
    p.add_argument("--num-cpus", type=float, metavar="N", help="CPUs each replica reserves (Ray's default: 1)")
    p.add_argument("--num-gpus", type=float, metavar="N", help="GPUs each replica reserves (default: 1 with cuda)")
    p.add_argument("--detach", action="store_true",
                   help="deploy and exit, leaving the application running on the cluster (with --address)")


def parse_buckets(text: str):
    """The --buckets value as ephost_deployment takes it."""
    words = {"auto": "auto", "on": True, "off": False}
    if text in words:
        return words[text]
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidArgument(f"--buckets {text!r}: expected auto, on, off or a comma-separated list of "
                              f"batch sizes such as 1,2,4,8") from None


def deployment_options(args) -> dict:
    """The keyword arguments of host.serving.ephost_deployment that the command line gives."""
    from host.cli.args import EP_ALIASES
    from host.cli.session_cmds import parse_ep_options, parse_plugin

    eps = [EP_ALIASES.get(name.lower(), name) for name in args.ep]
    options = parse_ep_options(args.ep_option, eps)
    actor_options = {} if args.num_cpus is None else {"num_cpus": args.num_cpus}
    return {"providers": eps, "provider_options": [options[ep] for ep in eps],
            "plugins": dict(parse_plugin(spec) for spec in args.plugin),
            "max_batch_size": args.max_batch_size, "batch_wait_timeout_s": args.batch_wait_ms / 1000,
            "buckets": parse_buckets(args.buckets), "num_replicas": args.replicas,
            "name": args.name, "num_gpus": args.num_gpus, "ray_actor_options": actor_options}


def cmd_serve(args) -> int:
    from host.serving import ephost_deployment, require_ray_serve

    serve = require_ray_serve()
    import ray

    app = ephost_deployment(args.model, **deployment_options(args))  # refuses bad options before Ray starts
    name = args.name or Path(args.model).stem
    if not ray.is_initialized():  # a process that already runs Ray (a notebook, a test) deploys there
        if args.address:
            ray.init(address=args.address)
        else:  # a local instance for this machine only; more machines: `ray start --head` and --address
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name=name, route_prefix="/")
    print(f"serving {name}: POST http://{args.host}:{args.port}/v2/models/{name}/infer "
          f"(metadata: GET /v2/models/{name}, readiness: GET /v2/health/ready)", flush=True)
    if args.detach:
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` and container stops end it as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete(name)  # ours to remove; a local Ray instance ends with this process
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt
