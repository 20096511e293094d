"""One side of `revisions.py`: a long-lived process that imports autobucket from one tree's `src` (its
PYTHONPATH), loads the saved model once, and runs the calls it is sent, timing each inside itself.

    PYTHONPATH=TREE/src python benchmarks/revision_worker.py --model-dir DIR --core 0

Protocol: JSON lines. It answers {"ready": ..., "autobucket": its autobucket's path, versions} once the
model is loaded, then one line per request. A request is {"config": RolloutConfig fields, "sampling":
SamplingConfig fields, "turns": [prompts of call 1, prompts of call 2, ...]}: the calls run in order on
one Rollout per config (kept across requests, so every request after the first is warm), its prefix
cache emptied first (nothing of an earlier request is served). The answer is {"ms": the calls' summed
wall time, "turn_ms", "tokens": per call its tokens, "warnings"} or {"error": "Type: message"} when
the revision refuses the config or the call (the worker stays usable).

Only the API both an old and a new revision have is used here (Rollout, RolloutConfig, SamplingConfig,
result.tokens, rollout.prefix_cache), so one worker script drives either side.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    sys.path.pop(0)  # this folder's scripts (routes.py, planner.py, ...) must not shadow any import

import argparse
import json
import os
import time
import warnings


def pin(core: int, threads: int) -> None:
    """Run on `core` only, with `threads` torch threads (before torch starts its thread pool)."""
    os.sched_setaffinity(0, {core})
    os.environ["OMP_NUM_THREADS"] = str(threads)


def protocol_stream():
    """The stdout this process was started with, for answers only; anything else that prints (a library's
    progress line, a C++ build log) goes to stderr instead, so no answer line is ever interleaved."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


class Worker:
    def __init__(self, model_dir: str, threads: int) -> None:
        import torch
        import transformers

        import autobucket

        torch.set_num_threads(threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        self.rollouts: dict[str, object] = {}
        self.facts = {"ready": True, "autobucket": autobucket.__file__, "torch": torch.__version__,
                      "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                      "cores": sorted(os.sched_getaffinity(0))}  # fmt: skip

    def rollout(self, config: dict, caught: list[str]):
        """The Rollout for `config`, made on its first request (the revision's warnings recorded)."""
        from autobucket import Rollout, RolloutConfig

        key = json.dumps(config, sort_keys=True)
        if key not in self.rollouts:
            with warnings.catch_warnings(record=True) as raised:
                warnings.simplefilter("always")
                self.rollouts[key] = Rollout(self.model, config=RolloutConfig(**config))
            caught += [f"{w.category.__name__}: {w.message}" for w in raised]
        return self.rollouts[key]

    def call(self, request: dict) -> dict:
        from autobucket import SamplingConfig

        caught: list[str] = []
        try:
            rollout = self.rollout(request["config"], caught)
            sampling = SamplingConfig(**request["sampling"])
            if rollout.prefix_cache is not None:
                rollout.prefix_cache.invalidate()
            turn_ms, tokens = [], []
            for prompts in request["turns"]:
                started = time.perf_counter()
                result = rollout.generate(prompts, sampling)
                turn_ms.append((time.perf_counter() - started) * 1e3)
                tokens.append(result.tokens)
        except Exception as error:  # reported on this config's row; the other configs go on
            return {"error": f"{type(error).__name__}: {error}", "warnings": caught}
        return {"ms": sum(turn_ms), "turn_ms": turn_ms, "tokens": tokens, "warnings": caught}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    pin(args.core, args.threads)
    answers = protocol_stream()
    worker = Worker(args.model_dir, args.threads)
    answers.write(json.dumps(worker.facts) + "\n")
    for line in sys.stdin:
        answers.write(json.dumps(worker.call(json.loads(line))) + "\n")


if __name__ == "__main__":
    main()
