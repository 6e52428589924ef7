"""Every way a plugin can fail to load gives a typed error naming the plugin and the cause.

File-level failures (no file, not ELF, truncated, no entry symbols, a foreign libpython, a missing
dependency) are checked before or at dlopen and run in this process. Faults injected into the
example plugin (EPHOST_TEST_FAULT) run in a fresh interpreter each, because a library is dlopened
once per process; each subprocess then loads the same library again without the fault, to show
that the host survived and still works.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sysconfig
import textwrap

import pytest

import abi
from host.errors import AbiVersionError, EphostError, InvalidArgument, PluginLoadError
from host.plugins import loader
from host.plugins.environment import Environment
from tests.abi.conftest import ABI_DIR, last_json, run_python

V = abi.ABI_VERSION


def _real(path) -> str:
    return re.escape(os.path.realpath(path))


def _gcc(cc: str, *args) -> None:
    proc = subprocess.run([cc, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"{cc} failed: {proc.stderr}")


_ENTRY_C = textwrap.dedent("""\
    #include "ep_abi.h"
    EpStatus* CreateEpFactories(const char* r, const EpApiBase* b, const EpLogger* l, EpFactory** f,
                                size_t m, size_t* n) {
      (void)r, (void)b, (void)l, (void)f, (void)m;
      *n = 0;
      return 0;
    }
    EpStatus* ReleaseEpFactory(EpFactory* f) { (void)f; return 0; }
""")


# ---- file-level failures, in process --------------------------------------------------------------

def test_nonexistent_path(tmp_path):
    path = tmp_path / "nope" / "libmissing.so"
    with pytest.raises(PluginLoadError, match=f"^plugin '{_real(path)}': no such file$"):
        Environment().register_plugin("missing", path)


def test_directory_is_not_a_plugin(tmp_path):
    with pytest.raises(PluginLoadError, match=f"^plugin '{_real(tmp_path)}': not a regular file$"):
        Environment().register_plugin("dir", tmp_path)


def test_text_file(tmp_path):
    path = tmp_path / "libtext.so"
    path.write_text("this is not a shared library\n")
    with pytest.raises(PluginLoadError,
                       match=f"^plugin '{_real(path)}': not a loadable shared library "
                             r"\(Magic number does not match\)$") as info:
        Environment().register_plugin("text", path)
    assert info.value.__cause__ is not None


def test_truncated_library(plugins, tmp_path):
    path = tmp_path / "libtruncated.so"
    shutil.copyfile(plugins.example[abi.ABI_VERSION], path)
    with path.open("r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(PluginLoadError,
                       match=f"^plugin '{_real(path)}': not a loadable shared library \\(.+\\)$") as info:
        Environment().register_plugin("truncated", path)
    # The ELF header survives the cut; reading the section headers past the end is what fails.
    assert type(info.value.__cause__).__module__.startswith("elftools."), repr(info.value.__cause__)


def test_elf_without_entry_symbols(cc, tmp_path):
    src = tmp_path / "nosym.c"
    src.write_text("int ephost_unrelated(void) { return 1; }\n")
    path = tmp_path / "libnosym.so"
    _gcc(cc, "-shared", "-fPIC", src, "-o", path)
    with pytest.raises(PluginLoadError, match=f"^plugin '{re.escape(str(path))}': missing entry symbol "
                                              "CreateEpFactories$") as info:
        Environment().register_plugin("nosym", path)
    assert isinstance(info.value.__cause__, (AttributeError, loader._MISSING_SYMBOL))  # in-line / out-of-line FFI
    assert "undefined symbol: CreateEpFactories" in str(info.value.__cause__)


def test_plugin_linked_against_another_libpython(cc, tmp_path):
    fake = tmp_path / "fakepy.c"
    fake.write_text("void Py_FakeInitialize(void) {}\n")
    _gcc(cc, "-shared", "-fPIC", "-Wl,-soname,libpython3.2.so.1.0", fake, "-o",
         tmp_path / "libpython3.2.so.1.0")
    src = tmp_path / "oldpy.c"
    src.write_text(_ENTRY_C)
    path = tmp_path / "liboldpy.so"
    _gcc(cc, "-shared", "-fPIC", "-I", ABI_DIR, src, "-o", path,
         f"-L{tmp_path}", "-Wl,--no-as-needed", "-l:libpython3.2.so.1.0")
    ours = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
    if not ours:
        pytest.skip("this interpreter reports no libpython soname, so no foreign one can be told apart")
    with pytest.raises(PluginLoadError,
                       match=f"^plugin '{_real(path)}' links libpython3\\.2\\.so\\.1\\.0, but this "
                             f"interpreter is {re.escape(ours)}; rebuild the plugin with this Python "
                             r"\(python build\.py\)$"):
        Environment().register_plugin("oldpy", path)


def test_missing_dependency_fails_at_dlopen(cc, tmp_path):
    dep = tmp_path / "dep.c"
    dep.write_text("int ephost_dep(void) { return 1; }\n")
    _gcc(cc, "-shared", "-fPIC", "-Wl,-soname,libephost_gone.so", dep, "-o", tmp_path / "libephost_gone.so")
    src = tmp_path / "needsdep.c"
    src.write_text(_ENTRY_C)
    path = tmp_path / "libneedsdep.so"
    _gcc(cc, "-shared", "-fPIC", "-I", ABI_DIR, src, "-o", path, f"-L{tmp_path}", "-Wl,--no-as-needed",
         "-lephost_gone")
    (tmp_path / "libephost_gone.so").unlink()
    with pytest.raises(PluginLoadError, match=f"^plugin '{re.escape(str(path))}': dlopen failed: .*"
                                              "libephost_gone\\.so"):
        Environment().register_plugin("needsdep", path)


def test_entry_returning_no_factory(cc, tmp_path):
    src = tmp_path / "empty.c"
    src.write_text(_ENTRY_C)
    path = tmp_path / "libempty.so"
    _gcc(cc, "-shared", "-fPIC", "-I", ABI_DIR, src, "-o", path)
    with pytest.raises(PluginLoadError, match=f"^plugin 'empty' \\({re.escape(str(path))}\\): "
                                              "CreateEpFactories returned no factory$"):
        Environment().register_plugin("empty", path)


def test_registration_name_and_host_version_are_validated(plugins):
    with pytest.raises(InvalidArgument, match=rf"^api_version {abi.ABI_VERSION + 1} is not served; "
                                              rf"allowed: 1\.\.{abi.ABI_VERSION}$"):
        Environment(api_version=abi.ABI_VERSION + 1)
    with Environment() as env:
        with pytest.raises(InvalidArgument, match="^plugin registration name must be a non-empty string"):
            env.register_plugin("", plugins.example[abi.ABI_VERSION])
        env.register_plugin("twice", plugins.example[abi.ABI_VERSION])
        with pytest.raises(InvalidArgument, match="^a plugin is already registered as 'twice'"):
            env.register_plugin("twice", plugins.example[abi.ABI_VERSION])


# ---- injected faults, one fresh interpreter each ----------------------------------------------------

_FAULT_SCRIPT = """
import json, os, sys
import abi
from abi import sdk
from host.plugins import hostapi
from host.plugins import loader
from host.plugins.environment import Environment
from host.errors import EpError
from host.plugins.hostapi import ffi

path, module, create_ep = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def describe(exc):
    return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
            "cause": repr(exc.__cause__) if exc.__cause__ is not None else None}

def live(table):
    rt = sdk.runtimes().get(module)
    return None if rt is None else rt.record.live[table]

env = Environment()
result = {}
try:
    reg = env.register_plugin("faulty", path)
    f = reg.factories[0]
    result["loaded"] = {"negotiated": f.negotiated, "declared": f.slots.declared,
                        "struct_size": f.slots.struct_size, "present": sorted(f.slots.present),
                        "devices": [d.name for d in f.devices], "name": f.name}
    if create_ep:
        out = ffi.new("Ep**")
        status = f.slots.CreateEp(f.ptr, f.device_structs, 1, ffi.NULL, 0, ffi.NULL, reg.logger, out)
        try:
            hostapi.check(status, f"{f.name}: CreateEp", EpError)
            result["ep_created"] = True
            f.slots.ReleaseEp(f.ptr, out[0])
        except EpError as exc:
            result["ep_error"] = describe(exc) | {"code": exc.code, "out_is_null": out[0] == ffi.NULL}
        try:
            from host.runtime.session import InferenceSession
        except ModuleNotFoundError:
            result["session_error"] = None
        else:
            from onnx import TensorProto, helper
            vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "abc"]
            node = helper.make_node("Add", ["a", "b"], ["c"], name="add0")
            graph = helper.make_graph([node], "g", vi[:2], vi[2:])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            try:
                InferenceSession(model.SerializeToString(), providers=["ExampleEP"], env=env)
                result["session_error"] = "no error"
            except Exception as exc:
                result["session_error"] = describe(exc)
    env.unregister_plugin("faulty")
except Exception as exc:
    result["error"] = describe(exc)
result["live_factories_after_failure"] = live("EpFactory")
result["statuses_left"] = len(hostapi.STATUSES)

# The host survived: the same library, already loaded, registers fine once the fault is gone.
del os.environ["EPHOST_TEST_FAULT"]
reg = env.register_plugin("healthy", path)
result["after"] = {"name": reg.factories[0].name, "negotiated": reg.factories[0].negotiated,
                   "live_factories": live("EpFactory")}
env.close()
result["after"]["live_factories_closed"] = live("EpFactory")
print(json.dumps(result))
"""

FAULTS = ("entry_error", "entry_null", "create_ep_fails", "version_low", "version_future", "struct_truncated",
          "struct_oversized", "null_mandatory")


@pytest.fixture(scope="module")
def fault_runs(plugins):
    """Run every fault scenario in its own interpreter, concurrently; {fault: result dict}."""
    path = plugins.example[abi.ABI_VERSION]
    module = plugins.example_module(abi.ABI_VERSION)

    def run(fault):
        create_ep = int(fault == "create_ep_fails")
        return run_python(_FAULT_SCRIPT, path, module, create_ep, EPHOST_TEST_FAULT=fault)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        procs = dict(zip(FAULTS, pool.map(run, FAULTS)))
    return {fault: last_json(proc) for fault, proc in procs.items()}


def _owner(plugins) -> str:
    return f"plugin 'faulty' \\({re.escape(str(plugins.example[abi.ABI_VERSION]))}\\)"


def _error(result: dict, expected_type: type[EphostError], pattern: str) -> None:
    err = result.get("error")
    assert err is not None, f"the registration did not fail: {result}"
    assert expected_type.__name__ in err["types"], err
    assert re.match(pattern, err["message"]), f"{err['message']!r} does not match {pattern!r}"


def _survived(result: dict) -> None:
    assert result["after"] == {"name": "ExampleEP", "negotiated": abi.ABI_VERSION, "live_factories": 1,
                               "live_factories_closed": 0}
    assert result["statuses_left"] == 0, "a status was leaked"


def test_entry_error(fault_runs, plugins):
    r = fault_runs["entry_error"]
    mod = plugins.example_module(abi.ABI_VERSION)
    _error(r, PluginLoadError, f"^{_owner(plugins)}: CreateEpFactories failed \\(FAIL\\): {mod}: "
                               "CreateEpFactories failed: injected failure in CreateEpFactories$")
    assert r["live_factories_after_failure"] == 0
    _survived(r)


def test_entry_null_table(fault_runs, plugins):
    r = fault_runs["entry_null"]
    _error(r, PluginLoadError, f"^{_owner(plugins)}: returned a NULL EpFactory table$")
    _survived(r)


def test_create_ep_fails(fault_runs, plugins):
    r = fault_runs["create_ep_fails"]
    assert "error" not in r and r["loaded"]["name"] == "ExampleEP"
    mod = plugins.example_module(abi.ABI_VERSION)
    err = r["ep_error"]
    assert "EpError" in err["types"] and err["code"] == abi.EP_FAIL and err["out_is_null"]
    assert re.match(f"^ExampleEP: CreateEp failed \\(FAIL\\): {mod}: EpFactory.CreateEp failed: "
                    "injected failure in CreateEp$", err["message"]), err["message"]
    assert "ep_created" not in r
    if r["session_error"] is not None:  # the session API is there: creating a session fails the same way
        err = r["session_error"]
        assert "EpError" in err["types"], err
        assert re.match(f"^EP 'ExampleEP' of plugin 'faulty' \\({re.escape(str(plugins.example[V]))}\\): "
                        f"CreateEp failed \\(FAIL\\): {mod}: EpFactory.CreateEp failed: injected failure in "
                        "CreateEp$", err["message"]), err["message"]
    _survived(r)


def test_version_low(fault_runs, plugins):
    r = fault_runs["version_low"]
    _error(r, AbiVersionError, f"^{_owner(plugins)}: EpFactory declares ABI version 0; this host supports "
                               f"{abi.ABI_MIN_VERSION}\\.\\.{abi.ABI_VERSION}$")
    assert r["live_factories_after_failure"] == 0, "the host did not release the rejected factory"
    _survived(r)


def test_version_future(fault_runs, plugins):
    future = abi.ABI_NEXT_GENERATION + 1
    r = fault_runs["version_future"]
    _error(r, AbiVersionError, f"^{_owner(plugins)}: EpFactory declares ABI version {future}, a future "
                               f"incompatible generation \\(>= {abi.ABI_NEXT_GENERATION}\\); this host "
                               f"supports {abi.ABI_MIN_VERSION}\\.\\.{abi.ABI_VERSION}$")
    assert r["live_factories_after_failure"] == 0
    _survived(r)


def test_struct_truncated(fault_runs, plugins):
    ffi = abi.ffi_for(abi.ABI_VERSION)
    r = fault_runs["struct_truncated"]
    cut = ffi.offsetof("EpFactory", "GetName")
    _error(r, AbiVersionError, f"^{_owner(plugins)}: EpFactory.struct_size is {cut} bytes; version "
                               f"{abi.ABI_VERSION} needs at least {ffi.sizeof('EpFactory')}$")
    assert r["live_factories_after_failure"] == 0
    _survived(r)


def test_struct_oversized_loads(fault_runs):
    """Junk after the known slots is ignored: the table loads with every slot of its version."""
    ffi = abi.ffi_for(abi.ABI_VERSION)
    r = fault_runs["struct_oversized"]
    assert "error" not in r, r
    assert r["loaded"] == {"negotiated": abi.ABI_VERSION, "declared": abi.ABI_VERSION,
                           "struct_size": ffi.sizeof("EpFactory") + 64,
                           "present": sorted(abi.slots_at("EpFactory", abi.ABI_VERSION)),
                           "devices": ["example-cpu"], "name": "ExampleEP"}
    _survived(r)


def test_null_mandatory_slot(fault_runs, plugins):
    r = fault_runs["null_mandatory"]
    _error(r, AbiVersionError, f"^{_owner(plugins)}: mandatory slot EpFactory.GetSupportedDevices is NULL$")
    assert r["live_factories_after_failure"] == 0
    _survived(r)
