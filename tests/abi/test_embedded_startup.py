"""A cffi-embedded plugin starts even when something in the process has looked up an attribute on
the capsule type (Python 3.8-3.11: cffi's start-up spins on PyCapsule_Type.tp_version_tag until it
is 0, and the type cache sets it; anyio's pytest plugin, which Ray brings, does so at start-up).
Run in a subprocess: without the host's reset the load never returns."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, built_plugin

_SCRIPT = textwrap.dedent("""
    import ctypes, datetime, sys
    sys.path.insert(0, sys.argv[1])
    capsule_type = type(datetime.datetime_CAPI)
    getattr(capsule_type, "no_such_attribute", None)  # the type cache gives the type a version tag
    class Probe:
        pass
    # Where tp_version_tag lives: the field a lookup changes on a fresh type besides tp_flags.
    before = [ctypes.c_uint.from_address(id(Probe) + o).value for o in range(0, 512, 4)]
    getattr(Probe, "no_such_attribute", None)
    after = [ctypes.c_uint.from_address(id(Probe) + o).value for o in range(0, 512, 4)]
    changed = [4 * i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    tag = max(changed)
    print("tag before load", ctypes.c_uint.from_address(id(capsule_type) + tag).value, flush=True)
    from host.plugins.environment import Environment
    env = Environment()
    env.register_plugin("ex", sys.argv[2])
    print("loaded", flush=True)
    env.close()
""")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="cffi uses another field on Python 3.12+, which nothing sets")
def test_a_plugin_loads_after_the_capsule_type_got_a_version_tag():
    plugin = built_plugin("example", 6)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), str(plugin)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] != "tag before load 0", "the set-up did not give the capsule type a version tag"
    assert lines[-1] == "loaded"
