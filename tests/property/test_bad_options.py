"""Property 4: every invalid option set gives a typed error that names the option, and nothing
is left broken: sessions created afterwards work (run and compared with the references).

- CUDA provider options through `plugin_cuda.options.parse_options` (no GPU needed): unknown
  keys, malformed booleans/integers/pointers, duplicates through prefixes, devices that do not
  exist, and the mutually exclusive combinations -> OptionError naming the option.
- ExampleEP through InferenceSession: unknown keys -> host.errors.InvalidArgument naming them.
- Run options: a malformed gpu_graph_id on a capturing session -> InvalidArgument.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host.errors import InvalidArgument, ModelError
from host.plugins import hostapi
from host.runtime.session import InferenceSession
from plugin_cuda.options import CudaOptions, OptionError, parse_options
from tests.property import harness as h
from tests.property import strategies as s

DEFAULTS = {f.name: f.default for f in dataclasses.fields(CudaOptions)}


# ---- CUDA options ----------------------------------------------------------------------------------
@given(data=st.data(), device_count=st.integers(1, 4))
@settings(deadline=None, max_examples=s.budget(100))
def test_valid_cuda_options_parse_to_their_values(data, device_count):
    raw, want = data.draw(s.valid_cuda_options(device_count))
    parsed = dataclasses.asdict(parse_options(raw, device_count))
    assert parsed == {**DEFAULTS, **want}


@given(data=st.data(), device_count=st.integers(1, 4))
@settings(deadline=None, max_examples=s.budget(200))
def test_invalid_cuda_options_raise_option_error_naming_the_option(data, device_count):
    bad = data.draw(s.invalid_cuda_options(device_count))
    with pytest.raises(OptionError) as info:
        parse_options(bad.raw, device_count)
    msg = str(info.value)
    assert any(name in msg for name in bad.names), f"{msg!r} names none of {bad.names}"
    # The parser keeps no state: a valid set parses right after.
    raw, want = data.draw(s.valid_cuda_options(device_count))
    assert dataclasses.asdict(parse_options(raw, device_count)) == {**DEFAULTS, **want}


@given(data=st.data())
@settings(deadline=None, max_examples=s.budget(25))
def test_no_cuda_device_refuses_every_option_set(data):
    raw, _ = data.draw(s.valid_cuda_options(1))
    with pytest.raises(OptionError, match=r"device_id"):
        parse_options(raw, 0)


# ---- ExampleEP through the host ----------------------------------------------------------------------
@given(case=s.graphs(max_nodes=4), host=s.versions, plugin=s.versions, opts=s.example_ep_options(),
       unknown=st.dictionaries(s.unknown_example_keys, st.text(alphabet=st.characters(codec="utf-8",
                                                                                    exclude_characters="\x00"),
                                                                  max_size=6), min_size=1, max_size=3))
@settings(deadline=None)
def test_unknown_example_options_are_invalid_argument_and_later_sessions_work(case, host, plugin, opts, unknown):
    refs = h.References(case)
    statuses = len(hostapi.STATUSES)
    with h.example_env(host, [plugin]) as env:
        before = dict(h.record(plugin).live)
        with pytest.raises(InvalidArgument, match=r"^EP 'ExampleEP' of plugin .* CreateEp failed \(INVALID_ARGUMENT\)"
                                                  r": .*unknown option\(s\) \[.*\] for ExampleEP") as info:
            h.session(case, env, {**opts, **unknown})
        for key in unknown:
            assert repr(key) in str(info.value)
        del info
        assert {k: v for k, v in h.record(plugin).live.items() if v != before.get(k, 0)} == {}
        opts = {k: v for k, v in opts.items() if k != "enable_graph"}  # capture is property 1's business
        sess = h.session(case, env, opts)
        try:
            refs.check(sess.run(None, case.feeds), case.feeds, "session after a refused one")
        finally:
            sess.close()
    assert len(hostapi.STATUSES) == statuses


@given(case=s.elementwise_graphs(max_nodes=3), host=s.versions, plugin=s.versions, null_slots=s.null_slot_sets,
       opts=s.example_ep_options(ops_subset=False), gid=s.malformed_graph_ids, good=s.run_options)
@settings(deadline=None, max_examples=s.budget(20))
def test_malformed_graph_id_is_invalid_argument_and_the_session_goes_on(case, host, plugin, null_slots, opts, gid,
                                                                        good):
    """Whether or not the session captures, and whichever way it runs: the EP never sees a bad id."""
    refs = h.References(case)
    bad = s.RunOpts(gid, good.disable_sync).make()
    message = r"^run option gpu_graph_id must be an integer >= -1 \(-1 runs without capture\); got "
    with h.example_env(host, [plugin]) as env:
        sess = h.session(case, env, h.with_null_slots(opts, null_slots))
        try:
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            with pytest.raises(InvalidArgument, match=message):
                sess.run(None, case.feeds, bad)
            with pytest.raises(InvalidArgument, match=message):
                sess.run_with_iobinding(b, bad)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # capture never reached: property 1's business
                sess.run_with_iobinding(b, good.make())
            refs.check([outs[n] for n in refs.names], case.feeds, "bound run after a refused one")
            refs.check(sess.run(None, case.feeds2, good.make()), case.feeds2, "eager run after a refused one")
        finally:
            sess.close()


# ---- the exact text of every CUDA option error ---------------------------------------------------------
# The messages are part of the contract (what was expected, what arrived, what is allowed), so each
# is pinned whole: a dropped clause or a wrong range in the text is a bug a user reads.
ALLOWED_KEYS = ("arena.max_mem, arena.use_cuda_mempool, attention_kernel, compiled_plan, cudnn_conv_algo_search, "
                "debug_force_capture_failure, device_id, "
                "do_copy_in_default_stream, enable_cuda_graph, gpu_external_alloc, gpu_external_empty_cache, "
                "gpu_external_free, min_num_runs_before_cuda_graph_capture, plan_auto_graph, plan_dynamic_shapes, plan_shape_cache, plan_shape_cache_mb, use_ep_level_unified_stream, "
                "use_tf32, user_compute_stream")
OPTION_ERRORS = [
    ({"use_tf32": "yes"}, 1, "option use_tf32='yes': expected a boolean; allowed: 0, 1, true, false"),
    ({"ep.cuda.arena.max_mem": "1_000"}, 1, "option ep.cuda.arena.max_mem='1_000': expected a decimal integer >= 0"),
    ({"min_num_runs_before_cuda_graph_capture": "-1"}, 1,
     "option min_num_runs_before_cuda_graph_capture='-1': must be >= 0"),
    ({"user_compute_stream": "0xzz"}, 1, "option user_compute_stream='0xzz': expected an address in decimal or 0x-hex"),
    ({"gpu_external_alloc": "-5", "gpu_external_free": "1"}, 1,
     "option gpu_external_alloc='-5': address out of range 0..2**64-1"),
    ({"user_compute_stream": str(1 << 64)}, 1, f"option user_compute_stream='{1 << 64}': address out of range 0..2**64-1"),
    ({"user_compute_stream": hex(2 << 64)}, 1, f"option user_compute_stream='{hex(2 << 64)}': address out of range "
                                               "0..2**64-1"),
    ({"ep.cuda.nope": "1"}, 1, f"unknown option 'ep.cuda.nope' for CUDAExecutionProvider; allowed: {ALLOWED_KEYS} "
                               "(optionally prefixed with 'ep.cuda.')"),
    ({"ep.cuda.use_tf32": "1", "use_tf32": "0"}, 1, "option 'use_tf32' given twice (as 'ep.cuda.use_tf32' and 'use_tf32')"),
    ({"device_id": "1"}, 1, "option device_id=1: no such CUDA device; allowed: 0..0"),
    ({"device_id": "2"}, 2, "option device_id=2: no such CUDA device; allowed: 0..1"),
    ({"device_id": "3"}, 3, "option device_id=3: no such CUDA device; allowed: 0..2"),
    ({}, 0, "option device_id=0: no such CUDA device; allowed: none (no CUDA device)"),
    ({"gpu_external_alloc": "0x10"}, 1,
     "option gpu_external_alloc needs both gpu_external_alloc and gpu_external_free; only one was given"),
    ({"gpu_external_free": "0x10"}, 1,
     "option gpu_external_free needs both gpu_external_alloc and gpu_external_free; only one was given"),
    ({"gpu_external_empty_cache": "0x10"}, 1,
     "option gpu_external_empty_cache needs gpu_external_alloc and gpu_external_free"),
    ({"user_compute_stream": "16", "gpu_external_alloc": "0x20", "gpu_external_free": "0x30"}, 1,
     "options user_compute_stream and gpu_external_alloc cannot be combined: "
     "the external allocator is not ordered on the caller's stream"),
    ({"gpu_external_alloc": "0x20", "gpu_external_free": "0x30", "arena.max_mem": "1"}, 1,
     "options gpu_external_alloc and arena.* cannot be combined: the external allocator manages its own memory"),
]


@pytest.mark.parametrize("raw, device_count, message", OPTION_ERRORS, ids=[m[:48] for _, _, m in OPTION_ERRORS])
def test_each_cuda_option_error_has_its_whole_message(raw, device_count, message):
    with pytest.raises(OptionError) as info:
        parse_options(raw, device_count)
    assert str(info.value) == message


def test_option_values_at_their_edges_parse():
    """Zero and the largest address are valid; decimal and hex name the same address; integers are base 10."""
    top = (1 << 64) - 1
    o = parse_options({"user_compute_stream": str(top), "arena.max_mem": "0", "device_id": "0",
                       "min_num_runs_before_cuda_graph_capture": "010"}, 1)
    assert (o.user_compute_stream, o.arena_max_mem, o.min_num_runs_before_cuda_graph_capture) == (top, 0, 10)
    assert parse_options({"user_compute_stream": "0"}, 1).user_compute_stream == 0
    assert parse_options({"user_compute_stream": "0x0"}, 1).user_compute_stream == 0
    assert parse_options({"user_compute_stream": "0010"}, 1).user_compute_stream == 10
    assert parse_options({"user_compute_stream": hex(top)}, 1).user_compute_stream == top
    assert parse_options({"device_id": "3"}, 4).device_id == 3


def test_without_a_device_check_every_device_id_parses_but_the_rest_is_still_validated():
    """No GPU: options are still validated, only device_id's range cannot be."""
    assert parse_options({"device_id": "7"}, 0, check_device=False).device_id == 7
    with pytest.raises(OptionError, match="^option gpu_external_empty_cache needs"):
        parse_options({"gpu_external_empty_cache": "1"}, 0, check_device=False)


# ---- the host's own refusals: provider entries, option text, nodes no EP supports ----------------------------
@pytest.mark.parametrize("entry", [(1, {}), ("ExampleEP", {}, "extra"), ("ExampleEP",), ("ExampleEP", "ops=Add"), 5,
                                   ["ExampleEP", {"ops": "Add"}, {}]])
def test_a_malformed_provider_entry_is_named_whole(entry):
    want = f"a provider must be a name or (name, options dict); got {entry!r}"
    with h.example_env(5, [5]) as env:
        with pytest.raises(InvalidArgument, match="^" + re.escape(want) + "$"):
            InferenceSession(h.chain_case().model, h.session_options(), providers=[entry], env=env)


@pytest.mark.parametrize("key, value, what, why", [
    ("ops\0x", "Add", "key", "contains a NUL character; keys and values must be plain text"),
    ("ops", "Add\0", "value", "contains a NUL character; keys and values must be plain text"),
    ("\ud800", "1", "key", "is not encodable as UTF-8 (surrogates not allowed)"),
    ("min_runs", "\ud800", "value", "is not encodable as UTF-8 (surrogates not allowed)"),
])
def test_option_text_that_cannot_reach_the_plugin_is_refused_whole(key, value, what, why):
    want = f"ExampleEP option {key!r}: the {what} {why}"
    with h.example_env(5, [5]) as env:
        with pytest.raises(InvalidArgument, match="^" + re.escape(want) + "$"):
            InferenceSession(h.chain_case().model, h.session_options(), providers=[("ExampleEP", {key: value})],
                             env=env)


def test_nodes_no_ep_supports_are_all_named():
    """Every unsupported node is listed (not only the first), with its domain (ai.onnx for the default
    one) and opset; the supported node between them does not stop the scan."""
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("X", "Z")]
    nodes = [helper.make_node("Hardmax", ["X"], ["a"], name="h", domain="com.example"),
             helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Shrink", ["b"], ["c"], name="s", domain="com.example"),
             helper.make_node("Twist", ["c"], ["Z"], name="t", domain="com.example")]
    model = helper.make_model(helper.make_graph(nodes, "g", vi[:1], vi[1:]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 2)])
    model.ir_version = 10
    want = ("no execution provider supports 3 node(s): 'h' (com.example::Hardmax, opset 2), "
            "'s' (com.example::Shrink, opset 2), 't' (com.example::Twist, opset 2)")
    with h.example_env(5, [5]) as env:
        with pytest.raises(ModelError, match="^" + re.escape(want) + "$"):
            InferenceSession(model, h.session_options(), providers=["ExampleEP"], env=env)
