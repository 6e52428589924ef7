"""Values the host's shape program computes reach v7+ plugin kernels in host memory
(EpValueInfo.flags VALUE_HOST_COMPUTED, since 7): flagged in the graph view, handed over without a
copy to the EP's device, so a device EP can read a Reshape's shape without synchronising; older
EPs get them on their device as before."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import abi
import host
from abi.graph_spec import read_graph
from host.plugins.hostapi import ffi
from tests.conftest import example_record
from tests.host.test_shape_program import SHAPES, _reference
from tests.models import dynamic
from tests.plugins.example_ep import MOCK_DEVICE_ENV


def _mock_device_env(path: str):
    """An environment whose ExampleEP computes in (mock) device memory the host must copy to."""
    old = os.environ.get(MOCK_DEVICE_ENV)
    os.environ[MOCK_DEVICE_ENV] = "1"
    try:
        env = host.Environment()
        env.register_plugin("ex", path)
    finally:
        if old is None:
            os.environ.pop(MOCK_DEVICE_ENV)
        else:
            os.environ[MOCK_DEVICE_ENV] = old
    return env


def test_the_view_flags_exactly_the_shape_programs_values():
    s = host.InferenceSession(dynamic.positions().SerializeToString(), providers=["CPUExecutionProvider"])
    spec = read_graph(ffi, s._partitioner.view.ptr)
    flagged = {v.name for v in spec.values if v.host_computed}
    exported = {s.plan.value_names[v] for v in s.shape_program.exported}
    assert exported and flagged == exported
    assert all(v.flags in (0, abi.VALUE_HOST_COMPUTED) for v in spec.values)
    s.close()


@pytest.mark.parametrize("version", [6, 7])
def test_program_values_reach_v7_kernels_in_host_memory(example_plugin, version):
    """positions(): Add and Mul on the mock device read the position slice and the scale the shape
    program computes; a v7 EP gets those in host memory (device_type CPU), a v6 EP on its device."""
    env = _mock_device_env(example_plugin(version))
    model = dynamic.positions()
    record = example_record(version)
    s = host.InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": "0"})],
                              env=env)
    assert set(s.node_assignment().values()) == {"ExampleEP"}
    program_reads = sum(1 for n in s.plan.nodes for v in n.inputs if v in s.plan.host_computed)
    assert program_reads > 0
    ref = _reference(model)
    rng = np.random.default_rng(5)
    record.input_devices.clear()
    for batch, seq in SHAPES:
        x = rng.standard_normal((batch, seq, 8)).astype(np.float32)
        np.testing.assert_allclose(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)
    on_host = record.input_devices[abi.DEVICE_CPU]
    assert on_host == (program_reads * len(SHAPES) if version >= 7 else 0)
    assert record.input_devices[abi.DEVICE_GPU] > 0  # X and the intermediates stay on the device
    s.close()
    gc.collect()
    env.close()
