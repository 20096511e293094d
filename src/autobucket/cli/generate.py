"""`autobucket generate`: arguments -> `GenerateJob` -> `run_generate_job`; progress and summary on stderr.

torch and transformers are imported only by the handler, so registering this command keeps
`autobucket plan` torch-free."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from autobucket.config import KERNELS, ROUTES
from autobucket.planning.planner import DEFAULT_PREFILL_MAX_TOKENS

_COMPILE = {"off": False, "auto": "auto", "on": True}  # --compile -> RolloutConfig.compile


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from autobucket.cli.args import (
        OVERRIDE_PHRASE,
        add_model_arguments,
        costs_argument,
        finish_parser,
        generation_option_argument,
        non_negative_float,
        non_negative_int,
        positive_int,
        seed_argument,
        token_ids_argument,
    )

    parser = subparsers.add_parser(
        "generate",
        help="generate completions for a file of prompts (JSONL or one prompt per line)",
        description="Greedy or sampled generation for every prompt in a file; writes one JSON object per "
        "prompt and sample (id, sample with --n > 1, prompt, completion, tokens, finish_reason, logprobs with "
        "--logprobs) and prints a summary on stderr. A sampled prompt's tokens depend on --seed and the "
        "prompt's line only, not on the route, the batch or the other prompts.",
    )
    add_model_arguments(parser, default="smollm2")
    parser.add_argument(
        "--prompts",
        required=True,
        metavar="FILE",
        help='JSONL with one of "prompt", "prompt_ids" or "messages" per line (optional "id", and '
        '"max_new_tokens" for that prompt\'s own budget; other keys are refused), a text file with '
        'one prompt per line (lines end at "\\n" only), or - for stdin',
    )
    parser.add_argument(
        "--format",
        dest="input_format",
        choices=("auto", "jsonl", "txt"),
        default="auto",
        help="input format (default: by suffix, else JSONL if the first line is an object)",
    )
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help='new tokens per prompt (default 64); a JSONL line\'s "max_new_tokens" wins for it',
    )
    parser.add_argument(
        "--min-new-tokens",
        type=non_negative_int,
        default=None,
        metavar="K",
        help="EOS cannot end a completion before its K-th token (HF's min_new_tokens; default: "
        "the model's generation config, usually none; 0 turns the model's own minimum off)",
    )
    parser.add_argument(
        "--stop",
        dest="stop_strings",
        action="append",
        metavar="TEXT",
        help="end a completion once its text completes TEXT (kept, as HF generate's stop_strings; "
        "finish_reason stop); repeat for several; needs the model's tokenizer",
    )
    parser.add_argument(
        "--route",
        choices=ROUTES,
        default="auto",
        help="auto (default): the cost model picks per call; or a route by name",
    )
    parser.add_argument(
        "--costs",
        type=costs_argument,
        default="online",
        metavar="FILE|online",
        help="cost coefficients or calibration JSON for --route auto, or online (default): "
        "learned from the calls",
    )
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="use a --costs calibration measured on another model, dtype, device or attention "
        "backend (warns)",
    )
    parser.add_argument(
        "--kernels",
        choices=KERNELS,
        default="auto",
        help="auto (default): the engine's kernels wherever they can run the model, the model's "
        "own ops elsewhere (never refused); invariant: require the engine's batch-invariant "
        "kernels; torch: the model's own ops (hf: its deprecated spelling)",
    )
    parser.add_argument(
        "--continuous-batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="most prompts decoded at once (default 32)",
    )
    engine = parser.add_argument_group("engine (RolloutConfig)")
    engine.add_argument(
        "--prefix-cache-mb",
        type=non_negative_float,
        default=0.0,
        metavar="MB",
        help="keep prompts' and completions' K/V up to MB across the run's calls (a few "
        "continuous batches each), so a later prompt sharing a prefix (a system prompt, a "
        "few-shot header) prefills only the rest; 0 (default): off",
    )
    engine.add_argument(
        "--prefill-max-tokens",
        type=positive_int,
        default=DEFAULT_PREFILL_MAX_TOKENS,
        metavar="N",
        help="token positions per prefill forward; a longer prompt is prefilled in chunks "
        f"(default {DEFAULT_PREFILL_MAX_TOKENS})",
    )
    engine.add_argument(
        "--compile",
        choices=tuple(_COMPILE),
        default="off",
        help="the decode step under torch.compile: off (default), auto (where the predicted "
        "saving repays compiling), on",
    )
    engine.add_argument(
        "--packed-weights-mb",
        type=non_negative_float,
        default=None,
        metavar="MB",
        help="--kernels invariant: most MB of packed weight copies (default: no limit); a "
        "weight past it is read where it is",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="X",
        help="HF's repetition penalty on the prompt's and completion's tokens (1.0, default: off)",
    )
    sampling = parser.add_argument_group("sampling (greedy unless --temperature > 0)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0: off)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass to keep (1.0: off)")
    sampling.add_argument(
        "--n",
        type=positive_int,
        default=1,
        metavar="N",
        help="samples per prompt, one prefill shared by them (default 1)",
    )
    sampling.add_argument("--seed", type=seed_argument, default=0, metavar="S", help="the run's seed (default 0)")
    sampling.add_argument(
        "--logprobs",
        action="store_true",
        help="write each token's log-probability, log_softmax(logits / T) as an RL trainer computes it",
    )
    processors = parser.add_argument_group(
        "logits processors (HF's own, each applied to one prompt's ids as a single-request generate applies it)")
    processors.add_argument(
        "--no-repeat-ngram-size",
        type=positive_int,
        metavar="N",
        help="no N-gram of the prompt and completion occurs twice",
    )
    processors.add_argument(
        "--suppress-tokens",
        type=token_ids_argument,
        metavar="IDS",
        help="token ids never generated, comma-separated (e.g. 17,42)",
    )
    processors.add_argument(
        "--bad-words-ids",
        dest="bad_words_ids",
        action="append",
        type=token_ids_argument,
        metavar="IDS",
        help="a token sequence never completed (its last id banned after the "
        "others), comma-separated; repeat for several",
    )
    processors.add_argument(
        "--generation-option",
        dest="generation_options",
        action="append",
        type=generation_option_argument,
        metavar="KEY=VALUE",
        help="any other GenerationConfig field for every call, VALUE as JSON (e.g. "
        "'sequence_bias=[[[17], -5.0]]', begin_suppress_tokens=[2]); repeat for several",
    )
    parser.add_argument("--out", default="-", metavar="FILE", help="output JSONL (default: - for stdout)")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars (transformers' loading bar included) and no summary; warnings "
        "and errors still print",
    )
    # the library's slow-bf16 warning names the API setting; here it is the flag (phrases hold a space)
    phrases = {"runs kernels='torch'": "runs --kernels torch", "runs kernels='auto'": "runs --kernels auto", 'RolloutConfig(kernels="invariant") runs': "--kernels invariant runs",
               "pass a non-empty string, a list of them ([] disables stop strings), or None for the model's generation "
               "config": "give each --stop some text", OVERRIDE_PHRASE: "pass --allow-mismatch"}  # fmt: skip
    finish_parser(parser, _run_generate, phrases=phrases)


def _run_generate(args: argparse.Namespace) -> int:
    from autobucket.cli.args import model_arguments
    from autobucket.config import RolloutConfig, SamplingConfig
    from autobucket.tools.generate_job import GenerateJob, run_generate_job

    sampling_options, generation_options = _generation_options(
        args, {field.name for field in dataclasses.fields(SamplingConfig)})
    _check_sampling_flags(args)  # before the config's own greedy check, to name the flags and their fix
    sampling = SamplingConfig(
        **sampling_options,
        max_new_tokens=args.max_new_tokens,
        continuous_batch_size=args.continuous_batch_size,
        repetition_penalty=args.repetition_penalty,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        n=args.n,
        seed=args.seed,
        logprobs=args.logprobs,
        stop_strings=args.stop_strings,
        min_new_tokens=args.min_new_tokens,
    )
    job = GenerateJob(
        prompts=args.prompts,
        out=args.out,
        input_format=args.input_format,
        chat=args.chat,
        **model_arguments(args),  # the --model group, named as `autobucket.load_model` takes it
        rollout=RolloutConfig(route=args.route, costs=args.costs, kernels=args.kernels,
                              prefix_cache_mb=args.prefix_cache_mb, prefill_max_tokens=args.prefill_max_tokens,
                              compile=_COMPILE[args.compile], packed_weights_mb=args.packed_weights_mb,
                              costs_strict=not args.allow_mismatch),
        sampling=sampling,
        generation_options=generation_options,
    )
    if args.quiet:
        from transformers.utils import logging

        logging.disable_progress_bar()  # transformers' and huggingface_hub's loading and download bars
        run_generate_job(job)
        return 0
    summary = _run_with_progress(job)
    _print_summary(summary)
    return 0


# flag -> the GenerationConfig field it sets
_PROCESSOR_FLAGS = {"--no-repeat-ngram-size": "no_repeat_ngram_size", "--suppress-tokens": "suppress_tokens",
                    "--bad-words-ids": "bad_words_ids"}  # fmt: skip


def _generation_options(args: argparse.Namespace, sampling_fields: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SamplingConfig fields, GenerationConfig overrides of every call) from the processor flags and the
    --generation-option pairs: a pair naming a SamplingConfig field without a flag here (min_p, typical_p,
    eos_token_id, ...) goes to the sampling config; one naming a field this command has a flag for
    (--temperature, --no-repeat-ngram-size, ...) is refused with that flag, as is a field given twice."""
    overrides = {field: getattr(args, field) for field in _PROCESSOR_FLAGS.values() if getattr(args, field) is not None}
    pairs: dict[str, Any] = {}
    for key, value in args.generation_options or ():
        flag = args.cli_words.get(key)
        if flag is not None:
            raise ValueError(f"--generation-option sets {flag}, a flag of its own: pass {flag} instead")
        if key in pairs:
            raise ValueError(f"--generation-option sets {key!r} twice: give it once")
        pairs[key] = value
    sampling = {key: value for key, value in pairs.items() if key in sampling_fields}
    return sampling, {**overrides, **{key: value for key, value in pairs.items() if key not in sampling_fields}}


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """Sampling flags without --temperature would be ignored (greedy decoding, as in HF): say so instead.
    Only values in range count; the config's range check names an out-of-range one more precisely."""
    if args.temperature != 0.0:
        return
    ignored = [
        *([f"--top-k {args.top_k}"] if args.top_k > 0 else []),
        *([f"--top-p {args.top_p}"] if 0.0 < args.top_p < 1.0 else []),
        *([f"--n {args.n}"] if args.n != 1 else []),
    ]
    if ignored:
        raise ValueError(
            f"{' and '.join(ignored)} only {'applies' if len(ignored) == 1 else 'apply'} when sampling, and "
            "--temperature is 0 (greedy: every sample would be the same, top-k / top-p ignored): add "
            "--temperature T > 0, e.g. --temperature 1.0"
        )


def _run_with_progress(job: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers.utils import logging

    from autobucket.tools.generate_job import run_generate_job

    logging.disable_progress_bar()  # transformers' loading bars would tear through the live bar
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    console = Console(stderr=True)  # a bar in a log file is noise (and a stray blank line before an error)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("loading model", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, description="prompts", completed=done, total=total)

        return run_generate_job(job, on_progress)


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in summary_lines(summary):
        console.print(line, markup=False)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The run's summary as printed on stderr: what ran, what it cost, where the rows went."""
    from autobucket.tools.wording import counted

    calls = sum(summary["routes_run"].values())
    routes = ", ".join(
        f"{route} in {count} of {calls} {'call' if calls == 1 else 'calls'}"
        for route, count in summary["routes_run"].items()
    )
    widths = [w for chunk in summary["bucket_widths"] for w in chunk]
    buckets = f"first-admission prefill widths {_short_list(widths)}" if widths else "no prefill groups recorded"
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(summary["finish_reasons"].items()))
    cached = summary["cached_prompt_tokens"]
    cache = f", {counted(cached, 'prompt token')} from the prefix cache" if cached else ""
    return [
        f"generate: {counted(summary['prompts'], 'prompt')} ({counted(summary['prompt_tokens'], 'prompt token')}) -> "
        f"{counted(summary['output_tokens'], 'token')} in {summary['generate_s']:.2f} s "
        f"({summary['tokens_per_s']:.1f} tok/s); model load {summary['load_s']:.1f} s",
        f"route {summary['route']} ran {routes}; {buckets}",
        f"{counted(summary['prefill_forwards'], 'prefill forward')} "
        f"({counted(summary['prefill_tokens'], 'padded token')}{cache}), "
        f"{counted(summary['decode_forwards'], 'decode forward')}; finish: {reasons}; out: {summary['out']}",
        cost_model_line(summary),
        *([plan_line(summary["plan"])] if summary.get("plan") else []),
    ]


def plan_line(plan: dict[str, Any]) -> str:
    """`plan: linear=cpu prefill_attention=cpu ... decode=engine`: the last call's backend per op family."""
    ops = " ".join(f"{op}={backend}" for op, backend in plan.items() if op not in ("decode_step", "reasons"))
    return f"plan: {ops} decode={plan.get('decode_step', '')}"


def cost_model_line(summary: dict[str, Any]) -> str:
    """Predicted vs measured ms of the timed forwards and steps, and where the coefficients came from."""
    source = summary.get("costs_source") or "?"
    if summary.get("predicted_ms") is None:
        return f"cost model: no prediction (coefficients: {source})"
    note = {"defaults": " - the built-in reference (GPU) defaults, not measured here: expect large errors",
            "probe": " - from a short probe on this machine", "online": " - learned from earlier calls",
            "stored": " - learned by an earlier run", "file": " - from the calibration file"}.get(source, "")  # fmt: skip
    return (
        f"cost model: predicted {summary['predicted_ms']:.0f} ms vs measured {summary['measured_ms']:.0f} ms "
        f"for the timed forwards and steps (coefficients: {source}{note})"
    )


def _short_list(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")
