"""Which inputs of an ONNX op are read on the host: shapes, axes, bounds, repeats (ABI since 7).

A value the host computes itself (its shape program; EpValueInfo.flags VALUE_HOST_COMPUTED) reaches
a v7+ EP's kernel in host memory at exactly these input positions, so a device EP can claim a
Reshape whose shape only the host knows at run time without a synchronising device read (as
onnxruntime's CUDA kernels declare such inputs OrtMemTypeCPUInput). At every other position the
host copies the value to the EP's device as before. Both sides read this one table.
"""

from __future__ import annotations

_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")

HOST_READ_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,), "Pad": (1, 2, 3), "Split": (1,),
    "Trilu": (1,), "CumSum": (1,), "Dropout": (2,), "Resize": (1, 2, 3), "TopK": (1,), "OneHot": (1,),
    **{op: (1,) for op in _REDUCE},
}


def host_read_inputs(op_type: str, domain: str = "") -> tuple[int, ...]:
    """The input positions of an ONNX-domain op that a kernel reads on the host (empty for others)."""
    if domain not in ("", "ai.onnx"):
        return ()
    return HOST_READ_INPUTS.get(op_type, ())


def host_only_values(nodes, candidates) -> set:
    """Of `candidates` (value keys: names or ids), those that every node of `nodes` reading them reads
    at a host position. `nodes`: (op_type, domain, inputs) triples of one compiled partition.

    Such a value, when the host computes it (VALUE_HOST_COMPUTED) and it enters a compiled partition
    (ABI v6 call frame), reaches a v7+ EP's Compute in host memory: the EP plans that partition per
    value (a Reshape's target shape known per input-shape signature), never reading the device."""
    candidates = set(candidates)
    data_reads = set()
    for op_type, domain, inputs in nodes:
        host = host_read_inputs(op_type, domain)
        data_reads.update(v for j, v in enumerate(inputs) if v in candidates and j not in host)
    return candidates - data_reads
