"""Per-node kernels' warm-ups saved in a context and replayed early, in a background thread (issue 29).

A session's per-node kernels (the nodes outside compiled partitions: BERT's embedding Gather, its
mask's Cast, And and Where) run CuPy code that CuPy compiles with NVRTC at its first call
(kernel_warmup.py makes that call at CreateKernel). On a machine whose CuPy cache is cold this is
0.5 s of a BERT session made from a context model, and CreateKernel comes last in a session's
creation, after the contexts are loaded.

So each warm-up that succeeds leaves a *recipe* (the node's op, attributes, input shapes and dtypes,
host constants; JSON), a saved context carries the EP's recipes (plan/saved.py, header key "warm")
and the kernels CuPy compiled for them (section "cupy", cupy_cache.py), and CompileFromContext hands
the kernels to CuPy and starts the recipes in a background thread: the calls then load what NVRTC made
on the saving machine, or, where CuPy cannot take them, compile (NVRTC releases the GIL) while the host
loads the other contexts and partitions. CreateKernel's own warm-up (still made: left
to the replay alone, run 1 compiled the kernels again), the EP's Sync, OnRunStart and close wait for
the thread first (`join`), so no CuPy code runs in two threads for one kernel, and run 1 finds every
kernel compiled. A recipe that does not replay (another CuPy, a kernel that changed) is
skipped: CreateKernel's own warm-up then does the work, as without a context.

Kernels that need cuBLAS or cuDNN handles are not recorded: their handles are per stream and not
safe to share with the thread that loads contexts (their NVRTC cost is nil anyway).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np

from plugin_cuda import kernel_warmup

__all__ = ["Prefetch", "decode", "key_of", "recipe_of", "record", "stats"]

MAX_RECIPES = 256  # per EP: what one context carries
MAX_KEYS_REMEMBERED = 4096  # recipes whose CuPy payloads this process remembers (record)
MAX_CONSTANT_ELEMENTS = 1024  # larger attributes or host constants: the node is not recorded
# One thread per context: recipes share CuPy kernels (BERT's three embedding Gathers are one `take`
# kernel), which threads side by side would each compile (BERT on the H200: 0.63 s of NVRTC in four
# threads against about 0.25 s in one; a second start's thread runs beside the first, on other recipes).
MAX_THREADS = 1

stats = {"recorded": 0, "replayed": 0, "failed": 0, "skipped": 0}  # per process (tests read them)
_payloads_by_key: dict[str, dict] = {}  # recipe key -> the CuPy payloads its first recorded call used


def recipe_of(node, specs, adapter) -> dict | None:
    """The recipe of a per-node warm-up call (JSON-ready); None when it is not saved (a kernel with
    library handles, a large or object constant)."""
    if adapter.needs_cublas or adapter.needs_cudnn:
        return None
    try:
        return {"op": node.op_type, "domain": node.domain, "opset": int(node.opset), "name": node.name,
                "attrs": {k: _encode(v) for k, v in sorted(node.attrs.items())},
                "inputs": [None if s is None else [list(s[0]), np.dtype(s[1]).str] for s in specs],
                "constants": {str(i): _encode(c) for i, c in sorted(adapter.constants.items()) if c is not None},
                "present": [bool(p) for p in adapter.present]}
    except _NotSaved:
        return None


def key_of(recipe) -> str | None:
    """What identifies a recipe's kernel call: all of it but the node's name."""
    if not isinstance(recipe, dict):
        return None
    return json.dumps({k: v for k, v in recipe.items() if k != "name"}, sort_keys=True)


def record(ep, recipe: dict | None, payloads: dict | None = None) -> None:
    """Keep `recipe` (of a warm-up that succeeded) in `ep.warm_recipes` (key -> recipe) for a context,
    and the CuPy payloads its call loaded or compiled (cupy_cache.recording) in `ep.warm_payloads`.
    A call that found its code compiled in memory already (an earlier session of this process) loads
    nothing: the payloads an earlier call of the same recipe recorded stand for it."""
    recipes = getattr(ep, "warm_recipes", None)
    if recipes is None or recipe is None or len(recipes) >= MAX_RECIPES:
        return
    key = key_of(recipe)
    if payloads:
        if len(_payloads_by_key) < MAX_KEYS_REMEMBERED or key in _payloads_by_key:
            _payloads_by_key[key] = dict(payloads)
    else:
        payloads = _payloads_by_key.get(key, {})
    kept = getattr(ep, "warm_payloads", None)
    if kept is not None:
        kept.update(payloads)
    if key not in recipes:
        recipes[key] = recipe
        stats["recorded"] += 1


class _NotSaved(Exception):
    """A value a recipe cannot hold (a large or object array, an unknown type)."""


def _encode(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": bytes(v).decode("latin-1")}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, np.generic):
        return _encode(v.item())
    if isinstance(v, np.ndarray) and not v.dtype.hasobject and v.size <= MAX_CONSTANT_ELEMENTS:
        return {"array": v.reshape(-1).tolist(), "dtype": v.dtype.str, "shape": list(v.shape)}
    raise _NotSaved(type(v).__name__)


def decode(v):
    """A value `_encode` wrote, back in the type the kernel was given."""
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict) and "array" in v:
        return np.asarray(v["array"], np.dtype(v["dtype"])).reshape(v["shape"])
    if isinstance(v, dict) and "bytes" in v:
        return v["bytes"].encode("latin-1")
    return v


class Prefetch:
    """The background replay of saved recipes for one EP."""

    def __init__(self, ep):
        self.ep = ep
        self.done: set[str] = set()  # keys of the recipes replayed, or under way, in this EP
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, recipes: list) -> bool:
        """Replay `recipes` (a context's "warm" list) in MAX_THREADS threads; False when nothing is to be
        done (every recipe replayed already, or none readable)."""
        todo = []
        for recipe in recipes if isinstance(recipes, list) else []:
            key = key_of(recipe)
            if key is not None and key not in self.done:
                self.done.add(key)
                todo.append(recipe)
        if not todo:
            return False
        count = min(MAX_THREADS, len(todo))
        threads = [threading.Thread(target=self._replay, args=(todo[k::count],), daemon=True,
                                    name=f"ephost-cuda-prefetch-{k}") for k in range(count)]
        with self._lock:
            self._threads.extend(threads)
        for t in threads:
            t.start()
        return True

    def covers(self, recipe: dict | None) -> bool:
        """Whether `recipe`'s call is replayed here (done or under way)."""
        return recipe is not None and key_of(recipe) in self.done

    def join(self) -> None:
        """Wait for every replay started so far (CreateKernel's warm-up, Sync, OnRunStart and close)."""
        if not self._threads:  # every run's OnRunStart calls this: no lock when nothing was started
            return
        with self._lock:
            threads, self._threads = self._threads, []
        for t in threads:
            t.join()

    def _replay(self, todo: list) -> None:
        for recipe in todo:
            replay(self.ep, recipe)


def replay(ep, recipe: dict) -> bool:
    """Run one recipe's kernel once on zeros (kernel_warmup's way); True when it ran."""
    from plugin_cuda import kernels

    first = getattr(ep, "first_stream", None)
    state = None if first is None or ep.opts.has_user_compute_stream else first()
    if state is None:
        stats["skipped"] += 1
        return False
    try:
        cls = kernels.lookup(recipe["op"], int(recipe["opset"]), recipe["domain"])
        if cls.needs_cublas or cls.needs_cudnn:  # never recorded (module docstring): not from this plugin
            raise ValueError(f"{recipe['op']} needs library handles")
        kernel = cls({k: decode(v) for k, v in recipe["attrs"].items()}, int(recipe["opset"]), str(recipe["name"]))
        kernel.options = ep.opts
        specs = [None if s is None else (tuple(int(d) for d in s[0]), np.dtype(s[1])) for s in recipe["inputs"]]
        adapter = SimpleNamespace(kernel=kernel, needs_cublas=False, needs_cudnn=False,
                                  constants={int(i): decode(c) for i, c in recipe["constants"].items()},
                                  present=tuple(bool(p) for p in recipe["present"]))
        kernel_warmup.run(ep, adapter, specs, state)
    except Exception:  # noqa: BLE001 - see the module docstring: CreateKernel's warm-up does the work
        stats["failed"] += 1
        return False
    stats["replayed"] += 1
    return True
