"""One continuous-batching decode step: eager, compiled (`compile=True`) and the invariant kernels.

    taskset -c 0 python benchmarks/kernels/decode_step.py --rows 32 --context 512 --out results/decode_step.json

The 20.3M-param Qwen2 (`bench-qwen2`), fp32, one thread. The static cache holds `rows` prompts of
`context` tokens; every timed step decodes at that context (the write front is reset), eager and
compiled steps interleaved. Also timed: the output head's GEMM alone (`F.linear`, rows x hidden x
vocab), which bounds the step on this model, and the eager step's top operators (torch.profiler).
`eager` runs transformers' SDPA; `default` is the default kernels' step (its attention on the engine's kernel);
`invariant` is the eager step on the engine's own kernels (`kernels="invariant"`: every linear on
prepacked weights, fp32 ones on the fixed-order kernel where it is vectorized, bf16 ones on oneDNN, the
linears that read one input fused into one GEMM, attention on the batch-invariant kernel),
`invariant_unfused` the same without fusing (what the trainer's scope runs), `invariant_onednn` with
fp32 GEMMs on oneDNN's packed kernel instead of the fixed-order one;
`invariant_model` and `default_model` are those steps through the model's own forward instead of the
engine's step (`engine/decode/step.py`: the model's parts without transformers' per-layer Python), bitwise alike;
`--dtype bfloat16` runs the model in bf16;
`default_fused` and `invariant_fused` are the default and invariant steps as a rollout runs them, with
the model's rotary, SiLU-and-multiply and RMSNorm on the fused elementwise kernels
(`engine/kernels/elementwise/`, bitwise the same values);
`repack_ms` is what one repack of all linears costs (after a weight update, once per call)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.compiled.compiled_decode import CompiledDecode
from autobucket.engine.intercept.elementwise import fused_elementwise
from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.invariant_attention import decode_sdpa
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts


def filled_runner(model, rows: int, context: int, compiled: CompiledDecode | None, decode_attention=None) -> ModelRunner:
    prompts = random_prompts([context] * rows, model.config.vocab_size, seed=0)
    runner = ModelRunner(model, forward_spec(model), CacheShape(rows, context + 16), 0, model.config.vocab_size,
                         track_seen=False, compiled=compiled, decode_attention=decode_attention)  # fmt: skip
    output, _ = runner.prefill(prompts)
    runner.insert(output, RowInsert(list(range(rows)), output.last_logits.argmax(-1), [context] * rows, None))
    return runner


def step_at_context(runner: ModelRunner) -> torch.Tensor:
    front = runner.store.front
    runner.prepare_decode()
    logits = runner.decode_logits()
    runner.store.front = front  # decode the same context again next time
    return logits


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return (time.perf_counter() - started) * 1e3


@torch.inference_mode()
def measure(args) -> dict:
    model = build_tiny_model("bench-qwen2").to(getattr(torch, args.dtype))
    eager = filled_runner(model, args.rows, args.context, None)
    default = filled_runner(model, args.rows, args.context, None, decode_sdpa)  # the default kernels' step
    compiled = filled_runner(model, args.rows, args.context, CompiledDecode(model, forward_spec(model).cache_keyword, True))
    compile_ms = timed(lambda: step_at_context(compiled))
    difference = (step_at_context(eager) - step_at_context(compiled)).abs().max().item()
    hidden = torch.randn(args.rows, model.config.hidden_size, dtype=model.dtype)
    head = model.lm_head.weight
    packs, unfused_packs = PackedLinears(fuse=True), PackedLinears()
    onednn_packs = PackedLinears(fuse=True, fixed_order=False)  # fp32 GEMMs on oneDNN, as before the fixed order

    def invariant_step(packs: PackedLinears = packs):
        with invariant_kernels(packs):
            return step_at_context(eager)

    def fused(step):  # the step as a rollout runs it: the model's elementwise code on the fused kernels
        def run():
            with fused_elementwise(model):
                return step()

        return run

    def through_model(step):  # the same step with the model's own forward instead of the direct step
        def run():
            runner = default if step is default_step else eager
            form, runner.decode_step = runner.decode_step, "model"
            try:
                return step()
            finally:
                runner.decode_step = form

        return run

    def default_step():
        return step_at_context(default)

    invariant_difference = (step_at_context(eager) - invariant_step()).abs().max().item()
    fusion_difference = (invariant_step(unfused_packs) - invariant_step()).abs().max().item()
    onednn_difference = (invariant_step(onednn_packs) - invariant_step()).abs().max().item()
    direct_difference = (through_model(invariant_step)() - invariant_step()).abs().max().item()
    elementwise_difference = max((fused(step)() - step()).abs().max().item() for step in (invariant_step, default_step))
    samples = {"eager": [], "default": [], "compiled": [], "invariant": [], "invariant_unfused": [],
               "invariant_onednn": [], "invariant_model": [], "default_model": [], "default_fused": [],
               "invariant_fused": [], "head_gemm": [], "repack": []}  # fmt: skip
    for _ in range(args.warmup):
        step_at_context(eager), step_at_context(default), step_at_context(compiled), invariant_step()
        invariant_step(unfused_packs), invariant_step(onednn_packs)
    for _ in range(args.repeats):
        samples["eager"].append(timed(lambda: step_at_context(eager)))
        samples["default"].append(timed(lambda: step_at_context(default)))
        samples["compiled"].append(timed(lambda: step_at_context(compiled)))
        samples["invariant"].append(timed(invariant_step))
        samples["invariant_unfused"].append(timed(lambda: invariant_step(unfused_packs)))
        samples["invariant_onednn"].append(timed(lambda: invariant_step(onednn_packs)))
        samples["invariant_model"].append(timed(through_model(invariant_step)))
        samples["default_model"].append(timed(through_model(default_step)))
        samples["default_fused"].append(timed(fused(default_step)))
        samples["invariant_fused"].append(timed(fused(invariant_step)))
        samples["head_gemm"].append(timed(lambda: F.linear(hidden, head)))
        packs.refresh()
        before = packs.pack_ms
        invariant_step()
        samples["repack"].append(packs.pack_ms - before)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"rows": args.rows, "context": args.context, "compile_ms": compile_ms, "max_logit_difference": difference,
            "invariant_max_logit_difference": invariant_difference, "fusion_max_logit_difference": fusion_difference,
            "onednn_max_logit_difference": onednn_difference, "direct_max_logit_difference": direct_difference,
            "elementwise_max_logit_difference": elementwise_difference,
            "direct_step": eager.parts is not None, "fixed_order": packs.fixed_order, "dtype": args.dtype,
            "fused_groups": len(packs.fusion.groups) if packs.fusion else 0,
            "compiled_steps": compiled.compiled.stats.compiled_steps, "medians_ms": medians, "samples_ms": samples,
            "top_ops": top_ops(eager), "invariant_top_ops": top_ops(eager, packs, model)}  # fmt: skip


def top_ops(runner: ModelRunner, packs: PackedLinears | None = None, model=None, steps: int = 5) -> list[tuple[str, float]]:
    """The top operators' self time per step; with `packs`, the invariant step as a rollout runs it."""
    from contextlib import ExitStack

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, ExitStack() as scopes:
        if packs is not None:
            scopes.enter_context(invariant_kernels(packs))
            scopes.enter_context(fused_elementwise(model))
        for _ in range(steps):
            step_at_context(runner)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="results/decode_step.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args)
    m = result["medians_ms"]
    flops = 2 * args.rows * 256 * 32000
    print(f"rows {args.rows} context {args.context}: eager {m['eager']:.2f} ms, compiled {m['compiled']:.2f} ms "
          f"(ratio {m['compiled'] / m['eager']:.3f}); head GEMM alone {m['head_gemm']:.2f} ms "
          f"({flops / m['head_gemm'] / 1e6:.1f} GFLOPS); compile {result['compile_ms'] / 1e3:.1f} s; "
          f"max |logit difference| {result['max_logit_difference']:.2e}")  # fmt: skip
    print(f"default kernels (decode attention on the engine's kernel) {m['default']:.2f} ms (ratio to eager "
          f"{m['default'] / m['eager']:.3f})")
    print(f"invariant kernels {m['invariant']:.2f} ms (ratio to eager {m['invariant'] / m['eager']:.3f}); "
          f"repacking every linear {m['repack']:.2f} ms; max |logit difference| vs eager "
          f"{result['invariant_max_logit_difference']:.2e}")  # fmt: skip
    print(f"invariant kernels unfused {m['invariant_unfused']:.2f} ms (fused / unfused "
          f"{m['invariant'] / m['invariant_unfused']:.3f}, {result['fused_groups']} fused groups, max |logit "
          f"difference| {result['fusion_max_logit_difference']:.1e})")
    if result["fixed_order"]:
        print(f"invariant kernels with fp32 GEMMs on oneDNN {m['invariant_onednn']:.2f} ms (fixed order / oneDNN "
              f"{m['invariant'] / m['invariant_onednn']:.3f}, max |logit difference| "
              f"{result['onednn_max_logit_difference']:.1e})")
    print(f"through the model's own forward instead of the direct step: invariant {m['invariant_model']:.2f} ms "
          f"(direct / model {m['invariant'] / m['invariant_model']:.3f}), default {m['default_model']:.2f} ms "
          f"(direct / model {m['default'] / m['default_model']:.3f}); max |logit difference| "
          f"{result['direct_max_logit_difference']:.1e}")  # fmt: skip
    print(f"as a rollout runs them (fused elementwise kernels): default {m['default_fused']:.2f} ms (ratio to eager "
          f"{m['default_fused'] / m['eager']:.3f}), invariant {m['invariant_fused']:.2f} ms (ratio to eager "
          f"{m['invariant_fused'] / m['eager']:.3f}, to default {m['invariant_fused'] / m['default_fused']:.3f}); "
          f"max |logit difference| fused / not {result['elementwise_max_logit_difference']:.1e}")  # fmt: skip
    for label, key in (("eager", "top_ops"), ("invariant (fused elementwise)", "invariant_top_ops")):
        for name, ms in result[key]:
            print(f"  {label} step, self time per step: {name:55s} {ms:7.2f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
