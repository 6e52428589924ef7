"""`ephost ops` (host/cli/ops.py) and the generated docs/ops.md.

The CPU EP's coverage comes from its kernel table; each figure is checked against the kernels themselves
(create_kernel at that opset) and against onnx.defs. A plugin EP is probed through GetCapability: the
example plugin claims a known set of float ops (tests/plugins/example_ep.py), which the probe must find.
"""

from __future__ import annotations

import gc
from pathlib import Path

import onnx.defs
import pytest
from onnx import helper

import host
from host.cli import ops as ops_cli
from host.cli.app import main
from host.cpu_ep import create_kernel, registry, supported_ops
from host.errors import ModelError
from host.runtime.model import MAX_OPSET, MIN_OPSET
from host.runtime.node import node_info

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"
SUITE_HEADING = "\n## The ONNX backend suite"  # the hand-written section after the generated part


def generated_part() -> str:
    text = DOC.read_text()
    return text[:text.index(SUITE_HEADING)].rstrip("\n") + "\n" if SUITE_HEADING in text else text


def test_doc_matches_the_code():
    """docs/ops.md is exactly what `python -m host.cli ops --markdown` prints (regenerate it when this fails)."""
    assert generated_part() == ops_cli.format_markdown([ops_cli.cpu_ep_ops()])


def test_cli_markdown_is_the_doc(capsys):
    assert main(["ops", "--markdown"]) == 0
    assert capsys.readouterr().out == generated_part()


def test_cli_text_lists_every_cpu_op(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out.splitlines()
    # Deprecated ops (Scatter, Upsample) have kernels for old models but are not counted or listed.
    onnx_ops = [op for domain, op in supported_ops() if domain == "" and op in ops_cli.onnx_ops()]
    assert out[0].startswith(f"CPUExecutionProvider (kernel table): {len(onnx_ops)} of {len(ops_cli.onnx_ops())} "
                             "ai.onnx ops")
    listed = {line.split()[0] for line in out[1:]}
    assert listed == set(onnx_ops) | {f"ai.ephost::{op}" for d, op in supported_ops() if d == "ai.ephost"}


def _kernel_exists(op: str, opset: int) -> bool:
    node = helper.make_node(op, [], ["y"], name="n")
    try:
        create_kernel(node_info(node, opset))
    except ModelError as exc:  # no kernel, or a kernel refusing the attribute-less node
        return "has no kernel" not in str(exc)
    return True


def test_cpu_ranges_agree_with_the_kernels_and_onnx():
    """An opset is listed exactly when a kernel is found there and ONNX defines the op by then."""
    coverage = ops_cli.cpu_ep_ops().onnx_ops
    for op, versions in coverage.items():
        for opset in range(MIN_OPSET, MAX_OPSET + 1):
            defined = onnx.defs.get_schema(op, opset, "").since_version <= opset if _defined(op, opset) else False
            assert (opset in versions) == (defined and _kernel_exists(op, opset)), (op, opset)
    # Every op the window reaches is served through the newest opset, except those whose kernel stops at
    # an opset where the op changed (its registry entry's `until`).
    gated = {op for (domain, op), entries in registry.CPU_KERNELS.items() if all(e[1] is not None for e in entries)}
    assert all(v[-1] == MAX_OPSET for op, v in coverage.items() if op not in gated)


def _defined(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


def test_onnx_total_leaves_out_deprecated_and_future_ops():
    total = ops_cli.onnx_ops()
    assert "Upsample" not in total and "Scatter" not in total  # deprecated
    assert total["Attention"] == 23 and total["Gelu"] == 20
    later = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""} - set(total)
    assert all(min(s.since_version for s in onnx.defs.get_all_schemas_with_history()
                   if s.name == op and s.domain == "") > MAX_OPSET or op in ("Upsample", "Scatter") for op in later)


@pytest.mark.parametrize(("versions", "text"), [([], ""), ([7], "7"), ([7, 8, 9], "7-9"),
                                               ([7, 8, 11, 13, 14], "7-8, 11, 13-14")])
def test_opset_ranges(versions, text):
    assert ops_cli.opset_ranges(versions) == text


def test_probe_graph_has_one_node_per_op():
    graph, which = ops_cli.probe_graph(17)
    assert len(graph.nodes) == len(which)
    expected = {op for op, first in ops_cli.onnx_ops().items() if first <= 17}
    assert {op for domain, op in which if domain == ""} == expected
    assert {op for domain, op in which if domain == "ai.ephost"} == set(ops_cli.EPHOST_OPS)


# The example EP claims these ops for float inputs (tests/plugins/example_ep.py); Identity is its pass-through.
EXAMPLE_OPS = {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "MatMul", "Identity"}


@pytest.fixture
def example_env(example_plugin):
    env = host.Environment()
    env.register_plugin("ex", example_plugin(6))
    yield env
    gc.collect()
    env.close()


def test_plugin_probe_finds_what_the_example_ep_claims(example_env):
    eps = ops_cli.collect(example_env, ["ExampleEP"])
    assert [e.ep for e in eps] == ["CPUExecutionProvider", "ExampleEP"]
    example = eps[1]
    assert example.how == "GetCapability probe"
    assert set(example.onnx_ops) == EXAMPLE_OPS
    for op, versions in example.onnx_ops.items():
        first = ops_cli.onnx_ops()[op]
        assert versions == list(range(max(first, MIN_OPSET), MAX_OPSET + 1)), op
    assert example.ephost_ops == {}


def test_cli_probes_a_plugin(example_plugin, capsys):
    """`ephost ops --plugin PATH --ep ExampleEP` prints the CPU EP, then the probed plugin EP."""
    path = example_plugin(6)
    assert main(["ops", "--plugin", f"ex={path}", "--ep", "ExampleEP"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("ExampleEP (GetCapability probe)"):].splitlines()
    assert section[0].startswith(f"ExampleEP (GetCapability probe): {len(EXAMPLE_OPS)} of ")
    assert {line.split()[0] for line in section[1:]} == EXAMPLE_OPS
