"""vLLM side of `benchmarks/peers/compare.py`: runs in vLLM's own virtual environment (see the
Makefile's `bench-peers`), reads one JSON request per stdin line, answers one JSON line.

    request:  {"prompts": [[ids...], ...], "max_new_tokens": N}
    answer:   {"ms": wall time of llm.generate, "tokens": [[ids...], ...],
               "cached_tokens": [prompt tokens served by vLLM's prefix cache, per prompt]}

Greedy (temperature 0) with ignore_eos and min_tokens = max_tokens = N, prompts as token ids, fp32
(vLLM would silently run an fp32 checkpoint in bf16 with dtype="auto"). Timing is taken here, around
`generate` alone, so the pipe's cost is not charged to vLLM. Prefix caching is off unless
`--prefix-caching` is given (`benchmarks/multi_turn.py`, where it is the peer feature compared)."""

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
    parser.add_argument("--prefix-caching", action="store_true", help="enable_prefix_caching=True (default off)")
    args = parser.parse_args()
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model, dtype="float32", skip_tokenizer_init=True,
        max_model_len=args.max_model_len, seed=0, enable_prefix_caching=args.prefix_caching,
    )  # fmt: skip
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        n = request["max_new_tokens"]
        params = SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=n, max_tokens=n, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        cached = [output.num_cached_tokens or 0 for output in outputs]
        print(json.dumps({"ms": elapsed_ms, "tokens": tokens, "cached_tokens": cached}), flush=True)


if __name__ == "__main__":
    main()
