"""`ephost bench --shapes` (one session, shapes in turn) and `random_inputs` with sizes for symbolic dims."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

from host import cli
from host.cli import zoo
from host.cli.session_cmds import parse_shapes
from host.errors import InvalidArgument
from tests.models import dynamic


@pytest.fixture(scope="module")
def heads_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dyn") / "heads.onnx"
    onnx.save(dynamic.reshape_heads(), str(path))
    return path


def test_bench_times_each_shape_in_turn(capsys, heads_path):
    rc = cli.main(["bench", str(heads_path), "--shapes", "1x4,2x3,1x4", "--warmup", "1", "--iters", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "mode: run, shapes in turn" in out
    assert [line for line in out.splitlines() if line.startswith("shape: ")] == [
        "shape: batch=1, seq=4", "shape: batch=2, seq=3", "shape: batch=1, seq=4"]
    assert out.count("p50: ") == 3


@pytest.mark.parametrize("spec, message", [
    ("1x4x2", "--shapes: '1x4x2' gives 3 size(s); the model's inputs have 2 symbolic dim(s) ['batch', 'seq']: "
              "one size each, in that order"),
    ("1x0", "--shapes: '1x0' is not sizes joined by 'x' (e.g. 8x128); sizes are integers >= 1"),
])
def test_bad_shape_lists_are_refused(spec, message):
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        parse_shapes(spec, ["batch", "seq"])


def test_random_inputs_take_sizes_for_symbolic_dims():
    feeds = zoo.random_inputs(dynamic.bert_like(), seed=0, sizes={"batch": 3, "seq": 7})
    assert {k: v.shape for k, v in feeds.items()} == {"input_ids": (3, 7), "attention_mask": (3, 7)}
    assert all(v.dtype == np.int64 for v in feeds.values())
