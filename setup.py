"""The package build's one step beyond pyproject.toml: compile the CPU EP's kernels into the package.

kernels.c becomes a setuptools extension module (host/cpu_ep/native/_kernels.<ext suffix>), so
`pip install .` and `pip wheel .` carry the compiled library and tag the wheel for this platform and
Python; host.cpu_ep.native opens it with ffi.dlopen (docs/install.md says why this and not cffi's
cffi_modules or scikit-build-core). The flags and the source hash come from build_info.py, loaded by
path: this build environment has setuptools, not ephost's dependencies.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_ephost_build_info", ROOT / "host" / "cpu_ep" / "native" / "build_info.py")
build_info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_info)

setup(ext_modules=[build_info.extension(ROOT)])
