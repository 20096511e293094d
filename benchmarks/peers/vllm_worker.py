"""vLLM side of `benchmarks/peers/compare.py`: runs in vLLM's own virtual environment (see the
Makefile's `bench-peers`), reads one JSON request per stdin line, answers one JSON line.

    request:  {"prompts": [[ids...], ...], "max_new_tokens": N}
    answer:   {"ms": wall time of llm.generate, "tokens": [[ids...], ...]}

Greedy (temperature 0) with ignore_eos and min_tokens = max_tokens = N, prompts as token ids, fp32
(vLLM would silently run an fp32 checkpoint in bf16 with dtype="auto"). Timing is taken here, around
`generate` alone, so the pipe's cost is not charged to vLLM."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this pinned process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="folder with config.json + safetensors")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model, dtype="float32", skip_tokenizer_init=True,
        max_model_len=args.max_model_len, seed=0, enable_prefix_caching=False,
    )  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        n = request["max_new_tokens"]
        params = SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=n, max_tokens=n, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        print(json.dumps({"ms": elapsed_ms, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
