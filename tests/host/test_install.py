"""Installing anywhere: the built-in plugin cache, clear build errors, a non-editable install."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from abi import builder
from host.cli import app as cli
from host.errors import PluginBuildError
from host.plugins import builtin
from host.plugins.environment import Environment

ROOT = Path(__file__).resolve().parents[2]
CUDA = "CUDAExecutionProvider"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The per-user cache in tmp_path, and no packaged plugin: an editable install's in-place build of
    plugin_cuda/_ephost_cuda_*.so would otherwise be found before the cache."""
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPHOST_CUDA_PLUGIN", raising=False)
    monkeypatch.setattr(builtin, "packaged_plugin", lambda provider: None)
    return tmp_path / "cache"


# In a child process (no monkeypatch there): the same "no packaged plugin" as the fixture, then `code`.
NO_PACKAGED = "import host.plugins.builtin as b; b.packaged_plugin = lambda provider: None\n"


@pytest.fixture
def package_root(tmp_path, monkeypatch):
    """A stand-in for the installed package's root, holding an (empty) plugin_cuda/; the cache is empty."""
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPHOST_CUDA_PLUGIN", raising=False)
    monkeypatch.setattr(builder, "PACKAGE_ROOT", tmp_path / "site")
    (tmp_path / "site" / "plugin_cuda").mkdir(parents=True)
    return tmp_path / "site"


def test_the_package_build_of_the_cuda_plugin_is_found_first_and_needs_no_compiler(package_root, monkeypatch):
    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    assert builtin.unavailable_reason(CUDA).startswith(f"{CUDA} needs its plugin built")  # nothing there yet
    name = builder.packaged_module("cuda", "plugin_cuda.plugin:create_factories")
    lib = package_root / "plugin_cuda" / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    lib.write_bytes(b"")  # found by name: the lookup opens nothing
    assert builtin.find_builtin_plugin(CUDA) == lib
    assert builtin.unavailable_reason(CUDA) is None


def test_a_package_build_from_other_sources_is_not_used(package_root, monkeypatch):
    """An editable install's in-place build from an older header has another hash in its name."""
    name = builder.packaged_module("cuda", "plugin_cuda.plugin:create_factories")
    stale = package_root / "plugin_cuda" / (name[:-8] + "00000000" + sysconfig.get_config_var("EXT_SUFFIX"))
    stale.write_bytes(b"")
    assert name != stale.name.split(".")[0]
    assert builtin.packaged_plugin(CUDA) is None
    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(PluginBuildError, match=r"^CUDAExecutionProvider needs its plugin built for this Python"):
        builtin.find_builtin_plugin(CUDA)


def test_the_package_build_shim_leaves_sys_path_alone_and_a_checkout_build_adds_its_root():
    entry = "plugin_cuda.plugin:create_factories"
    packaged = builder.embedding_sources("m", entry, 5, root=None)["init"]
    checkout = builder.embedding_sources("m", entry, 5, root=Path("/some/checkout"))["init"]
    assert "sys.path" not in packaged and "sys.path.insert(0, '/some/checkout')" in checkout
    assert checkout.endswith(packaged)  # the same plugin start-up after the path line


def test_missing_compiler_is_a_plugin_build_error_naming_it_and_how_to_install(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-xyz")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PluginBuildError, match=r"^CUDAExecutionProvider needs its plugin built for this Python: "
                                               r"building plugin 'cuda' needs a C compiler; 'no-such-cc-xyz' "
                                               r"was not found on PATH; install one \(Debian/Ubuntu: `apt-get "
                                               r"install gcc`"):
        builtin.find_builtin_plugin(CUDA)
    assert not cache.exists() or not any(cache.rglob("*.so"))


def test_missing_compiler_suggests_one_that_exists(monkeypatch, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gcc").write_text("#!/bin/sh\nexit 0\n")
    (fake / "gcc").chmod(0o755)
    monkeypatch.setenv("CC", "no-such-cc-xyz")
    monkeypatch.setenv("PATH", str(fake))
    with pytest.raises(builder.BuildError, match=r"^building plugin 'x' needs a C compiler; 'no-such-cc-xyz' was "
                                                 r"not found on PATH; found 'gcc': set CC=gcc; install one"):
        builder.check_toolchain("x")


def test_missing_python_headers_are_named(monkeypatch, tmp_path):
    real = builder.sysconfig.get_paths

    def paths():
        return {**real(), "include": str(tmp_path / "no-include")}

    monkeypatch.setattr(builder.sysconfig, "get_paths", paths)
    with pytest.raises(builder.BuildError, match=r"^building plugin 'x' needs the Python 3\.\d+ headers; "
                                                 r".*Python\.h is missing; install them"):
        builder.check_toolchain("x")


def test_a_failed_c_compile_is_a_build_error_with_the_compiler_message(tmp_path):
    src = tmp_path / "bad.c"
    src.write_text("this is not C;\n")
    with pytest.raises(builder.BuildError, match=r"^building plugin 'bad' from .*bad\.c failed \(exit \d+\): .*error"):
        builder.build_c_plugin("bad", src, tmp_path / "libbad.so")
    assert not (tmp_path / "libbad.so").exists()


def test_the_cache_key_follows_what_the_shim_is_compiled_from():
    entry = "plugin_cuda.plugin:create_factories"
    base = builder.cache_key("m", entry, 5)
    assert builder.cache_key("m", entry, 5) == base
    assert builder.cache_key("m", entry, 4) != base                       # another ABI version
    assert builder.cache_key("m", "other.mod:fn", 5) != base               # another entry point
    assert builder.cache_key("m", entry, 5, root=Path("/moved/checkout")) != base  # a moved package


def test_builtin_cuda_plugin_is_built_once_into_the_cache_and_reused(cache):
    first = builtin.find_builtin_plugin(CUDA)
    assert first.is_file() and cache in first.parents
    assert sys.implementation.cache_tag in first.parent.name
    stamp = first.stat().st_mtime_ns
    assert builtin.find_builtin_plugin(CUDA) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt


def test_unknown_providers_are_not_built_in(cache):
    assert builtin.find_builtin_plugin("NoSuchExecutionProvider") is None
    with Environment() as env:
        assert env.ensure_builtin("NoSuchExecutionProvider") is False
        assert env.plugins == {}


def test_environment_registers_the_builtin_cuda_plugin_by_provider_name(cache):
    with Environment() as env:
        assert env.ensure_builtin(CUDA) is True
        assert list(env.plugins) == ["cuda"]
        assert env.ensure_builtin(CUDA) is True  # already there: nothing registered twice
        assert list(env.plugins) == ["cuda"]


def test_env_override_of_the_cuda_plugin_path(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("EPHOST_CUDA_PLUGIN", str(tmp_path / "mine.so"))
    assert builtin.find_builtin_plugin(CUDA) == tmp_path / "mine.so"


def test_cli_build_prints_the_cpu_kernels_and_the_cached_plugin(cache, capsys):
    from host.cpu_ep import native

    assert cli.main(["build"]) == 0
    kernels, line = capsys.readouterr().out.strip().splitlines()
    assert kernels.startswith("CPU kernels: ") and native.LIB is not None
    assert native.load(kernels.split(": ", 1)[1]) is not None  # a build of this kernels.c
    assert line.startswith(f"{CUDA}: {cache}") and line.endswith(".so")
    assert Path(line.split(": ", 1)[1]).is_file()


@pytest.fixture
def no_cpu_kernels(monkeypatch, tmp_path):
    """Neither the package's build nor a checkout's build/lib: only the cache (EPHOST_CACHE_DIR) is left."""
    from host.cpu_ep import native

    monkeypatch.delenv("EPHOST_CPU_KERNELS", raising=False)
    monkeypatch.setattr(native, "packaged_paths", lambda: [])
    monkeypatch.setattr(native, "DEFAULT_PATH", tmp_path / "no-checkout" / native.LIB_NAME)
    monkeypatch.setattr(native, "LIB", native.LIB)  # restored after the test, whatever build switched on
    return native


def test_without_a_packaged_build_ephost_build_compiles_the_cpu_kernels_into_the_cache(cache, no_cpu_kernels,
                                                                                          monkeypatch):
    from host.cpu_ep.native import build_info
    from host.native_build import build_cpu_kernels

    native = no_cpu_kernels
    assert native.load() is None and native.LOAD_ERROR.endswith("not found (reinstall ephost (`pip install .` "
                                                                "compiles them), or run `ephost build` or "
                                                                "`python build.py`)")
    checkout_build = ROOT / "build" / "lib" / native.LIB_NAME
    if not checkout_build.is_file():
        pytest.skip("needs build/lib from `python build.py` (stands in for the compiler here)")
    compiled = []

    def compile_library(target, werror=False):  # the compiler itself is build.py's (same function)
        compiled.append(target)
        target.parent.mkdir(parents=True)
        shutil.copyfile(checkout_build, target)
        return target

    monkeypatch.setattr(build_info, "compile_library", compile_library)
    path = build_cpu_kernels()
    assert compiled == [path] and cache in path.parents and native.LIB is not None
    assert build_cpu_kernels() == path and len(compiled) == 1  # found in the cache: not built again


def test_ephost_build_without_a_compiler_is_a_plugin_build_error(cache, no_cpu_kernels, monkeypatch):
    from host.native_build import build_cpu_kernels

    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(PluginBuildError, match=r"^building plugin 'cpu_kernels' needs a C compiler; "
                                               r"'no-such-cc-xyz' was not found on PATH"):
        build_cpu_kernels()


def test_build_py_reports_a_missing_compiler_in_one_line(tmp_path):
    env = {**os.environ, "CC": "no-such-cc-xyz", "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "--plugin", "example_c", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("build.py: error: building plugin 'example_c' needs a C compiler")
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_non_editable_install_runs_the_builtin_cuda_plugin_outside_the_checkout(tmp_path):
    """`pip install .` (no checkout on sys.path): the CUDA plugin is the package build's, inside the
    installed package, and loads; the ABI's cffi module is the package's too: nothing is built or written
    into the cache."""
    target = tmp_path / "site"
    src = tmp_path / "src"  # a copy, so setuptools' build/ never lands in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "mutants", ".ci-venv*", ".whl",
                                                             "*.egg-info", "__pycache__", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        # Drop the checkout, but keep the interpreter's own site-packages: CI's venv lives inside it.
        sys.path[:] = [p for p in sys.path if p not in ("", ".")
                       and (not p.startswith({str(ROOT)!r}) or p.startswith(sys.prefix))]
        import host
        assert host.__file__.startswith({str(target)!r}), host.__file__
        from host.cli import zoo
        env = host.Environment()
        assert env.ensure_builtin("CUDAExecutionProvider")
        import abi
        assert type(abi.ffi_for()).__module__ == "_cffi_backend"  # the package's out-of-line ABI module
        print(env.plugins["cuda"].path)
    """)
    env = {**os.environ, "PYTHONPATH": str(target), "EPHOST_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("EPHOST_CUDA_PLUGIN", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(target / "plugin_cuda" / "_ephost_cuda_v")), done.stdout
    assert not (tmp_path / "cache").exists()


# ---- no compiler: fall back to the CPU EP, as onnxruntime does --------------------------------------
NO_COMPILER = {"CC": "no-such-cc-xyz", "PATH": "/nonexistent"}


def _mlp_and_feed():
    from host.cli import zoo

    model = zoo.mlp(layers=2, hidden=16, seed=3)
    return model, {model.graph.input[0].name: np.random.default_rng(0).standard_normal((1, 16)).astype("float32")}


def test_without_a_compiler_a_session_asking_for_cuda_runs_on_the_cpu_with_one_warning(cache, monkeypatch):
    import warnings

    import onnxruntime as ort

    from host.runtime.session import InferenceSession

    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    model, feeds = _mlp_and_feed()
    with Environment() as env, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = InferenceSession(model.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"], env=env)
        got = sess.run(None, feeds)[0]
        assert sess.get_providers() == ["CPUExecutionProvider"] and sess.fallbacks["builtin_unavailable"] == 1
        sess.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert re.match(r"^CUDAExecutionProvider is not available, its nodes fall back to CPUExecutionProvider: "
                    r"CUDAExecutionProvider needs its plugin built for this Python: building plugin 'cuda' needs "
                    r"a C compiler; 'no-such-cc-xyz' was not found on PATH", messages[0])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_available_providers_leave_out_a_builtin_that_cannot_be_built(cache, monkeypatch):
    assert builtin.unavailable_reason(CUDA) is None  # this machine has a compiler
    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    assert builtin.unavailable_reason(CUDA).startswith(f"{CUDA} needs its plugin built for this Python: "
                                                       "building plugin 'cuda' needs a C compiler")
    # In a child, so no CUDA plugin registered by other tests in this process's default environment counts.
    code = NO_PACKAGED + "import host; print(host.get_available_providers())"
    env = {**os.environ, **NO_COMPILER, "EPHOST_CACHE_DIR": str(cache)}
    env.pop("EPHOST_CUDA_PLUGIN", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['CPUExecutionProvider']"


def test_a_plugin_built_before_stays_available_without_a_compiler(cache, monkeypatch):
    built = builtin.find_builtin_plugin(CUDA)  # with the compiler, into the test's cache
    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    assert builtin.unavailable_reason(CUDA) is None
    assert builtin.find_builtin_plugin(CUDA) == built


@pytest.mark.slow
def test_a_wheel_carries_the_compiled_cpu_kernels_and_runs_without_a_compiler(tmp_path):
    """`pip wheel .`, installed into a fresh venv, used from outside the checkout with no C compiler on
    PATH: the wheel carries the CPU kernels and the CUDA plugin, both are the installed package's own
    builds (nothing is compiled, the cache stays empty), a model matches onnxruntime, and asking for CUDA
    without a GPU falls back to the CPU EP with one warning. Builds kernels.c and the plugin's shim once
    (~10 s of compiler time; more on a busy machine)."""
    src = tmp_path / "src"  # a copy, so setuptools' build/ never lands in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "mutants", ".ci-venv*", ".whl", "dist",
                                                             "*.egg-info", "__pycache__", "tests", "*.so"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("ephost-*.whl")
    assert "-none-any" not in wheel.name  # a platform wheel: it carries compiled code
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    packaged = builder.packaged_module("cuda", "plugin_cuda.plugin:create_factories")
    libraries = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")}
    assert libraries == {f"host/cpu_ep/native/_kernels{suffix}", f"plugin_cuda/{packaged}{suffix}"}
    modules = {n.split("/")[-1].rsplit("_", 1)[0] for n in zipfile.ZipFile(wheel).namelist() if n.startswith("abi/_cffi/")}
    assert {"_ephost_abi_v7", "_ephost_cudnn", "_ephost_cublaslt", "_ephost_cublas", "_ephost_cuda_driver"} <= modules
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The dependencies come from the running environment (CI's venv, whose base interpreter may have
    # none): its site-packages as plain path entries, after the new venv's own (so its .pth files, and
    # an editable ephost among them, stay out).
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    Path(own, "_running_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    script = textwrap.dedent("""
        import sysconfig, warnings
        import numpy as np, onnxruntime as ort
        import host
        from host.cli import zoo
        from host.cpu_ep import native
        assert host.__file__.startswith(sys.prefix), host.__file__
        assert native.LOAD_ERROR is None and native.LIB is not None, native.LOAD_ERROR
        assert native.LOADED_FROM in native.packaged_paths(), native.LOADED_FROM
        # The packaged CUDA plugin is there (no GPU needed to list it, as onnxruntime-gpu) and loads.
        assert host.get_available_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
        env = host.Environment()
        assert env.ensure_builtin("CUDAExecutionProvider")
        assert str(env.plugins["cuda"].path).startswith(sysconfig.get_paths()["platlib"]), env.plugins["cuda"].path
        env.close()
        model = zoo.mlp(layers=2, hidden=32, seed=1).SerializeToString()
        x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess = host.InferenceSession(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        # No GPU (no CuPy in this venv): one warning, and the session runs on the CPU EP.
        assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
            "CUDAExecutionProvider has no device; its nodes fall back to CPUExecutionProvider"]
        assert sess.get_providers() == ["CPUExecutionProvider"]
        feeds = {sess.get_inputs()[0].name: x}
        want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
        print("ok", native.LOADED_FROM)
    """)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # No CC and a PATH with no compiler (CC=/bin/false would count as a compiler that fails).
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "EPHOST_CACHE_DIR": str(tmp_path / "empty-cache")}
    done = subprocess.run([str(python), "-c", "import sys\n" + script], capture_output=True, text=True, env=env,
                          cwd=outside)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ok {venv}")
    assert not list((tmp_path / "empty-cache").rglob("*.so"))  # nothing was built (the model cache is there)


def test_cli_run_with_ep_cuda_and_no_compiler_runs_on_the_cpu(cache, monkeypatch, tmp_path, capsys):
    model, _ = _mlp_and_feed()
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    for k, v in NO_COMPILER.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["run", str(path), "--ep", "cuda", "--random-inputs"]) == 0
    out, err = capsys.readouterr()
    assert "CPUExecutionProvider: " in out + err
    assert "CUDAExecutionProvider is not available, its nodes fall back to CPUExecutionProvider" in out + err
