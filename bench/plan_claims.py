"""Which nodes of a model the CUDA EP's compiled plans would take, in which groups, and why the others not.

Runs on a machine without a GPU: the host's optimizer, symbolic shapes and shape program run as a
session would (CPU EP), then the CUDA plugin's pure-Python claim code (plugin_cuda/plan/partition.py
`fusable_groups` with symbolic dims checked at the probe size, lower.py `unsupported_reason`) reads the
graph the session's view shows a plugin (VALUE_HOST_COMPUTED flags included).

    python -m bench.plan_claims MODEL.onnx [--static] [--nodes]

Prints the group sizes (each group is one compiled partition), then the refused nodes counted by
(op, reason); `--nodes` lists each refused node with its inputs (name, shape, element type, whether
the host computes it).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def claims(path: str, dynamic: bool = True) -> tuple[list, list]:
    """(groups of node indices, [(node, reason)] for the data nodes no plan takes)."""
    import host
    from abi.graph_spec import read_graph
    from host.plugins.hostapi import ffi
    from plugin_cuda.plan.lower import PROBE_DIM, unsupported_reason
    from plugin_cuda.plan.partition import fusable_groups, shape_arithmetic_values

    sess = host.InferenceSession(path, providers=["CPUExecutionProvider"])
    part = sess._partitioner
    graph = read_graph(ffi, part.view.ptr)
    shape_values = shape_arithmetic_values(graph)

    def accept(node):  # as CudaEp.claim_fused: shape arithmetic stays on the host
        outs = [v for v in node.outputs if v >= 0]
        return not (outs and all(v in shape_values for v in outs))

    groups = fusable_groups(graph, accept, dynamic=dynamic)
    refused = []
    for node in graph.nodes:
        if node.index in part.graph.shape_nodes:
            continue  # the host's shape program: never a plugin's
        reason = unsupported_reason(graph, node, probe=PROBE_DIM if dynamic else None)
        if not reason and not accept(node):
            reason = "shape arithmetic (the host keeps it)"
        if reason:
            refused.append((graph, node, reason))
    sess.close()
    return groups, refused


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--static", action="store_true", help="as with plan_dynamic_shapes=0")
    p.add_argument("--nodes", action="store_true", help="list every refused node with its inputs")
    args = p.parse_args(argv)
    groups, refused = claims(args.model, dynamic=not args.static)
    print(f"{len(groups)} compiled partitions, sizes {[len(g) for g in groups]}")
    for (op, reason), count in Counter((n.op_type, r) for _, n, r in refused).most_common():
        print(f"{count:4d}  {op}: {reason}")
    if args.nodes:
        for graph, node, reason in refused:
            ins = [(graph.values[v].name, graph.values[v].shape, graph.values[v].elem_type,
                    "host" if graph.values[v].host_computed else "") for v in node.inputs if v >= 0]
            print(f"{node.name} ({node.op_type} {node.attrs}): {reason}; inputs {ins}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
