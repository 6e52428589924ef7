"""Start-up: how long `import host`, `ephost --help` and a first session take, each in a fresh process.

    python -m bench.startup [--repeat 5] [--json out.json] [--model PATH ...]

Every figure is the median of `--repeat` fresh interpreters (nothing is shared between them but the
files on disk):
- `import host`: the whole process (interpreter start included), and the import alone;
- `ephost --help`: the whole process (`python -m host.cli --help`);
- `host.InferenceSession`'s runtime imports (numpy, onnx, cffi, the CPU EP), as `import onnxruntime`;
- for three small zoo models (an MLP, a CNN, a transformer block): `InferenceSession(path)` alone, in a
  process that has imported the runtime and nothing else, **cold** (an empty optimized-model cache, as on a
  first run) and **warm** (the cache holds the model, as on every later run), in wall time and in the
  process's CPU time (steadier than the wall time on a machine shared with other jobs; it does not count
  child processes); and the whole process (interpreter, imports, session) for the cold and warm cases;
- the same for each `--model PATH` (an .onnx file, e.g. tests/models/bert_torchscript.onnx).

Not a test: the figures depend on the machine and its load (docs/cli.md#start-up-time has a table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PYCACHE = Path(tempfile.gettempdir()) / "ephost-startup-pycache"

# Timed inside the child: the imports (`import host` and the runtime modules `host.InferenceSession`
# loads, as `import onnxruntime` loads its own), then the session alone, printed as JSON.
_SESSION = """
import json, sys, time
t0 = time.perf_counter()
import host
host.InferenceSession  # the attribute imports the runtime (numpy, onnx, the CPU EP)
t1, c1 = time.perf_counter(), time.process_time()
host.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"import": t1 - t0, "session": t2 - t1, "session_cpu": c2 - c1}))
"""

_IMPORT = """
import json, time
t0 = time.perf_counter()
import host
print(json.dumps({"import": time.perf_counter() - t0}))
"""


def _models(folder: Path, extra: list[str]) -> dict[str, Path]:
    """Three small models written to `folder` (built here, so the timed processes only load them), then
    the `extra` model files, by path."""
    import onnx

    from host.cli import zoo

    built = {
        "mlp (4 x 64)": zoo.mlp(layers=4, hidden=64),
        "cnn (16x16)": zoo.cnn(size=16),
        "transformer block (seq 16, hidden 64)": zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128),
    }
    paths = {}
    for i, (name, model) in enumerate(built.items()):
        paths[name] = folder / f"model{i}.onnx"
        onnx.save(model, paths[name])
    for path in extra:
        paths[path] = Path(path).resolve()
    return paths


def _child(args: list[str], cache: Path) -> tuple[float, dict]:
    """Run `python ARGS` from the repository root; its wall time and the JSON it printed (if any).

    Bytecode is written to (and read from) a folder of its own: an installed package has its .pyc
    files, and a source tree run with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module
    of ephost in every process (about 0.1 s here), which is not what a user pays."""
    env = {**os.environ, "EPHOST_CACHE_DIR": str(cache), "PYTHONPYCACHEPREFIX": str(_PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    return wall, (json.loads(last) if last.startswith("{") else {})


def _median(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


def measure(repeat: int, folder: Path, extra: list[str] = ()) -> dict[str, float]:
    """Every figure in milliseconds (medians), by name."""
    figures: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        figures.setdefault(name, []).append(seconds)

    paths = _models(folder, list(extra))
    for path in paths.values():  # untimed: compiles the bytecode of everything a session imports
        _child(["-c", _SESSION, str(path)], folder / "unused-cache")
    for _ in range(repeat):
        wall, inner = _child(["-c", _IMPORT], folder / "unused-cache")
        add("import host (process)", wall)
        add("import host (import alone)", inner["import"])
        wall, _ = _child(["-m", "host.cli", "--help"], folder / "unused-cache")
        add("ephost --help (process)", wall)
    for k, (name, path) in enumerate(paths.items()):
        warm_cache = folder / f"warm-{k}"
        _child(["-c", _SESSION, str(path)], warm_cache)  # fills the cache the warm runs read
        for i in range(repeat):
            wall, inner = _child(["-c", _SESSION, str(path)], folder / f"cold-{k}-{i}")
            add(f"{name}: session, cold cache", inner["session"])
            add(f"{name}: session, cold cache (CPU)", inner["session_cpu"])
            add(f"{name}: process, cold cache", wall)
            wall, inner = _child(["-c", _SESSION, str(path)], warm_cache)
            add(f"{name}: session, warm cache", inner["session"])
            add(f"{name}: session, warm cache (CPU)", inner["session_cpu"])
            add("runtime imports (import host; host.InferenceSession)", inner["import"])
            add(f"{name}: process, warm cache", wall)
    return {name: _median(values) for name, values in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per figure (default: 5)")
    parser.add_argument("--json", help="also write the figures (ms) to this file")
    parser.add_argument("--model", action="append", default=[],
                        help="also time sessions of this .onnx file (repeatable)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ephost-startup-") as tmp:
        figures = measure(args.repeat, Path(tmp), args.model)
    width = max(map(len, figures))
    print(f"median of {args.repeat} fresh processes, ms")
    for name, ms in figures.items():
        print(f"  {name:<{width}}  {ms:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
