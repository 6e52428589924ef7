"""Shape buckets (opt-in): pad the batch and/or sequence axis of the feeds to a few sizes, slice the outputs back.

Each distinct input shape costs a new shape-program evaluation, plan layout and, with graph capture, a
captured graph; serving stacks (vLLM, TensorRT-LLM) pad to buckets so that a handful of shapes occur.
`session.ephost.shape_buckets` = "batch:pow2", "seq:64" or both ("batch:pow2,seq:64"): each rule
names the axis and its sizes ("pow2": powers of two; N: multiples of N). Padding is refused at session
creation, with the reason, where it would change the results:
- batch: every input and output carries one symbolic dim 0, and no node mixes batch rows
  (host/runtime/batch_rows.py). Padded rows repeat the last real row (a valid input, unlike zeros for
  models that divide or index); the outputs keep the first rows.
- seq: an attention-mask input ("attention_mask", "input_mask" or "mask", [batch, seq]) exists for the
  axis and every output carries it; padded positions get 0 in every input (so mask 0: attention
  ignores them), and the outputs keep the first positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from host.errors import InvalidArgument, ModelError
from host.runtime import batch_rows

CONFIG_KEY = "session.ephost.shape_buckets"
MASK_NAMES = ("attention_mask", "input_mask", "mask")
AXES = ("batch", "seq")


@dataclass(frozen=True)
class Rule:
    """The sizes of one axis: powers of two (step 0) or multiples of `step`."""

    step: int

    def size(self, n: int) -> int:
        if n <= 0:
            return n
        if self.step == 0:
            return 1 << (n - 1).bit_length()
        return -(-n // self.step) * self.step


def parse(text: str) -> dict[str, Rule]:
    """{"batch": Rule, "seq": Rule} from the config text; "" or "off" is no bucketing."""
    rules: dict[str, Rule] = {}
    if text.strip() in ("", "off", "0"):
        return rules
    for item in text.split(","):
        axis, _, size = item.strip().partition(":")
        step = 0 if size == "pow2" else int(size) if size.isascii() and size.isdigit() and int(size) > 0 else None
        if axis not in AXES or step is None or axis in rules:
            raise InvalidArgument(
                f"session config '{CONFIG_KEY}' = {text!r}: item {item.strip()!r} is not one of 'batch:R' or "
                f"'seq:R' (each at most once, joined by ','), R being 'pow2' (powers of two) or a positive "
                f"integer N (multiples of N); e.g. 'batch:pow2,seq:64'")
        rules[axis] = Rule(step)
    return rules


def _dims(vi) -> list | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]


class Buckets:
    """The padding a session applies to each run's feeds: which axes of which inputs, to which sizes."""

    def __init__(self, rules: dict[str, Rule], pads: dict[str, list[tuple[int, str]]],
                 slices: dict[str, list[tuple[int, str]]]):
        self.rules = rules
        self.pads = pads      # input name -> [(axis, "batch" | "seq")]
        self.slices = slices  # output name -> [(axis, "batch" | "seq")]
        self._input_names: dict[int, str] = {}
        self._output_names: dict[int, str] = {}

    @classmethod
    def for_model(cls, model: onnx.ModelProto, entries: dict[str, str]) -> Buckets | None:
        """The session's buckets (None when the config entry is absent or off), or a ModelError naming why
        the model's results would change."""
        rules = parse(entries.get(CONFIG_KEY, ""))
        if not rules:
            return None
        inits = {t.name for t in model.graph.initializer}
        ins = {vi.name: _dims(vi) for vi in model.graph.input if vi.name not in inits}
        outs = {vi.name: _dims(vi) for vi in model.graph.output}
        pads: dict[str, list] = {n: [] for n in ins}
        slices: dict[str, list] = {n: [] for n in outs}
        if "batch" in rules:
            _batch_axes(model, ins, outs, pads, slices)
        if "seq" in rules:
            _seq_axes(ins, outs, pads, slices)
        return cls(rules, pads, slices)

    def bind(self, input_ids: dict[str, int], output_ids: dict[str, int]) -> None:
        """The plan's value ids of the inputs and outputs (runs pass values by id)."""
        self._input_names = {v: k for k, v in input_ids.items()}
        self._output_names = {v: k for k, v in output_ids.items()}

    def pad(self, feeds: dict[int, object]) -> tuple[dict[int, object], dict[str, int]]:
        """The feeds padded to their buckets, and the real sizes ({"batch": B, "seq": S}) to slice back to."""
        real = self._real_sizes(feeds)
        padded = {}
        for vid, value in feeds.items():
            axes = self.pads.get(self._input_names[vid])
            if not axes:
                padded[vid] = value
                continue
            widths = [(0, 0)] * value.ndim
            for axis, kind in axes:
                widths[axis] = (0, self.rules[kind].size(real[kind]) - real[kind])
            padded[vid] = _padded(value, widths, [a for a, k in axes if k == "batch"])
        return padded, real

    def unpad(self, values: list, ids: list[int], real: dict[str, int]) -> list:
        """Each output cut back to the real batch and sequence sizes."""
        out = []
        for vid, value in zip(ids, values):
            index = [slice(None)] * np.ndim(value)
            for axis, kind in self.slices.get(self._output_names[vid], ()):
                index[axis] = slice(0, real[kind])
            out.append(value[tuple(index)] if isinstance(value, np.ndarray) else value)
        return out

    def _real_sizes(self, feeds: dict[int, object]) -> dict[str, int]:
        seen: dict[str, dict[str, int]] = {}
        for vid, value in feeds.items():
            name = self._input_names[vid]
            if not isinstance(value, np.ndarray) and self.pads.get(name):
                raise InvalidArgument(f"input '{name}': shape buckets ('{CONFIG_KEY}') pad host arrays; got "
                                      f"{type(value).__name__} (pass a NumPy array, or bind bucket-sized buffers "
                                      "with run_with_iobinding)")
            for axis, kind in self.pads.get(name, ()):
                seen.setdefault(kind, {})[name] = value.shape[axis]
        real = {}
        for kind, sizes in seen.items():
            if len(set(sizes.values())) != 1:
                raise InvalidArgument(f"inputs disagree on the {kind} axis that '{CONFIG_KEY}' pads: {sizes}; "
                                      f"every input must have the same size there")
            real[kind] = next(iter(sizes.values()))
        return real


def _padded(value: np.ndarray, widths: list[tuple[int, int]], batch_axes: list[int]) -> np.ndarray:
    if not any(hi for _, hi in widths):
        return value
    seq_widths = [(0, 0) if axis in batch_axes else w for axis, w in enumerate(widths)]
    if any(hi for _, hi in seq_widths):
        value = np.pad(value, seq_widths)  # zeros: the mask's 0 hides these positions
    for axis in batch_axes:
        extra = widths[axis][1]
        if extra and value.shape[axis]:
            last = np.take(value, [value.shape[axis] - 1], axis=axis)
            value = np.concatenate([value, np.repeat(last, extra, axis=axis)], axis=axis)
    return value


def _batch_axes(model, ins: dict, outs: dict, pads: dict, slices: dict) -> None:
    first = {name: (d[0] if d else None) for name, d in {**ins, **outs}.items()}
    symbols = {d for d in first.values()}
    batch = next(iter(symbols)) if len(symbols) == 1 else None
    if not isinstance(batch, str):
        raise ModelError(f"'{CONFIG_KEY}' batch: every input and output must carry one symbolic batch dim as "
                         f"dim 0; the model's dim 0 are {first}. Remove the batch rule")
    why = batch_rows.refusal(model, batch)
    if why is not None:
        raise ModelError(f"'{CONFIG_KEY}' batch: padding the batch axis '{batch}' would change the results: "
                         f"{why}. Remove the batch rule")
    for name in ins:
        pads[name].append((0, "batch"))
    for name in outs:
        slices[name].append((0, "batch"))


def _seq_axes(ins: dict, outs: dict, pads: dict, slices: dict) -> None:
    mask = next((n for n in MASK_NAMES if n in ins), None)
    dims = ins.get(mask)
    if mask is None or dims is None or len(dims) != 2 or not isinstance(dims[1], str):
        raise ModelError(f"'{CONFIG_KEY}' seq: padding the sequence axis needs an attention mask input "
                         f"({' or '.join(MASK_NAMES)}) of shape [batch, seq] with a symbolic seq, so the padded "
                         f"positions can be masked; the model's inputs are {ins}. Remove the seq rule")
    seq = dims[1]
    missing = [n for n, d in outs.items() if not d or seq not in d]
    if missing:
        raise ModelError(f"'{CONFIG_KEY}' seq: output(s) {missing} do not carry the sequence axis '{seq}' "
                         f"(outputs: {outs}), so they cannot be cut back to the real length and may depend "
                         f"on the padding. Remove the seq rule")
    for name, d in ins.items():
        pads[name] += [(axis, "seq") for axis, x in enumerate(d or ()) if x == seq]
    for name, d in outs.items():
        slices[name] += [(axis, "seq") for axis, x in enumerate(d) if x == seq]
