"""vLLM side of `benchmarks/peers/compare.py`: runs in vLLM's own virtual environment (see the
Makefile's `bench-peers`), reads one JSON request per stdin line, answers one JSON line.

    request:  {"prompts": [[ids...], ...], "max_new_tokens": N,
               optional "n": samples per prompt (1), "temperature": (0.0, greedy), "seed": (none),
               "logprobs": true for each sampled token's logprob (vLLM's raw-logits log-softmax)}
    answer:   {"ms": wall time of llm.generate, "tokens": [[ids...], ...] (each prompt's first output),
               "samples": [[[ids...] x n], ...] (every output of each prompt, in vLLM's output order),
               "cached_tokens": [prompt tokens served by vLLM's prefix cache, per prompt],
               with "logprobs": [[float...], ...] (each prompt's first output) when asked}

Greedy (temperature 0) unless the request says otherwise, with ignore_eos and min_tokens = max_tokens =
N, prompts as token ids, `--dtype` (float32 by default: vLLM would silently run an fp32 checkpoint in bf16
with dtype="auto").
Timing is taken here, around `generate` alone, so the pipe's cost is not charged to vLLM. Prefix caching
is off unless `--prefix-caching` is given (`benchmarks/multi_turn.py`, where it is the peer feature
compared). `benchmarks/shared_decode.py` sends n = 8 samples at temperature 1 with a seed per round."""

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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
        max_model_len=args.max_model_len, seed=0, enable_prefix_caching=args.prefix_caching,
    )  # fmt: skip
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        new_tokens = request["max_new_tokens"]
        params = SamplingParams(
            n=request.get("n", 1), temperature=request.get("temperature", 0.0), seed=request.get("seed"),
            ignore_eos=True, min_tokens=new_tokens, max_tokens=new_tokens, detokenize=False,
            logprobs=0 if request.get("logprobs") else None,  # 0: the sampled token's own logprob only
        )  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        samples = [[list(sample.token_ids) for sample in output.outputs] for output in outputs]
        tokens = [per_prompt[0] for per_prompt in samples]
        cached = [output.num_cached_tokens or 0 for output in outputs]
        answer = {"ms": elapsed_ms, "tokens": tokens, "samples": samples, "cached_tokens": cached}
        if request.get("logprobs"):
            answer["logprobs"] = [
                [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids, strict=True)]
                for output in outputs
            ]
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
