"""Small dynamic-axes exports of Hugging Face models, for tests/host/test_hf_dynamic.py (issue 23).

    python -m tests.models.make_hf_dynamic [--out tests/models/dynamic_hf] [--size small|base]

Random weights (`torch.manual_seed(0)`), eval mode, eager attention. Each model is exported with dynamic
axes (batch and sequence; ViT: batch) and written as `<name>.onnx`; a `.npz` beside it holds the inputs
of the first test shape and torch's output (`out:last_hidden_state`). `--size base` makes the
BERT-base / GPT-2-small sized exports the benchmark uses (12 layers, hidden 768: not checked in).

- bert_ts: BertModel, TorchScript exporter, opset 17, inputs input_ids and attention_mask
- gpt2_ts: GPT2Model, TorchScript exporter, opset 17, input_ids and attention_mask
- gpt2_dynamo: GPT2Model, dynamo exporter, opset 18, `dynamic_shapes` with torch.export.Dim
- llama_ts: LlamaModel with GQA (4 heads, 2 kv heads), TorchScript exporter, opset 17
- vit_ts: ViTModel (image 32, patch 8), TorchScript exporter, opset 17, dynamic batch
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

import numpy as np

SMALL = dict(hidden=64, layers=2, heads=2, inter=128, vocab=200, positions=256)
BASE = dict(hidden=768, layers=12, heads=12, inter=3072, vocab=30522, positions=512)


class _Wrapped:
    """A module calling a transformers model with keyword inputs, returning last_hidden_state."""

    @staticmethod
    def make(torch, inner, names):
        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                return self.inner(**dict(zip(names, args))).last_hidden_state

        return Wrapped().eval()


def _text_inputs(torch, batch=2, seq=8, vocab=200):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones((batch, seq), dtype=torch.int64)
    return ids, mask


# The issue-23 goal sizes for the GPU benchmark (bench/dynamic_gpu.py): BERT-base, GPT-2 small, a
# Llama-style decoder (hidden 1024, 8 layers, GQA 16/4 heads) and ViT-B/16 at 224x224.
GOAL = {
    "bert": BASE,
    "gpt2": BASE,
    "llama": dict(hidden=1024, layers=8, heads=16, kv_heads=4, inter=2816, vocab=32000, positions=512),
    "vit": dict(hidden=768, layers=12, heads=12, inter=3072, image=224, patch=16),
}


def make_model(torch, arch: str, size: dict):
    """A transformers model of `arch` (bert, gpt2, llama, vit) at `size`, random weights (seed 0), eval
    mode, eager attention. Llama's kv_heads defaults to half its heads (GQA); ViT's image/patch to 32/8."""
    import transformers as tf

    h, n, heads = size["hidden"], size["layers"], size["heads"]
    common = dict(attn_implementation="eager")
    torch.manual_seed(0)
    if arch == "bert":
        model = tf.BertModel(tf.BertConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                           intermediate_size=size["inter"], vocab_size=size["vocab"],
                                           max_position_embeddings=size["positions"], **common))
    elif arch == "gpt2":
        model = tf.GPT2Model(tf.GPT2Config(n_embd=h, n_layer=n, n_head=heads, vocab_size=size["vocab"],
                                           n_positions=size["positions"], **common))
    elif arch == "llama":
        model = tf.LlamaModel(tf.LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                             num_key_value_heads=size.get("kv_heads", max(1, heads // 2)),
                                             intermediate_size=size["inter"], vocab_size=size["vocab"],
                                             max_position_embeddings=size["positions"], **common))
    elif arch == "vit":
        model = tf.ViTModel(tf.ViTConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                                         intermediate_size=size["inter"], image_size=size.get("image", 32),
                                         patch_size=size.get("patch", 8), **common), add_pooling_layer=False)
    else:
        raise ValueError(f"unknown architecture {arch!r}; expected one of bert, gpt2, llama, vit")
    return model.eval()


def _models(torch, size: dict):
    for arch in ("bert", "gpt2", "llama", "vit"):
        # The checked-in Llama has 4 heads, 2 of them kv heads, whatever the size's heads.
        yield arch, make_model(torch, arch, {**size, "heads": 4, "kv_heads": 2} if arch == "llama" else size)


def _causal_mask(saved, *args, **kwargs):
    """transformers' sdpa_mask for a causal decoder, with broadcasting instead of torch.vmap (which the
    TorchScript tracer cannot export, `RuntimeError: unordered_map::at`, and whose older-torch variant
    bakes the traced sequence length into a Reshape). Any other mask (BERT's bidirectional one) goes to
    transformers' own function. The arguments are read by name from `saved`'s signature, which changed
    across transformers releases (cache_position, or q_length and q_offset)."""
    import inspect

    import torch
    from transformers import masking_utils as m

    bound = inspect.signature(saved).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("mask_function") is not m.causal_mask_function:
        return saved(*args, **kwargs)
    kv_length, kv_offset = a["kv_length"], a.get("kv_offset", 0)
    if a.get("cache_position") is not None:
        q = a["cache_position"]
    else:
        q = torch.arange(a["q_length"]) + a.get("q_offset", 0)
    kv = torch.arange(kv_length, device=q.device) + kv_offset
    mask = kv[None, :] <= q[:, None]
    mask = mask[None, None, :, :].expand(a["batch_size"], -1, -1, -1)
    padding = m.prepare_padding_mask(a.get("attention_mask"), kv_length, kv_offset)
    if padding is not None:
        mask = mask & padding[:, None, None, :].bool()
    return mask


@contextlib.contextmanager
def _traceable_masks():
    from transformers import masking_utils as m

    saved = m.sdpa_mask
    m.sdpa_mask = functools.partial(_causal_mask, saved)  # eager_mask calls it through the module
    try:
        yield
    finally:
        m.sdpa_mask = saved


def _export_ts(torch, model, arch: str, path: Path, vocab: int, image: int = 32):
    if arch == "vit":
        names, args = ["pixel_values"], (torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(0)),)
        axes = {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}}
    else:
        names, args = ["input_ids", "attention_mask"], _text_inputs(torch, vocab=vocab)
        axes = {k: {0: "batch", 1: "seq"} for k in (*names, "last_hidden_state")}
    wrapped = _Wrapped.make(torch, model, names)
    with _traceable_masks():
        torch.onnx.export(wrapped, args, str(path), input_names=names, output_names=["last_hidden_state"],
                          opset_version=17, dynamo=False, dynamic_axes=axes, do_constant_folding=True)
    return wrapped, names, args


def _export_dynamo(torch, model, path: Path, vocab: int):
    names = ["input_ids"]
    ids, _ = _text_inputs(torch, vocab=vocab)
    wrapped = _Wrapped.make(torch, model, names)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=256)
    prog = torch.onnx.export(wrapped, (ids,), input_names=names, output_names=["last_hidden_state"],
                             opset_version=18, dynamo=True, dynamic_shapes=(({0: batch, 1: seq},),))
    prog.save(str(path), external_data=False)
    return wrapped, names, (ids,)


def _save_case(torch, wrapped, names, args, path: Path) -> None:
    with torch.no_grad():
        out = wrapped(*args).numpy()
    arrays = {name: a.numpy() for name, a in zip(names, args)}
    np.savez(path.with_suffix(".npz"), **arrays, **{"out:last_hidden_state": out})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "dynamic_hf"))
    p.add_argument("--size", choices=("small", "base"), default="small")
    p.add_argument("--only", default="", help="comma-separated names (bert_ts, gpt2_dynamo, ...)")
    args = p.parse_args(argv)
    import torch

    size = SMALL if args.size == "small" else BASE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    for arch, model in _models(torch, size):
        model.eval()
        jobs = [("ts", lambda p, m=model, a=arch: _export_ts(torch, m, a, p, size["vocab"]))]
        if arch == "gpt2":
            jobs.append(("dynamo", lambda p, m=model: _export_dynamo(torch, m, p, size["vocab"])))
        for kind, job in jobs:
            name = f"{arch}_{kind}"
            if only and name not in only:
                continue
            path = out / f"{name}.onnx"
            wrapped, names, inputs = job(path)
            _save_case(torch, wrapped, names, inputs, path)
            print(f"{path}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
