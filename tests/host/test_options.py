"""Honest options: SessionOptions/RunOptions take only known attributes, check their values, and
every accepted option either does what it says (observed here) or is listed as ignored in
docs/onnxruntime.md. Also the provider argument forms of InferenceSession."""

from __future__ import annotations

import gc
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import host
from host.errors import EpError, InvalidArgument
from host.runtime import ort_api
from host.runtime.options import (
    RUN_OPTIONS,
    SESSION_OPTIONS,
    ExecutionMode,
    OrtExecutionProviderDevicePolicy,
    RunOptions,
    SessionOptions,
    UnknownOptionError,
)
from host.runtime.session import InferenceSession

ROOT = Path(__file__).resolve().parents[2]


def chain_model():
    """Z = relu(X + Y) * X over (2, 3); nodes add, relu, mul."""
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZ")
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", [x, y], [z]), opset_imports=[helper.make_opsetid("", 17)])


def matmul_model(n=64):
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [n, n])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [n, n])
    c = helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])
    return helper.make_model(helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"], name="mm")],
                                               "mm", [a, b], [c]), opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def feeds():
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal((2, 3)).astype(np.float32) for k in "XY"}


@pytest.fixture
def env5(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(5))
    yield env
    gc.collect()
    env.close()


@pytest.fixture
def ephost_logger_level():
    logger = logging.getLogger("ephost")
    before = logger.level
    yield logger
    logger.setLevel(before)


# ---- unknown names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, typo, suggestion", [
    (SessionOptions, "graph_optimisation_level", "graph_optimization_level"),
    (SessionOptions, "intra_op_threads", "intra_op_num_threads"),
    (SessionOptions, "enable_profile", "enable_profiling"),
    (RunOptions, "terminat", "terminate"),
    (RunOptions, "log_severity", "log_severity_level"),
])
def test_a_typo_is_rejected_with_the_nearest_name(cls, typo, suggestion):
    opts = cls()
    msg = rf"^{cls.__name__} has no option '{typo}'; did you mean '{suggestion}'\?$"
    with pytest.raises(UnknownOptionError, match=msg):
        setattr(opts, typo, 1)
    with pytest.raises(UnknownOptionError, match=msg):
        getattr(opts, typo)


def test_unknown_option_error_is_an_attribute_error_and_an_invalid_argument():
    so = SessionOptions()
    with pytest.raises(AttributeError):
        so.nothing_like_it = 1
    with pytest.raises(InvalidArgument, match=r"^SessionOptions has no option 'zzz'; known options: enable_cpu_mem_arena, "):
        so.zzz = 1
    assert not hasattr(so, "zzz")  # hasattr sees an AttributeError, as with onnxruntime
    assert "zzz" not in dir(so) and "intra_op_num_threads" in dir(so)


@pytest.mark.parametrize("name, value, message", [
    ("intra_op_num_threads", -1, r"^SessionOptions.intra_op_num_threads must be an integer >= 0; got -1$"),
    ("intra_op_num_threads", "4", r"^SessionOptions.intra_op_num_threads must be an integer >= 0; got '4'$"),
    ("intra_op_num_threads", True, r"^SessionOptions.intra_op_num_threads must be an integer >= 0; got True$"),
    ("log_severity_level", 7, r"^SessionOptions.log_severity_level must be -1 \(unset\) or 0..4 "),
    ("enable_profiling", "yes", r"^SessionOptions.enable_profiling must be True or False; got 'yes'$"),
    ("execution_mode", 5, r"^SessionOptions.execution_mode must be ExecutionMode.ORT_SEQUENTIAL or ORT_PARALLEL"),
    ("profile_file_prefix", 3, r"^SessionOptions.profile_file_prefix must be a string; got int 3$"),
    ("graph_optimization_level", 5, r"^graph_optimization_level 5 is not a level; allowed: ORT_DISABLE_ALL=0"),
])
def test_bad_values_are_rejected_and_the_old_value_kept(name, value, message):
    so = SessionOptions()
    before = getattr(so, name)
    with pytest.raises(InvalidArgument, match=message):
        setattr(so, name, value)
    assert getattr(so, name) == before


def test_values_read_back_as_onnxruntime_types():
    so = SessionOptions()
    assert so.graph_optimization_level == host.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.graph_optimization_level = host.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert type(so.graph_optimization_level) is host.GraphOptimizationLevel
    so.execution_mode = 1
    assert so.execution_mode is ExecutionMode.ORT_PARALLEL
    so.optimized_model_filepath = Path("out.onnx")
    assert so.optimized_model_filepath == "out.onnx"


def test_every_ignored_option_is_listed_in_the_docs_and_no_honoured_one_is():
    text = (ROOT / "docs" / "onnxruntime.md").read_text()
    section = text.split("### Accepted and ignored", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    listed = set(re.findall(r"`(\w+)\.(\w+)`", section))
    ignored = {("SessionOptions", n) for n, o in SESSION_OPTIONS.items() if not o.honoured}
    ignored |= {("RunOptions", n) for n, o in RUN_OPTIONS.items() if not o.honoured}
    assert listed == ignored


def test_session_keeps_a_copy_of_its_options():
    so = SessionOptions()
    so.intra_op_num_threads = 3
    so.add_session_config_entry("k", "v")
    s = InferenceSession(chain_model(), so)
    so.intra_op_num_threads = 5
    so.add_session_config_entry("k", "changed")
    kept = s.get_session_options()
    assert kept is not so and kept.intra_op_num_threads == 3 and kept.get_session_config_entry("k") == "v"


# ---- honoured options, observed -------------------------------------------------------------------
@pytest.mark.parametrize("severity, info_logged", [(0, True), (1, True), (2, False), (3, False)])
def test_log_severity_level_sets_the_ephost_logger(caplog, ephost_logger_level, severity, info_logged):
    so = SessionOptions()
    so.log_severity_level = severity
    so.logid = "my-session"
    with caplog.at_level(logging.DEBUG, logger="ephost"):  # DEBUG until the session sets its level
        InferenceSession(chain_model(), so)
        assert ephost_logger_level.level == ort_api.LOG_LEVELS[severity]
    created = [r for r in caplog.records if r.name == "ephost" and "my-session: 3 nodes on" in r.getMessage()]
    assert bool(created) is info_logged


def test_log_severity_unset_leaves_the_logger_alone(ephost_logger_level):
    ephost_logger_level.setLevel(logging.ERROR)
    InferenceSession(chain_model(), SessionOptions())
    assert ephost_logger_level.level == logging.ERROR


def test_run_options_terminate_refuses_runs_until_reset(feeds):
    s = InferenceSession(chain_model())
    ro = RunOptions()
    ro.terminate = True
    msg = r"^run not started: RunOptions.terminate is True; set it to False to run again$"
    with pytest.raises(EpError, match=msg):
        s.run(None, feeds, ro)
    b = s.io_binding()
    for k, v in feeds.items():
        b.bind_input(k, v)
    b.bind_output("Z")
    with pytest.raises(EpError, match=msg):
        s.run_with_iobinding(b, ro)
    ro.terminate = False
    np.testing.assert_allclose(s.run(None, feeds, ro)[0], np.maximum(feeds["X"] + feeds["Y"], 0) * feeds["X"])


# ---- InferenceSession arguments -------------------------------------------------------------------
def test_a_bare_provider_string_is_one_provider(feeds):
    s = InferenceSession(chain_model(), providers="CPUExecutionProvider")
    assert s.get_providers() == ["CPUExecutionProvider"]


@pytest.mark.parametrize("kwargs, message", [
    ({"providers": ["CPUExecutionProvider"], "provider_options": [{}, {}]},
     r"^'providers' and 'provider_options' should be the same length if both are given; got 1 and 2$"),
    ({"providers": [("CPUExecutionProvider", {})], "provider_options": [{}]},
     r"^Only string values for 'providers' are supported if 'provider_options' is given$"),
    ({"providers": ["CPUExecutionProvider"], "provider_options": ["x"]},
     r"^'provider_options' values must be dicts$"),
    ({"provider_options": [{}]}, r"^'provider_options' given without 'providers'; pass both, of the same length$"),
    ({"providers": 3}, r"^'providers' should be a sequence; got int$"),
    ({"providers": ["NoSuchEP"]}, r"^execution provider 'NoSuchEP' is not registered; available: "),
    ({"sess_option": SessionOptions()},
     r"^InferenceSession got unexpected keyword argument\(s\) \['sess_option'\]; did you mean 'sess_options'\?$"),
    ({"sess_options": {"intra_op_num_threads": 1}}, r"^sess_options must be a SessionOptions; got dict$"),
])
def test_bad_session_arguments(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        InferenceSession(chain_model(), **kwargs)


def test_provider_options_reach_the_plugin_in_every_form(env5, feeds):
    want = np.maximum(feeds["X"] + feeds["Y"], 0) * feeds["X"]
    forms = [dict(providers=[("ExampleEP", {"ops": "Add"})]),
             dict(providers=["ExampleEP"], provider_options=[{"ops": "Add"}]),
             dict(providers="ExampleEP", provider_options={"ops": "Add"})]
    for kw in forms:
        s = InferenceSession(chain_model(), env=env5, **kw)
        assert s.node_assignment() == {"add": "ExampleEP", "relu": "CPUExecutionProvider",
                                       "mul": "CPUExecutionProvider"}, kw
        assert s.get_provider_options() == {"ExampleEP": {"ops": "Add"}, "CPUExecutionProvider": {}}
        np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-6)


def test_add_provider_for_devices_picks_the_plugin_with_its_options(env5, feeds):
    devices = ort_api.ep_devices(env5)
    example = [d for d in devices if d.ep_name == "ExampleEP"]
    assert [d.ep_name for d in devices] == ["ExampleEP", "CPUExecutionProvider"]
    assert example[0].device.type == host.OrtHardwareDeviceType.CPU
    so = SessionOptions()
    so.add_provider_for_devices(example, {"ops": "Mul"})
    s = InferenceSession(chain_model(), so, env=env5)
    assert s.node_assignment()["mul"] == "ExampleEP" and s.node_assignment()["add"] == "CPUExecutionProvider"
    with pytest.raises(InvalidArgument, match=r"^providers are given both as 'providers' and through SessionOptions"):
        InferenceSession(chain_model(), so, providers=["ExampleEP"], env=env5)
    with pytest.raises(InvalidArgument, match=r"^add_provider_for_devices: ExampleEP was already added$"):
        so.add_provider_for_devices(example, {})
    with pytest.raises(InvalidArgument, match=r"^add_provider_for_devices: the devices belong to several EPs "
                                              r"\['CPUExecutionProvider', 'ExampleEP'\]"):
        SessionOptions().add_provider_for_devices(devices, {})
    with pytest.raises(InvalidArgument, match=r"^add_provider_for_devices needs a non-empty list of devices"):
        SessionOptions().add_provider_for_devices([], {})


@pytest.mark.parametrize("policy", list(OrtExecutionProviderDevicePolicy))
def test_provider_selection_policy_uses_ep_devices(env5, policy):
    # ExampleEP's device is a CPU: every policy takes it (GPU-first ones find no GPU EP before it).
    so = SessionOptions()
    so.set_provider_selection_policy(policy)
    s = InferenceSession(chain_model(), so, env=env5)
    assert s.get_providers() == ["ExampleEP", "CPUExecutionProvider"]
    assert set(s.node_assignment().values()) == {"ExampleEP"}


def test_bad_selection_policy():
    with pytest.raises(InvalidArgument, match=r"^provider selection policy must be one of DEFAULT, PREFER_CPU, "):
        SessionOptions().set_provider_selection_policy(42)
