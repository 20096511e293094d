"""What matching stop strings costs a GRPO-like call: the same call with and without two stop strings that
do not fire, alternating in one process.

    quiet-run -- python benchmarks/stop_strings.py --out results/stop_strings.json
    # smoke: --rounds 2 --prompts 2 --n 2 --new-tokens 4 --out /tmp/stops.json

The call is `shared_decode.py`'s (bench-qwen2, `--kernels`, `--prompts` prompts of ShareGPT-like lengths x
`--n` samples, `--new-tokens` tokens, temperature 1, EOS off), on one thread. The "stops" contender adds
`SamplingConfig(stop_strings=["</tool_call>", "\\n\\nUser:"])`, matched with SmolLM2's tokenizer (its 49,152
ids cover bench-qwen2's 32,000): each decode step then runs one batched `StopStringCriteria` match over
every row's last ids. The strings are chosen not to fire on this random-weight model, so both contenders
generate the same tokens (checked; a round where one fires is reported, since its call is shorter). ABBA
over `--rounds` rounds of fresh prompts after a warm-up; medians, the ratio and raw samples to JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.coefficients.file import host_cpu
from autobucket.models import build_tiny_model, load_model

STOP_STRINGS = ["</tool_call>", "\n\nUser:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("hf", "invariant"), default="invariant")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/stop_strings.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, tokenizer = load_model("smollm2")  # the tokenizer only; the embedded model is converted on first use
    model = build_tiny_model("bench-qwen2")
    rollout = Rollout(model, tokenizer, RolloutConfig(route="auto", kernels=args.kernels))
    vocab = model.config.vocab_size

    def sampling(name: str, seed: int):
        plain = call_sampling(args, seed)
        return dataclasses.replace(plain, stop_strings=STOP_STRINGS if name == "stops" else [])

    contenders = ("plain", "stops")
    for name in contenders:  # warm-up: packs made, the kernel library and the matcher built
        rollout.generate(round_prompts(vocab, args.prompts, args.seed), sampling(name, args.seed))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    equal, fired = True, 0
    for index in range(args.rounds):
        seed = args.seed + 1 + index
        prompts, tokens = round_prompts(vocab, args.prompts, seed), {}
        for name in contenders if index % 2 == 0 else reversed(contenders):  # ABBA
            started = time.perf_counter()
            result = rollout.generate(prompts, sampling(name, seed))
            samples[name].append((time.perf_counter() - started) * 1e3)
            tokens[name] = result.tokens
            fired += sum(reason == "stop" for reasons in result.finish_reasons for reason in reasons)
        equal = equal and tokens["plain"] == tokens["stops"]
        print(f"round {index}: plain {samples['plain'][-1]:.0f} ms, stops {samples['stops'][-1]:.0f} ms, "
              f"ratio {samples['stops'][-1] / samples['plain'][-1]:.3f}")  # fmt: skip
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratios = [a / b for a, b in zip(samples["stops"], samples["plain"], strict=True)]
    print(f"stop strings ({args.kernels} kernels): plain {medians['plain']:.0f} ms, stops {medians['stops']:.0f} ms, "
          f"ratio of medians {medians['stops'] / medians['plain']:.3f}, median of the rounds' ratios "
          f"{statistics.median(ratios):.3f}; tokens equal {equal}; rows ended by a stop string {fired}")  # fmt: skip
    record = {"cpu": host_cpu(), "torch": torch.__version__, "args": vars(args), "stop_strings": STOP_STRINGS,
              "medians_ms": medians, "round_ratios": ratios, "tokens_equal": equal, "rows_stopped": fired,
              "samples_ms": samples}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
