"""The package build's steps beyond pyproject.toml: compile ephost's native code into the package.

- kernels.c becomes a setuptools extension module (host/cpu_ep/native/_kernels.<ext suffix>), which
  host.cpu_ep.native opens with ffi.dlopen. Its flags and source hash come from build_info.py.
- The ABI's cffi declarations as out-of-line modules (abi/_cffi/_ephost_abi_v<N>_<hash>.py: C type strings
  parsed in C at run time; abi/outofline.py), written into the build's copy of the package.
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

from setuptools.command.build_py import build_py  # noqa: E402


class BuildPyWithFfiModules(build_py):
    """build_py, then the out-of-line cffi modules (the ABI's, the CUDA plugin's libraries') into the built
    package (not into the source tree)."""

    def run(self):
        super().run()
        from abi import outofline
        from plugin_cuda.device import cdefs

        outofline.write_package_modules(Path(self.build_lib) / "abi" / "_cffi", cdefs.MODULES)


setup(ext_modules=[build_info.extension(ROOT), *builtin.package_extensions()],
      cmdclass={"build_py": BuildPyWithFfiModules})
