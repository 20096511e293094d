"""Packed and chunked prefill on the reference workloads, and the memory of a chunked long prompt.

    taskset -c 0 python benchmarks/prefill_forms.py --repeats 5 --out results/prefill_forms.json

Model: the 20.3M-param `bench-qwen2` (fp32, CPU, one thread), its context raised to 16,384 positions
for the long prompt. Coefficients: the calibrated ones of docs/benchmarks.md (`--costs` to override).
Contenders, interleaved, one warm-up, medians:

- `hf_generate`: the ordinary route (HF `generate` on the left-padded batch);
- `auto_padded`: Auto with `packing=False`: padded buckets only, the planner as it was before packing;
- `auto`: Auto with packed groups and chunks;
- `ideal`: the padding-free ideal: every admission prefilled in the fewest packed forwards of exactly its
  real tokens (no padding, per-prompt attention, rows filled up to `FormCosts.packed_max_tokens`, the
  fastest row size measured), then the same decode loop. It is the bucketed route with prohibitive token
  and per-forward costs, so the planner runs no padding token and then the fewest forwards.

Ratios are also reported paired: the median over rounds of the two contenders' times in one round.

Memory section: one prompt of 8,192 tokens, 8 new tokens, prefill_max_tokens=1024 (chunked) vs None
(one forward); peak RSS of each call (`Profile.peak_memory_bytes`, the mark reset by the benchmark before each call) and the tokens of
both against single-request HF `generate`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.models import TINY_CONFIGS, build_tiny_model
from autobucket.profile import reset_peak_memory
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import reference_workloads, time_interleaved, tokens_agree

# docs/benchmarks.md, "autobucket calibrate --model bench-qwen2 --threads 1" (16 new tokens)
CALIBRATED = CostCoefficients(
    fixed_ms=5.741, token_ms=0.1037, attention_ms=12.70, kv_ms=0.1182,
    decode_ms=0.0, ordinary_decode_ms=0.3191, ordinary_decode_kv_ms=0.0357,
)  # fmt: skip


def contender(model, sampling: SamplingConfig, **config):
    rollout = Rollout(model, config=RolloutConfig(**config))

    def run(prompts):
        result = rollout.generate(prompts, sampling)
        return result.tokens, result.profile.to_dict()

    return run


def paired_ratio(runs, name: str, reference: str) -> float:
    """Median over rounds of name's time / reference's time in the same round: on a shared machine a
    slow phase hits both contenders of a round, so this is steadier than a ratio of medians."""
    pairs = zip(runs[name].samples_ms, runs[reference].samples_ms, strict=True)
    return statistics.median(a / b for a, b in pairs)


def route_table(model, costs: CostCoefficients, args) -> list[dict]:
    sampling = SamplingConfig(max_new_tokens=16, continuous_batch_size=32)
    contenders = {
        "hf_generate": contender(model, sampling, route="ordinary"),
        "auto_padded": contender(model, sampling, route="auto", costs=costs, packing=False),
        "auto": contender(model, sampling, route="auto", costs=costs),
        # padding dominates every other cost, then forwards: no padded token, then the fewest packed rows
        "ideal": contender(model, sampling, route="bucketed", costs=CostCoefficients(fixed_ms=1e4, token_ms=1e3)),
    }
    rows = []
    for workload in reference_workloads():
        if args.workloads and not any(name in workload.name for name in args.workloads):
            continue
        prompts = random_prompts(workload.lengths, model.config.vocab_size, seed=args.seed)
        runs = time_interleaved(contenders, prompts, args.repeats)
        agree = tokens_agree(runs, "hf_generate")
        medians = {name: run.median_ms for name, run in runs.items()}
        for name, run in runs.items():
            profile = run.profile or {}
            rows.append({
                "workload": workload.name, "contender": name, "median_ms": run.median_ms,
                "samples_ms": run.samples_ms, "tokens_match_hf": agree[name],
                "ratio_to_hf": run.median_ms / medians["hf_generate"],
                "ratio_to_auto_padded": run.median_ms / medians["auto_padded"],
                "ratio_to_ideal": run.median_ms / medians["ideal"],
                **{f"paired_ratio_to_{ref}": paired_ratio(runs, name, ref) for ref in ("hf_generate", "auto_padded", "ideal")},
                "prefill_ms": profile.get("prefill_ms"), "decode_ms": profile.get("decode_ms"),
                "prefill_forwards": profile.get("prefill_forwards"), "prefill_forms": profile.get("prefill_forms"),
                "prefill_tokens": profile.get("prefill_tokens"), "plan_ms": profile.get("plan_ms"),
            })
            print(f"{workload.name:28s} {name:12s} {run.median_ms:8.1f} ms  paired: /hf {rows[-1]['paired_ratio_to_hf_generate']:.3f}"
                  f"  /auto_padded {rows[-1]['paired_ratio_to_auto_padded']:.3f}  /ideal {rows[-1]['paired_ratio_to_ideal']:.3f}"
                  f"  match={agree[name]}  prefill={profile.get('prefill_ms', 0):.0f} ms"
                  f" forms={profile.get('prefill_forms')}", flush=True)
    return rows


def memory_table(model, args) -> list[dict]:
    prompt = random_prompts([args.long_prompt], model.config.vocab_size, seed=args.seed)
    sampling = SamplingConfig(max_new_tokens=8, continuous_batch_size=1)
    with torch.inference_mode():
        ids = torch.tensor(prompt)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    rows = []
    for repeat in range(args.repeats):
        for budget in (1024, None):
            rollout = Rollout(model, config=RolloutConfig(route="aligned", prefill_max_tokens=budget))
            reset_peak_memory(torch.device("cpu"))  # this process is the benchmark's: per-call peaks
            before = rss_bytes()
            result = rollout.generate(prompt, SamplingConfig(**{**sampling.__dict__, "eos_token_id": []}))
            profile = result.profile
            rows.append({"budget": budget, "repeat": repeat, "peak_memory_mib": profile.peak_memory_bytes / 2**20,
                         "rss_before_mib": before / 2**20, "peak_growth_mib": (profile.peak_memory_bytes - before) / 2**20,
                         "prefill_ms": profile.prefill_ms, "prefill_forwards": profile.prefill_forwards,
                         "tokens_match_hf": result.tokens[0] == want})
            print(f"long prompt {args.long_prompt}, budget {budget}: peak {rows[-1]['peak_memory_mib']:.0f} MiB "
                  f"(+{rows[-1]['peak_growth_mib']:.0f} MiB over the RSS before the call), "
                  f"prefill {profile.prefill_ms:.0f} ms in {profile.prefill_forwards} forwards, "
                  f"match={rows[-1]['tokens_match_hf']}", flush=True)
    return rows


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), the base the call's peak RSS grows from."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--costs", help="costs JSON for auto (default: the calibrated bench-qwen2 values)")
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--workloads", nargs="*", help="only workloads whose name contains one of these")
    parser.add_argument("--skip-routes", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", default="results/prefill_forms.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    TINY_CONFIGS["bench-qwen2"][1]["max_position_embeddings"] = 16384  # room for the long prompt
    model = build_tiny_model("bench-qwen2")
    costs = CostCoefficients.from_dict(json.loads(Path(args.costs).read_text())["costs"]) if args.costs else CALIBRATED
    report = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__}, "costs": costs.to_dict()}
    if not args.skip_memory:  # first: a fresh process's RSS high-water mark is least disturbed
        report["memory"] = memory_table(model, args)
    if not args.skip_routes:
        report["routes"] = route_table(model, costs, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
