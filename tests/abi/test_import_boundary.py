"""The host and the plugins meet only through the C tables: neither imports the other's Python code.

Every .py file is parsed (not imported) and each `import`, `from ... import`, `importlib.import_module`
and `__import__` with a literal name is checked; relative imports are resolved against the file's
package first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.abi.conftest import ROOT

# (scanned package directory, forbidden top-level module paths)
RULES = (
    ("host", ("plugin_cuda", "tests.plugins")),
    ("plugin_cuda", ("host",)),
    ("tests/plugins", ("host",)),
)


def _package_of(path: Path) -> list[str]:
    return list(path.relative_to(ROOT).with_suffix("").parts[:-1])


def imported_modules(source: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the file at `path` under ROOT."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(path)
                base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.append((node.lineno, prefix))
            found += [(node.lineno, f"{prefix}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(path: Path, forbidden: tuple[str, ...], source: str | None = None) -> list[str]:
    source = path.read_text() if source is None else source
    out = []
    for line, module in imported_modules(source, path):
        for bad in forbidden:
            if module == bad or module.startswith(bad + "."):
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (forbidden: {bad})")
    return out


@pytest.mark.parametrize(("package", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_no_import_across_the_boundary(package, forbidden):
    files = sorted((ROOT / package).rglob("*.py"))
    if package == "host":
        assert files, "host/ has no Python files: the scan would prove nothing"
    problems = [v for f in files for v in violations(f, forbidden)]
    assert problems == []


@pytest.mark.parametrize(("rel", "source", "forbidden", "expected"), [
    ("host/x.py", "import plugin_cuda.plugin\n", ("plugin_cuda",), "imports plugin_cuda.plugin"),
    ("host/x.py", "from tests.plugins import example_ep\n", ("tests.plugins",), "imports tests.plugins"),
    ("host/x.py", "from tests import plugins\n", ("tests.plugins",), "imports tests.plugins"),
    ("host/x.py", "import importlib\nimportlib.import_module('plugin_cuda.kernels')\n", ("plugin_cuda",),
     "imports plugin_cuda.kernels"),
    ("plugin_cuda/x.py", "from host.plugins.loader import Slots\n", ("host",), "imports host.plugins.loader"),
    ("plugin_cuda/x.py", "def f():\n    import host\n", ("host",), "imports host"),
    ("tests/plugins/x.py", "from ...host import errors\n", ("host",), "imports host"),
    ("tests/plugins/x.py", "__import__('host.plugins.environment')\n", ("host",), "imports host.plugins.environment"),
])
def test_the_scanner_finds_forbidden_imports(rel, source, forbidden, expected):
    found = violations(ROOT / rel, forbidden, source)
    assert any(expected in v for v in found), found


@pytest.mark.parametrize(("rel", "source", "forbidden"), [
    ("host/x.py", "import abi\nfrom abi import sdk\nfrom . import errors\n",
     ("plugin_cuda", "tests.plugins")),
    ("plugin_cuda/x.py", "import hostname_utils\nfrom .host_copy import f\n", ("host",)),
    ("tests/plugins/x.py", "from tests.host_helpers import x\n", ("host",)),
])
def test_the_scanner_allows_the_shared_package(rel, source, forbidden):
    assert violations(ROOT / rel, forbidden, source) == []
