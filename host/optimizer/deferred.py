"""Modules the optimizer's libraries import but a first session rarely uses, loaded on first use.

onnx-ir imports sympy (0.3-0.5 s, most of a first session's cost) for the arithmetic of symbolic dims,
and onnxscript's constant folding imports onnx's reference kernels (0.15 s) to evaluate the nodes it
folds. A session for a model with static shapes and nothing to fold needs neither. `install()` puts a
stand-in for each in sys.modules: the real module runs, into that same object, the first time one of its
attributes is read, so every user sees the complete module, only later.

Why not importlib.util.LazyLoader: its module loads on any attribute access, `__spec__` included, and
the import system reads `__spec__` on every `import sympy` (onnx-ir's among them), so it loads at once.
The stand-in here has its import attributes set and loads only for a missing one (`__getattr__`).

A partial stand-in (PARTIAL: onnxscript) also has its `__path__`, so its submodules import without the
package's own code; reading a submodule's name imports that submodule, any other name loads the package.
A stand-in put in place before its parent package is imported is linked to the parent (set as its
attribute) once the parent's code has run (`_ParentLinker`), as the import system would have done.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

# In this order: a stand-in is linked to its parent's stand-in (onnx.reference -> .ops).
DEFERRED = ("sympy", "onnx_ir._symbolic_shapes", "onnx.reference", "onnx.reference.ops")
# Packages whose submodules import without the package's own code: onnxscript's __init__ imports its
# script converter and the generated opset classes (about half of onnxscript's import time), which the
# optimizer (onnxscript.optimizer, onnxscript.rewriter) never uses. Any other attribute loads it whole.
PARTIAL = ("onnxscript",)


class DeferredModule(types.ModuleType):
    """A module whose code runs the first time a missing attribute is read."""

    def __getattr__(self, attr: str):
        state = self.__dict__
        if state.get("_deferred_partial") and "_deferred_spec" in state:
            sub = _submodule(self, attr)
            if sub is not None:
                return sub
        # Its own code, still running, reads a name it has not defined yet: as for a module being
        # imported, the name is missing.
        if state.get("_deferred_loader") != threading.get_ident():
            with state["_deferred_lock"]:  # another thread loading it: wait for the whole module
                if "_deferred_spec" in state:
                    _load(self)
            if attr in state:
                return state[attr]
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


def _submodule(package: DeferredModule, attr: str):
    """The submodule `attr` of a partial package, imported, or None when no such submodule exists."""
    name = f"{package.__name__}.{attr}"
    if name not in sys.modules:
        if attr.startswith("__") or importlib.machinery.PathFinder.find_spec(name, package.__path__) is None:
            return None
        importlib.import_module(name)
    return sys.modules[name]


def _load(module: DeferredModule) -> None:
    state = module.__dict__
    spec = state["_deferred_spec"]
    state["_deferred_loader"] = threading.get_ident()
    try:
        if spec.submodule_search_locations is not None:
            module.__path__ = spec.submodule_search_locations  # its own submodules import during its code
        spec.loader.exec_module(module)
        del state["_deferred_spec"]  # on failure kept: the next read tries again, and raises again
    finally:
        state["_deferred_loader"] = None
    parent, _, child = module.__name__.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def _spec(name: str):
    parent, _, _ = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name)
    if parent in sys.modules:
        locations = getattr(sys.modules[parent].__spec__, "submodule_search_locations", None)
    else:  # its parent not imported: look where the parent would be found, importing nothing
        parent_spec = importlib.util.find_spec(parent)
        locations = parent_spec.submodule_search_locations if parent_spec else None
    return importlib.machinery.PathFinder.find_spec(name, locations) if locations else None


def defer(name: str, partial: bool = False) -> bool:
    """Put a stand-in for `name` in sys.modules; False (nothing done) when it is imported already, not
    installed, or not plain Python source (only a source module's code can run into the stand-in)."""
    if name in sys.modules:
        return False
    spec = _spec(name)
    if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return False
    module = DeferredModule(name)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__package__ = name if spec.submodule_search_locations is not None else spec.parent
    module.__dict__.update(_deferred_spec=spec, _deferred_lock=threading.RLock())
    if partial and spec.submodule_search_locations is not None:
        # The import system finds a submodule through its parent's __path__, read from the dict.
        module.__path__ = spec.submodule_search_locations
        module.__dict__["_deferred_partial"] = True
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    elif parent:
        _LINKER.wait_for(parent, child)
    return True


class _ParentLinker(importlib.abc.MetaPathFinder):
    """Sets a stand-in as its parent package's attribute once the parent's code has run.

    The import system links a submodule to its parent only when it loads the submodule; a stand-in put
    in sys.modules before its parent is imported (host.optimizer imported before onnx) was never linked,
    so `onnx.reference` stayed missing and onnxscript's constant folding failed quietly on every node it
    would have folded (fewer nodes folded, no error)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[str]] = {}  # parent -> children waiting for it

    def wait_for(self, parent: str, child: str) -> None:
        self.pending.setdefault(parent, []).append(child)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:  # the spec the import system would have found without this one
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LinkingLoader(spec.loader, self)
        return spec

    def link(self, parent) -> None:
        """Set the parent's waiting stand-ins on it (once its code has run); a mere find_spec(), which
        imports nothing, leaves them waiting."""
        for child in self.pending.pop(parent.__name__, ()):
            stand_in = sys.modules.get(f"{parent.__name__}.{child}")
            if stand_in is not None and not hasattr(parent, child):
                setattr(parent, child, stand_in)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


class _LinkingLoader(importlib.abc.Loader):
    """The parent's own loader, then the links; the module keeps its own loader (resources read it)."""

    def __init__(self, loader, linker: _ParentLinker) -> None:
        self.loader, self.linker = loader, linker

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.linker.link(module)


_LINKER = _ParentLinker()


def install() -> None:
    """Defer every module of DEFERRED that is not imported yet (a few file look-ups, no imports)."""
    for name in DEFERRED:
        defer(name)
    for name in PARTIAL:
        defer(name, partial=True)


def loaded(name: str) -> bool:
    """Whether `name` is imported and its code has run (a stand-in that has not loaded is not)."""
    module = sys.modules.get(name)
    return module is not None and "_deferred_spec" not in module.__dict__
