"""CPU shape computations beside a CUDA graph (GRAPH_ALLOW_CPU_FOR_SHAPES): their results, copied to
the device for a kernel of the capture run, are part of the graph. GPU only.

Found on BERT-base exported by transformers 5.x (H100): the position ids (an Expand of Range(seq) over
[batch, seq]) stay on the CPU EP; copied at once on the default stream during capture, the copy landed
before the recorded kernels ran, in a block an earlier recorded kernel wrote later, so the capture run
and every replay read other data (max error 2.8 against onnxruntime, eager exact)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

from host.runtime.session import InferenceSession
from tests.host.test_capture_shape_values import _model

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"


@pytest.fixture
def v6_env(cp):
    """The CUDA plugin built for ABI v6: no VALUE_HOST_COMPUTED flags, so it leaves every shape value to
    the host (plan/partition.py host_shape_values) and the position ids stay a CPU-EP node."""
    import gc

    import host
    from tests.conftest import built_plugin

    env = host.Environment()
    env.register_plugin("cuda", str(built_plugin("cuda", 6)))
    yield env
    gc.collect()
    env.close()


@pytest.mark.parametrize("version", [6, 7])
@pytest.mark.parametrize("compiled", ["1", "0"])
def test_position_ids_from_the_cpu_are_captured_with_the_graph(cp, genv, v6_env, compiled, version):
    """v6: the position ids are a CPU node whose copy the graph records; v7: the EP computes them
    (only its kernels read them), from the program's values copied once per signature."""
    model = _model(ids_from_data=False)
    s = InferenceSession(model.SerializeToString(), providers=[
        (CUDA, {"enable_cuda_graph": "1", "use_tf32": "0", "compiled_plan": compiled})],
        env=v6_env if version == 6 else genv)
    where = s.node_assignment()
    assert where["positions"] == ("CPUExecutionProvider" if version == 6 else CUDA) and where["embed"] == CUDA, where
    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    bufs = {}
    binding = s.io_binding()
    for b, seq in [(2, 5), (3, 7), (2, 5), (3, 7), (2, 5)]:
        if (b, seq) not in bufs:
            bufs[(b, seq)] = (cp.zeros((b, seq, 8), cp.float32), cp.zeros((b, seq, 8), cp.float32))
        x, y = bufs[(b, seq)]
        host_x = rng.standard_normal((b, seq, 8)).astype(np.float32)
        x.set(host_x)
        cp.cuda.get_current_stream().synchronize()
        binding.bind_input("X", x)
        binding.bind_output("Y", y)
        for _ in range(2):  # the capture run and a replay (or two replays)
            y.fill(np.nan)
            cp.cuda.get_current_stream().synchronize()  # the EP's stream does not wait for this one
            s.run_with_iobinding(binding)
            cp.cuda.Device().synchronize()
            np.testing.assert_allclose(cp.asnumpy(y), ref.run(None, {"X": host_x})[0], rtol=1e-6, atol=1e-6)
    assert s.fallbacks["graph_captured"] == 2, dict(s.fallbacks)
