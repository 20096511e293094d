"""The call-level suite: each call-level benchmark at a small size, one summary table and one JSON.

    make bench                                             # = taskset -c 0 python benchmarks/suite.py
    python benchmarks/suite.py --size smoke --out /tmp/bench   # every step at its smallest: a check that it runs

Each step runs one script of this folder in its own process (the same interpreter, pinned as this one
is), at the size named in STEPS, and leaves that script's own JSON and printed table under `--out`.
The summary reads the JSONs back and prints one row per figure, the figure docs/benchmarks.md shows for
the same benchmark; `summary.json` holds those rows, the CPU kind, the commit and every step's command.
Compare a row with the table of your CPU kind there: the ratios travel between machines of one kind,
absolute times do not. Default size: the documented workloads with fewer rounds; vLLM is left out
(`make bench-peers` builds its venv and runs bench-peers beside it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autobucket.costs.calibration_file import host_cpu

HERE = Path(__file__).resolve().parent
Row = tuple[str, str, float | str]  # (benchmark, figure, value)


@dataclass(frozen=True)
class Step:
    """One benchmark script, its arguments per size, and the figures the summary takes from its JSON."""

    name: str
    script: str
    args: dict[str, list[str]]  # size -> arguments (without --out)
    figures: Callable[[object], list[Row]]


def peers_rows(report: dict) -> list[Row]:
    rows: list[Row] = []
    for row in report["rows"]:
        hf = row["hf_generate"]["median_ms"]
        workload = row["workload"].split(" (")[0]
        rows.append(("bench-peers", f"{workload}: invariant / HF generate", row["auto_invariant"]["median_ms"] / hf))
        rows.append(("bench-peers", f"{workload}: auto / HF generate", row["auto"]["median_ms"] / hf))
        equal = all(row[name]["tokens_equal_hf"] for name in ("auto", "auto_invariant"))
        rows.append(("bench-peers", f"{workload}: tokens equal HF greedy", "yes" if equal else "NO (see its table)"))
    return rows


def shared_decode_rows(report: dict) -> list[Row]:
    summary = report["summary"]
    total = {name: s["median_total_ms"] for name, s in summary.items()}
    per_row = total["autobucket (per-row copies)"]
    return [
        ("GRPO-like call", "invariant shared / default per-row copies", total["autobucket invariant (shared)"] / per_row),
        ("GRPO-like call", "default shared / default per-row copies", total["autobucket (shared prompt K/V)"] / per_row),
    ]


def multi_turn_rows(report: dict) -> list[Row]:
    summary = report["workloads"]["episodes"]["summary"]
    total = {name: s["median_total_ms"] for name, s in summary.items()}
    return [("multi-turn episodes", "invariant prefix cache / its own re-prefill",
             total["autobucket invariant (prefix cache)"] / total["autobucket invariant (re-prefill)"])]  # fmt: skip


def mismatch_rows(report: list) -> list[Row]:
    rows: list[Row] = []
    for entry in report:
        for kernels in ("invariant", "torch"):
            s = entry["samplers"][f"autobucket ({kernels})"]
            rows.append(("zero mismatch", f"{entry['dtype']} kernels={kernels}: k3", s["k3"]))
            rows.append(("zero mismatch", f"{entry['dtype']} kernels={kernels}: max abs dlogp", s["max_abs"]))
    return rows


def trainer_step_rows(report: dict) -> list[Row]:
    medians = report["medians_ms"]
    return [("trainer step", "under autobucket.invariant / plain", medians["invariant"] / medians["plain"])]


STEPS = [
    Step("bench-peers", "peers/compare.py",
         {"small": ["--no-vllm", "--no-compiled", "--repeats", "3"],
          "smoke": ["--no-vllm", "--no-compiled", "--repeats", "1", "--max-new-tokens", "2", "--workloads", "short tail"]},
         peers_rows),
    Step("GRPO-like call", "shared_decode.py",
         {"small": ["--invariant", "--repeats", "3"],
          "smoke": ["--invariant", "--repeats", "1", "--warmup", "0", "--prompts", "2", "--n", "2", "--new-tokens", "2"]},
         shared_decode_rows),
    Step("multi-turn episodes", "multi_turn.py",
         {"small": ["--workload", "episodes", "--invariant", "--repeats", "2"],
          "smoke": ["--workload", "episodes", "--invariant", "--repeats", "1", "--warmup", "0", "--episodes", "2",
                    "--new-tokens", "2"]},
         multi_turn_rows),
    Step("zero mismatch", "mismatch.py",
         {"small": ["--model", "bench-qwen2", "--repeats", "1"],
          "smoke": ["--model", "tiny-qwen2", "--repeats", "1", "--dtypes", "float32", "--lengths", "5,9", "--new-tokens", "2"]},
         mismatch_rows),
    Step("trainer step", "trainer_step.py",
         {"small": ["--repeats", "3"],
          "smoke": ["--model", "tiny-qwen2", "--repeats", "1", "--rows", "2", "--length", "8"]},
         trainer_step_rows),
]  # fmt: skip


def run_step(step: Step, size: str, out: Path) -> dict:
    """Run `step` in its own process; its JSON, log and command under `out`."""
    json_path = out / f"{Path(step.script).stem}.json"
    command = [sys.executable, str(HERE / step.script), *step.args[size], "--out", str(json_path)]
    print(f"suite: {step.name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    with open(out / f"{Path(step.script).stem}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
    seconds = time.perf_counter() - started
    return {"step": step.name, "command": command[1:], "seconds": seconds, "json": str(json_path)}


def summary_table(rows: list[Row]) -> str:
    lines = ["| benchmark | figure | value |", "|---|---|---:|"]
    for benchmark, figure, value in rows:
        shown = value if isinstance(value, str) else f"{value:.3g}"
        lines.append(f"| {benchmark} | {figure} | {shown} |")
    return "\n".join(lines)


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("small", "smoke"), default="small")
    parser.add_argument("--only", nargs="*", help="step names to run (default: all)", default=None)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    runs, rows = [], []
    for step in steps:
        runs.append(run_step(step, args.size, args.out))
        rows += step.figures(json.loads(Path(runs[-1]["json"]).read_text()))
    cpu = host_cpu()
    print(f"\nautobucket call-level suite, size {args.size}, commit {commit()}, {cpu}, one thread")
    print(summary_table(rows))
    summary = {"size": args.size, "commit": commit(), "cpu": cpu, "date": time.strftime("%Y-%m-%d"),
               "steps": runs, "rows": [{"benchmark": b, "figure": f, "value": v} for b, f, v in rows]}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"JSON: {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
