"""Half-precision compiled plans with Attention on the fused flash step vs the two-GEMM chain.

    python -m bench.flash_half_gpu [--seqs 128 512] [--iters 50]

Per precision (float16, bfloat16), block and sequence length: a plan built from the block (tests/
plugin_cuda/flash_half_models.py: BERT-base-like, batch 8, 12 heads of 64, padding mask; Llama-like,
batch 4, 16 query heads and 4 KV heads of 64, causal) with attention_kernel=flash and =gemm, timed as
the median of CUDA-event batches of plan.run on one stream: eager (every step launched from Python, so
short plans measure the host's launch rate) and replay (auto_graph: the plan captures itself after two
runs and replays a CUDA graph, the GPU's time); and the largest |flash - gemm| relative to the largest
output.
"""

from __future__ import annotations

import argparse

import numpy as np


def time_plan(cp, plan, ins, outs, iters: int) -> float:
    """Median ms per plan.run over 5 batches of `iters` runs."""
    stream = cp.cuda.Stream(non_blocking=True)
    ptr_in, ptr_out = [a.data.ptr for a in ins], [o.data.ptr for o in outs]
    plan.run(stream.ptr, ptr_in, ptr_out)
    samples = []
    for _ in range(5):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(iters):
            plan.run(stream.ptr, ptr_in, ptr_out)
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end) / iters)
    return float(np.median(samples))


def bench(cp, block: str, precision: str, seq: int, iters: int) -> str:
    from plugin_cuda.kernels import flash_attention as flash
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan
    from tests.plugin_cuda.flash_half_models import bert_block, block_feeds, llama_block
    from tests.plugin_cuda.half_models import HALVES, retyped

    model = bert_block(8, seq, heads=12) if block == "bert" else llama_block(4, seq, q_heads=16, kv_heads=4)
    half = retyped(model, HALVES[precision])
    ms, outs = {}, {}
    for choice in ("flash", "gemm"):
        for mode, kw in (("eager", {"capture": False}), ("replay", {"capture": True, "auto_graph": True})):
            with flash.kernel_choice(choice), Plan.build(spec_from_onnx(half), use_tf32=False, **kw) as plan:
                dtype = plan.prog.values[plan.prog.outputs[0]].dtype
                feeds = block_feeds(model)
                ins = [cp.asarray(feeds[n].astype(dtype)) for n in plan.input_names]
                out = cp.zeros(plan.prog.values[plan.prog.outputs[0]].shape, dtype)
                ms[choice, mode] = time_plan(cp, plan, ins, [out], iters)
                outs[choice] = cp.asnumpy(out).astype(np.float32)
    diff = np.abs(outs["flash"] - outs["gemm"]).max() / np.abs(outs["gemm"]).max()
    times = "  ".join(f"{mode} flash {ms['flash', mode]:6.3f} gemm {ms['gemm', mode]:6.3f} ms "
                      f"({ms['gemm', mode] / ms['flash', mode]:4.2f}x)" for mode in ("eager", "replay"))
    return f"{block:6s} {precision} S={seq:5d}  {times}  |flash-gemm|/max {diff:.1e}"


def main() -> None:
    import cupy as cp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)['name'].decode()}")
    for precision in ("fp16", "bf16"):
        for block in ("bert", "llama"):
            for seq in args.seqs:
                print(bench(cp, block, precision, seq, args.iters), flush=True)


if __name__ == "__main__":
    main()
