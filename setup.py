"""The package build's steps beyond pyproject.toml: compile ephost's native code into the package.

- kernels.c becomes a setuptools extension module (host/cpu_ep/native/_kernels.<ext suffix>), which
  host.cpu_ep.native opens with ffi.dlopen. Its flags and source hash come from build_info.py.
- Each built-in plugin's cffi embedding shim (the CUDA plugin: plugin_cuda/_ephost_cuda_v<N>_pkg<hash>.<ext
  suffix>), which host.plugins.builtin finds by provider name and the loader opens by path.

So `pip install .` and `pip wheel .` carry the compiled libraries and tag the wheel for this platform and
Python (docs/install.md says why setuptools extensions). The build environment has setuptools and cffi
([build-system] requires), not ephost's other dependencies: the modules used here import neither NumPy
nor onnx.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # abi/ and host/ of this tree (setuptools.build_meta does not add it)

from host.plugins import builtin  # noqa: E402

# By path: importing host.cpu_ep.native would import NumPy.
_spec = importlib.util.spec_from_file_location("_ephost_build_info", ROOT / "host" / "cpu_ep" / "native" / "build_info.py")
build_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_info)

setup(ext_modules=[build_info.extension(ROOT), *builtin.package_extensions()])
