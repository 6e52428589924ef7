"""Nodes of a CPU segment whose values depend on the input shapes only: run once per signature.

A dynamic-axes export keeps data nodes over values that only the shapes decide: the causal mask
(`LessOrEqual` over two position ranges, its `Expand` and `Where`), Llama's rotary tables (`inv_freq @
positions`, `Cos`, `Sin`), GPT-2's `Slice` of its causal buffer, BERT's token-type `Expand`. Their inputs
are initializers, values of the host's shape program (host/runtime/shape_program.py: the same read-only
arrays at every run of a signature) and the outputs of other such nodes; the shape program does not take
them (their outputs are too large, or not integer shape arithmetic), so before this they ran at every
run (issue 23: 4-11 of a small export's 30-60 nodes at (1, 16)).

`Hoisted` takes them out of the segment's loop. At the start of a run it compares the shape-program
arrays they read with those of the signatures it has seen (by identity: the program hands out the same
objects per signature, and the entries here hold them, so an identity is never reused while cached); on
a match the outputs are put in place, otherwise the nodes run, in plan order, with their kernels, and
their outputs are kept (read-only, as the program's values are) for that signature. At most `ENTRIES`
signatures are kept (a new one beyond that starts over). Excluded: nodes with random output, outputs
that leave the segment (graph outputs, values read by another step) or that are not tensors.
"""

from __future__ import annotations

import numpy as np

from host.errors import EphostError

ENTRIES = 8
# Ops whose output is not a function of their inputs.
_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})


def split_hoisted(nodes: list, keep: set[int], constants: dict, plan) -> tuple[list, list]:
    """(nodes to run once per signature, the rest), both in plan order."""
    pure = set(constants) | set(plan.host_computed)
    hoisted, rest = [], []
    for node in nodes:
        ins = [v for v in node.inputs if v >= 0]
        outs = [v for v in node.outputs if v >= 0]
        if (ins and outs and node.op_type not in _RANDOM and all(v in pure for v in ins)
                and not any(v in keep or v in plan.object_ids for v in outs)):
            hoisted.append(node)
            pure.update(outs)
        else:
            rest.append(node)
    return hoisted, rest


def escaping(hoisted: list, rest: list, keep: set[int]) -> tuple[int, ...]:
    """The values leaving the segment (`keep`) that may be views of hoisted outputs: those of the other
    nodes reading, directly or through others, a hoisted output (a Reshape's or Slice's view of one)."""
    tainted = {v for n in hoisted for v in n.outputs if v >= 0}
    for node in rest:
        if any(v in tainted for v in node.inputs):
            tainted.update(v for v in node.outputs if v >= 0)
    return tuple(sorted(v for v in tainted if v in keep))


def own_copies(values: list, ids: tuple[int, ...]) -> None:
    """Values leaving the segment get their own memory where they are read-only (a view of a hoisted
    output): the caller may write into a graph output, and that must not reach the next run's values."""
    for vid in ids:
        arr = values[vid]
        if type(arr) is np.ndarray and not arr.flags.writeable:
            values[vid] = arr.copy()


class Hoisted:
    """The hoisted nodes of one segment and their outputs per signature (of the shape-program arrays read)."""

    def __init__(self, nodes: list, plan):
        self.nodes = nodes
        produced = {v for n in nodes for v in n.outputs if v >= 0}
        # The shape-program values read (the rest of the inputs are initializers or hoisted outputs).
        self.deps = tuple(sorted({v for n in nodes for v in n.inputs if v in plan.host_computed and v not in produced}))
        self.outputs = tuple(sorted(produced))
        self._cache: dict[tuple, tuple] = {}  # ids of the deps' arrays -> (those arrays, outputs' arrays)

    def restore(self, values: list, failure) -> None:
        """Put the outputs for this run's signature into `values`, running the nodes for a new one."""
        deps = [values[v] for v in self.deps]
        entry = self._cache.get(tuple(map(id, deps)))  # the entry holds its arrays: their ids stay theirs
        if entry is None:
            entry = self._compute(values, deps, failure)
        for vid, arr in zip(self.outputs, entry[1]):
            values[vid] = arr

    def _compute(self, values: list, deps: list, failure) -> tuple:
        with np.errstate(all="ignore"):
            for node in self.nodes:
                args = [values[v] if v >= 0 else None for v in node.inputs]
                try:
                    outs = node.kernel._run(*args)
                except EphostError:
                    raise
                except Exception as exc:
                    raise failure(node, values, exc) from exc
                for vid, out in zip(node.outputs, outs):
                    if vid >= 0:
                        values[vid] = np.asarray(out)
        arrays = tuple(values[v] for v in self.outputs)
        for arr in arrays:
            if arr.flags.owndata:  # shared by every run of this signature (views keep their base's flags)
                arr.flags.writeable = False
        if len(self._cache) >= ENTRIES:
            self._cache = {}
        entry = self._cache[tuple(map(id, deps))] = (tuple(deps), arrays)
        return entry
