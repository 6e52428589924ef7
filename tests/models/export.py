"""Build small random-weight models and export them to ONNX with both torch.onnx exporters.

Run where torch, transformers and torchvision are installed (the GPU machine):

    python3 tests/models/export.py --out tests/models

For each architecture (bert, gpt2, vit, llama, mobilenetv3) and exporter (torchscript: dynamo=False,
opset 17; dynamo: dynamo=True, opset 18) it writes <arch>_<exporter>.onnx (weights inline, IR version
<= 10 so older onnxruntime builds read it) and <arch>_<exporter>.npz (the inputs under their ONNX input
names, torch's outputs under "out:<onnx output name>"). An export that fails is recorded in
export_summary.json with the exporter's error; the script never stops at the first failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

MAX_IR_VERSION = 10
SEED = 0
SEQ = 16
VOCAB = 200
EXPORTERS = {"torchscript": (False, 17), "dynamo": (True, 18)}


def _wrap(torch, model, n_inputs: int):
    """A module whose forward(*inputs) returns the model's first output as a plain tensor."""

    # Fixed-arity forward: torch.export handles named positional arguments better than *args.
    class One(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return _first(self.inner(x))

    class Two(One):
        def forward(self, x, y):
            return _first(self.inner(input_ids=x, attention_mask=y))

    def _first(out):
        return out if isinstance(out, torch.Tensor) else out[0]

    return (One if n_inputs == 1 else Two)(model).eval()


def _from_config(cls, config):
    """The model with eager attention (a plain MatMul/Softmax graph both exporters handle)."""
    try:
        return cls._from_config(config, attn_implementation="eager")
    except (TypeError, ValueError, AttributeError):
        config._attn_implementation = "eager"
        return cls(config)


def _token_ids(rng) -> np.ndarray:
    return rng.integers(0, VOCAB, size=(1, SEQ), dtype=np.int64)


def build_bert(torch, rng):
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, type_vocab_size=2)
    model = _from_config(BertModel, config)
    mask = np.ones((1, SEQ), np.int64)
    mask[0, -3:] = 0  # padded tail: exercises the mask path
    inputs = {"input_ids": _token_ids(rng), "attention_mask": mask}
    return _wrap(torch, model, 2), inputs, ["last_hidden_state"]


def _causal_lm(torch, model, rng, with_mask: bool):
    """Wrapped decoder with input_ids, plus an all-ones attention_mask when asked."""
    inputs = {"input_ids": _token_ids(rng)}
    if with_mask:
        inputs["attention_mask"] = np.ones((1, SEQ), np.int64)
    return _wrap(torch, model, len(inputs)), inputs, ["last_hidden_state"]


def build_gpt2(torch, rng, with_mask=False):
    from transformers import GPT2Config, GPT2Model
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64, use_cache=False)
    return _causal_lm(torch, _from_config(GPT2Model, config), rng, with_mask)


def build_vit(torch, rng):
    from transformers import ViTConfig, ViTModel
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=128)
    model = _from_config(ViTModel, config)
    pixels = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    return _wrap(torch, model, 1), {"pixel_values": pixels}, ["last_hidden_state"]


def build_llama(torch, rng, with_mask=False):
    from transformers import LlamaConfig, LlamaModel
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         use_cache=False)
    return _causal_lm(torch, _from_config(LlamaModel, config), rng, with_mask)


def build_mobilenetv3(torch, rng):
    import torchvision
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10, width_mult=0.25)
    pixels = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    return _wrap(torch, model, 1), {"pixel_values": pixels}, ["logits"]


def build_resnet18(torch, rng):
    """torchvision's ResNet-18 (1000 classes) on a 64x64 image, with batch-norm statistics and
    affine parameters drawn away from their identity defaults (so folding them is tested)."""
    import torchvision
    model = torchvision.models.resnet18(weights=None)
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    pixels = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    return _wrap(torch, model, 1), {"pixel_values": pixels}, ["logits"]


BUILDERS = {"bert": build_bert, "gpt2": build_gpt2, "vit": build_vit, "llama": build_llama,
            "mobilenetv3": build_mobilenetv3}
# Architectures too large to check in (ResNet-18: 11.7 M weights, 47 MB): tests/models exports them on
# first use where torch and torchvision are installed (tests.models.ensure_generated).
GENERATED = {"resnet18": build_resnet18}


def register_diff_symbolic(torch) -> str:
    """Teach the TorchScript exporter aten::diff (n=1, optional prepend), which transformers 5's mask code
    calls (packed-sequence detection) and which opset 17 lacks: Slice(x, 1:) - Slice(x, :-1)."""
    try:
        try:
            from torch.onnx import symbolic_helper as sh
        except ImportError:
            from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh

        @sh.parse_args("v", "i", "i", "v", "v")
        def diff(g, x, n, dim, prepend, append):
            if n != 1 or not sh._is_none(append):
                return sh._unimplemented("aten::diff", "only n=1 without append")
            if not sh._is_none(prepend):
                x = g.op("Concat", prepend, x, axis_i=dim)

            def ints(*v):
                return g.op("Constant", value_t=torch.tensor(list(v), dtype=torch.int64))
            hi = g.op("Slice", x, ints(1), ints(2**62), ints(dim))
            lo = g.op("Slice", x, ints(0), ints(-1), ints(dim))
            return g.op("Sub", hi, lo)

        torch.onnx.register_custom_op_symbolic("aten::diff", diff, 17)
        return "registered"
    except Exception as exc:  # noqa: BLE001 - the export then falls back to an explicit attention_mask
        return f"not registered: {type(exc).__name__}: {exc}"


def _randomize_norms(torch, model) -> None:
    """Give norm layers non-trivial scales/biases (default init is 1/0, which hides bugs in them)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name.lower() or "ln" in name.lower()):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _finish_model(onnx, path: Path) -> dict:
    """Load the export, fold any external data in, cap the IR version, save it inline; return facts."""
    model = onnx.load(str(path), load_external_data=True)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    for stale in path.parent.glob(path.name + "*.data"):
        stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=False)
    onnx.checker.check_model(str(path))
    ops = sorted({f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node})
    return {"ir_version": model.ir_version,
            "opsets": {imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
            "nodes": len(model.graph.node), "ops": ops, "bytes": path.stat().st_size,
            "inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output]}


def export_one(torch, onnx, arch: str, exporter: str, out_dir: Path, with_mask: bool = False) -> dict:
    dynamo, opset = EXPORTERS[exporter]
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    build = {**BUILDERS, **GENERATED}[arch]
    model, inputs, output_names = build(torch, rng, with_mask=True) if with_mask else build(torch, rng)
    _randomize_norms(torch, model)
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with torch.no_grad():
        expected = model(*args)
    path = out_dir / f"{arch}_{exporter}.onnx"
    kwargs = dict(input_names=list(inputs), output_names=output_names, opset_version=opset, dynamo=dynamo)
    if dynamo:
        kwargs["external_data"] = False
    else:
        kwargs["do_constant_folding"] = True
    torch.onnx.export(model, args, str(path), **kwargs)
    facts = _finish_model(onnx, path)
    outs = expected if isinstance(expected, tuple) else (expected,)
    if len(outs) != len(facts["outputs"]):
        raise RuntimeError(f"torch gave {len(outs)} outputs, the ONNX graph has {facts['outputs']}")
    # Feeds under the ONNX graph's input names (same order as passed to the exporter).
    feeds = dict(zip(facts["inputs"], inputs.values()))
    arrays = dict(feeds)
    for name, value in zip(facts["outputs"], outs):
        arrays[f"out:{name}"] = value.detach().cpu().numpy()
    np.savez(out_dir / f"{arch}_{exporter}.npz", **arrays)
    facts["ort_max_abs_diff"] = _check_with_ort(path, feeds, arrays, facts["outputs"])
    return facts


def _check_with_ort(path: Path, feeds: dict, arrays: dict, outputs: list[str]):
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    return {name: float(np.max(np.abs(g - arrays[f"out:{name}"]))) for name, g in zip(outputs, got)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--arch", action="append", choices=sorted(BUILDERS))
    parser.add_argument("--exporter", action="append", choices=sorted(EXPORTERS))
    ns = parser.parse_args(argv)
    import onnx
    import torch
    torch.set_num_threads(4)
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"versions": _versions(torch, onnx), "exports": {},
               "diff_symbolic": register_diff_symbolic(torch)}
    for arch in ns.arch or list(BUILDERS):
        for exporter in ns.exporter or list(EXPORTERS):
            name = f"{arch}_{exporter}"
            t0 = time.perf_counter()
            try:
                try:
                    facts = export_one(torch, onnx, arch, exporter, out_dir)
                except Exception as first:  # noqa: BLE001
                    if arch not in ("gpt2", "llama"):
                        raise
                    # transformers' packed-sequence check runs only without a mask: give one.
                    print(f"{name}: retrying with an attention_mask input after {type(first).__name__}: "
                          f"{str(first)[:200]}", flush=True)
                    facts = export_one(torch, onnx, arch, exporter, out_dir, with_mask=True)
                    facts["note"] = f"exported with an all-ones attention_mask input; without it: {first}"[:600]
                facts["seconds"] = round(time.perf_counter() - t0, 1)
                summary["exports"][name] = facts
                print(f"{name}: ok, {facts['nodes']} nodes, {facts['bytes']} bytes, ort diff "
                      f"{facts['ort_max_abs_diff']}", flush=True)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, the rest still run
                for stale in out_dir.glob(name + ".*"):
                    stale.unlink()
                summary["exports"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                            "traceback": traceback.format_exc()[-4000:]}
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    summary_path = out_dir / "export_summary.json"
    if summary_path.exists():  # a partial re-run (--arch/--exporter) keeps the other entries
        old = json.loads(summary_path.read_text())
        summary["exports"] = {**old.get("exports", {}), **summary["exports"]}
    summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
    return 0


def _versions(torch, onnx) -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__}
    for mod in ("transformers", "torchvision", "onnxscript", "onnxruntime", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return versions


if __name__ == "__main__":
    sys.exit(main())
