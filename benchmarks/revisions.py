"""Two git revisions' whole calls in one interleaved run: this tree (HEAD) against BASE, per workload and config.

    make bench-revisions BASE=30989b8     # = taskset -c 0 python benchmarks/revisions.py --base 30989b8
    python benchmarks/revisions.py --base HEAD~0 --size smoke --out /tmp/rev/smoke.json   # a check that it runs

BASE is checked out into a temporary git worktree (removed after); `--head REV` does the same for the
other side, which is otherwise this working tree as it is. Each side is one long-lived worker process
(`revision_worker.py`) that imports autobucket from its own tree's `src`, both pinned to the same core
(`--core`), both on the same interpreter, torch, transformers and saved model weights: only autobucket
differs. The kernel library's build is keyed by its sources' digest, so each side loads its own.

Workloads, built by their own scripts' builders: bench-peers' seven (`peers/compare.py`: greedy, 16 new
tokens, EOS off, route "auto", compile off), the GRPO-like call (`shared_decode.py`: 8 prompts x n = 8,
64 new tokens, temperature 1, fresh prompts and seed every round) and the four-turn tool episodes
(`multi_turn.py`: 16 episodes with a 1024 MB prefix cache emptied every round, turns precomputed here).
Each runs under every named config: a RolloutConfig's fields per side, over the workload's own fields.
The defaults are `kernels="invariant"` on both sides, the default config on both, BASE "hf" against HEAD
"torch" (one set of ops under its old and new name), and HEAD's default against BASE's invariant kernels.
A config a revision refuses is reported on its row, not run.

Per workload: one warm-up call of every config on both sides, then `--rounds` rounds, each running every
config on both sides back to back, BASE first in even rounds and HEAD first in odd ones (ABBA), every
side timing its own calls. Printed per workload and config: both medians, HEAD / BASE (ratio of the
medians) with the spread of the per-round ratios, and whether both sides' tokens are equal (reported
where they differ; configs marked `same_tokens` should agree bitwise). Raw samples go to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]  # the workloads' own scripts and what they import

import multi_turn  # noqa: E402
import shared_decode  # noqa: E402
import torch  # noqa: E402
from peers import compare  # noqa: E402

from autobucket import Rollout, RolloutConfig, SamplingConfig  # noqa: E402
from autobucket.costs.calibration_file import host_cpu  # noqa: E402
from autobucket.models import CACHE_DIR_ENV, build_tiny_model  # noqa: E402
from autobucket.prompts import random_prompts  # noqa: E402

SIDES = ("base", "head")
WARMUP_SEED = 1000  # warm-up rounds draw inputs no timed round sees


@dataclass(frozen=True)
class Pairing:
    """A named config: the RolloutConfig fields each side gets. `target` is what the ratio HEAD / BASE
    should meet ("within", 0.03: |ratio - 1| <= 3%; "at most", 1.0); `same_tokens`: both sides' tokens
    should be bitwise equal (the same arithmetic on both)."""

    name: str
    base: dict
    head: dict
    target: tuple[str, float] | None = None
    same_tokens: bool = False


PAIRINGS = (
    Pairing("invariant", {"kernels": "invariant"}, {"kernels": "invariant"}, ("within", 0.03), same_tokens=True),
    Pairing("default", {}, {}),
    Pairing("model's ops", {"kernels": "hf"}, {"kernels": "torch"}, ("within", 0.03), same_tokens=True),
    Pairing("default vs invariant before", {"kernels": "invariant"}, {}, ("at most", 1.0)),
)


@dataclass(frozen=True)
class Workload:
    """One workload: its RolloutConfig fields (under every pairing's) and, per seed, a round's request
    (sampling fields and the prompts of each call in order)."""

    name: str
    config: dict
    request: Callable[[int], dict]


@dataclass
class Measured:
    """One workload under one pairing: each side's samples, per-round token agreement, refusals."""

    workload: str
    pairing: Pairing
    samples_ms: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})
    tokens_equal: list[bool] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    warnings: dict[str, list[str]] = field(default_factory=dict)


# ------------------------------------------------------------ workloads
def changed_fields(value: object) -> dict:
    """A dataclass's fields that differ from their defaults: what a request names, so an older revision's
    class (which may lack a newer field at its default) takes it."""
    out = {}
    for item in dataclasses.fields(value):
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        if getattr(value, item.name) != default:
            out[item.name] = getattr(value, item.name)
    return out


def peers_workloads(vocab: int, size: SimpleNamespace, seed: int) -> list[Workload]:
    """bench-peers' workloads as `compare.contenders` calls them (the same prompts every round)."""
    sampling = changed_fields(SamplingConfig(max_new_tokens=size.peers_new_tokens, continuous_batch_size=32, eos_token_id=[]))
    chosen = [w for w in compare.workloads() if not size.peers or any(w.name.startswith(p) for p in size.peers)]
    return [Workload(f"bench-peers {w.name}", {"route": "auto", "compile": False},
                     lambda _, w=w: {"sampling": sampling, "turns": [random_prompts(w.lengths, vocab, seed=seed)]})
            for w in chosen]  # fmt: skip


def grpo_workload(vocab: int, size: SimpleNamespace) -> Workload:
    """shared_decode.py's GRPO-like call: fresh prompts and sampling seed every round."""
    args = SimpleNamespace(new_tokens=size.grpo_new_tokens, n=size.grpo_n)

    def request(seed: int) -> dict:
        sampling = changed_fields(shared_decode.call_sampling(args, seed))
        return {"sampling": sampling, "turns": [shared_decode.round_prompts(vocab, size.grpo_prompts, seed)]}

    return Workload(f"GRPO-like call ({size.grpo_prompts} x n = {size.grpo_n})", {"route": "auto"}, request)


def episodes_workload(model: torch.nn.Module, size: SimpleNamespace) -> Workload:
    """multi_turn.py's tool episodes, each round's turns precomputed by a default Rollout here."""
    reference = Rollout(model, config=RolloutConfig(route="auto"))
    vocab, new_tokens = model.config.vocab_size, size.episode_new_tokens

    def request(seed: int) -> dict:
        conversations = multi_turn.episode_round(reference, vocab, size.episodes, new_tokens, seed)
        return {"sampling": changed_fields(multi_turn.sampling(new_tokens)), "turns": conversations.turns}

    return Workload(f"multi-turn episodes ({size.episodes} x {multi_turn.TURNS} turns)",
                    {"route": "auto", "prefix_cache_mb": 1024}, request)  # fmt: skip


SIZES = {
    "full": SimpleNamespace(peers=(), peers_new_tokens=16, grpo_prompts=8, grpo_n=8, grpo_new_tokens=64,
                            episodes=16, episode_new_tokens=multi_turn.EPISODE_NEW_TOKENS, rounds=6),
    "smoke": SimpleNamespace(peers=("short tail",), peers_new_tokens=2, grpo_prompts=2, grpo_n=2, grpo_new_tokens=2,
                             episodes=2, episode_new_tokens=2, rounds=2),
}  # fmt: skip


# ------------------------------------------------------------ the two sides
@contextmanager
def checked_out(revision: str) -> Iterator[tuple[Path, str]]:
    """(a temporary worktree of `revision`, its commit); the worktree is removed after."""
    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    folder = Path(tempfile.mkdtemp(prefix="autobucket-revision-")) / "tree"
    git("worktree", "add", "--detach", "--quiet", str(folder), commit)
    try:
        yield folder, commit
    finally:
        git("worktree", "remove", "--force", str(folder))
        folder.parent.rmdir()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


class Side:
    """A worker process importing autobucket from `tree`/src, pinned to `core`, with `cache` as its
    autobucket cache root (both sides start from none); its stderr goes to `log`."""

    def __init__(self, label: str, tree: Path, commit: str, model_dir: Path, core: int, log: Path, cache: Path) -> None:
        self.label, self.tree, self.commit, self.log = label, tree, commit, log
        # its own cache root: what one side's online cost learning stores, the other side never reads
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1", **{CACHE_DIR_ENV: str(cache)})
        command = [sys.executable, str(HERE / "revision_worker.py"), "--model-dir", str(model_dir), "--core", str(core)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                        text=True, env=env)  # fmt: skip
        self.facts: dict = {}

    def ready(self) -> None:
        """Wait for the worker's first answer; refuse a worker that imported another tree's autobucket."""
        self.facts = self._answer()
        if not Path(self.facts["autobucket"]).resolve().is_relative_to((self.tree / "src").resolve()):
            raise SystemExit(f"the {self.label} worker imported autobucket from {self.facts['autobucket']}, not from {self.tree}/src")

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.label} worker exited with code {self.process.wait()}; its log: {self.log}")
        return json.loads(line)

    def call(self, config: dict, request: dict) -> dict:
        self.process.stdin.write(json.dumps({"config": config, **request}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        """End the worker (its loop ends at the end of its input); one that does not end is killed."""
        with suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------ measuring
def run_workload(sides: dict[str, Side], workload: Workload, pairings: list[Pairing], rounds: int, seed: int) -> list[Measured]:
    """One warm-up call per pairing and side, then `rounds` ABBA rounds over every pairing."""
    measured = [Measured(workload.name, pairing) for pairing in pairings]
    warmup = workload.request(WARMUP_SEED + seed)
    for entry in measured:
        for side in SIDES:
            answer = sides[side].call(side_config(workload, entry.pairing, side), warmup)
            entry.warnings[side] = answer["warnings"]
            if "error" in answer:
                entry.errors[side] = answer["error"]
    for index in range(rounds):
        request, order = workload.request(seed + index), SIDES if index % 2 == 0 else SIDES[::-1]
        for entry in measured:
            if entry.errors:
                continue
            answers = {side: sides[side].call(side_config(workload, entry.pairing, side), request) for side in order}
            for side, answer in answers.items():
                if "error" in answer:
                    entry.errors[side] = answer["error"]
                else:
                    entry.samples_ms[side].append(answer["ms"])
            if not entry.errors:
                entry.tokens_equal.append(answers["base"]["tokens"] == answers["head"]["tokens"])
        print(f"{workload.name}: round {index + 1}/{rounds} done", flush=True)
    return measured


def side_config(workload: Workload, pairing: Pairing, side: str) -> dict:
    return {**workload.config, **getattr(pairing, side)}


def summary(entry: Measured) -> dict:
    """Medians per side, HEAD / BASE of the medians, the per-round ratios, token agreement, the verdict."""
    base, head = entry.samples_ms["base"], entry.samples_ms["head"]
    out = {"workload": entry.workload, "config": entry.pairing.name, "base_config": entry.pairing.base,
           "head_config": entry.pairing.head, "errors": entry.errors, "warnings": entry.warnings,
           "tokens_equal_rounds": entry.tokens_equal, "samples_ms": entry.samples_ms}  # fmt: skip
    if not base or not head:
        return out
    ratio = statistics.median(head) / statistics.median(base)
    out.update(median_ms={"base": statistics.median(base), "head": statistics.median(head)}, ratio=ratio,
               round_ratios=[h / b for b, h in zip(base, head, strict=True)], verdict=verdict(ratio, entry.pairing.target))  # fmt: skip
    return out


def verdict(ratio: float, target: tuple[str, float] | None) -> str | None:
    if target is None:
        return None
    kind, limit = target
    met = abs(ratio - 1.0) <= limit if kind == "within" else ratio <= limit
    return f"{'met' if met else 'NOT met'} ({kind} {limit:g})"


# ------------------------------------------------------------ reporting
def tokens_cell(row: dict, same_tokens: bool) -> str:
    rounds = row["tokens_equal_rounds"]
    if not rounds:
        return "-"
    differing = rounds.count(False)
    if not differing:
        return "yes"
    return f"{'DISAGREE' if same_tokens else 'differ'}: {differing} of {len(rounds)} rounds"


def print_table(rows: list[dict], pairings: dict[str, Pairing]) -> None:
    print("| workload | config | base ms | head ms | head / base | per-round ratios | tokens equal | target |")
    print("|" + "---|" * 8)
    for row in rows:
        if "ratio" not in row:
            refused = "; ".join(f"{side} refused: {error}" for side, error in row["errors"].items())
            print(f"| {row['workload']} | {row['config']} | - | - | - | - | - | {refused} |")
            continue
        spread = row["round_ratios"]
        print(f"| {row['workload']} | {row['config']} | {row['median_ms']['base']:.1f} | {row['median_ms']['head']:.1f}"
              f" | {row['ratio']:.3f} | {min(spread):.3f}-{max(spread):.3f} ({len(spread)})"
              f" | {tokens_cell(row, pairings[row['config']].same_tokens)} | {row['verdict'] or '-'} |")  # fmt: skip
    for name, pairing in pairings.items():
        print(f"config {name!r}: base {json.dumps(pairing.base)}, head {json.dumps(pairing.head)}")
    print_targets(rows, pairings)
    print_agreement(rows, pairings)
    for side, message in sorted({(side, m) for row in rows for side, caught in row["warnings"].items() for m in caught}):
        print(f"{side} warned: {message}")


def print_agreement(rows: list[dict], pairings: dict[str, Pairing]) -> None:
    """One line: whether both sides' tokens were equal in every round of every config that should agree."""
    should = [row for row in rows if pairings[row["config"]].same_tokens and row["tokens_equal_rounds"]]
    disagree = [f"{row['workload']} / {row['config']}" for row in should if not all(row["tokens_equal_rounds"])]
    if disagree:
        print(f"tokens: the sides DISAGREE where they should agree: {'; '.join(disagree)}")
    else:
        print(f"tokens: the sides agree in every round of the {len(should)} workload / config pairs that should agree")


def print_targets(rows: list[dict], pairings: dict[str, Pairing]) -> None:
    """Per config with a target: on how many workloads HEAD / BASE met it, and where it did not."""
    for name, pairing in pairings.items():
        if pairing.target is None:
            continue
        judged = [row for row in rows if row["config"] == name and "ratio" in row]
        if not judged:
            print(f"target {name!r}: not measured (refused or failed on every workload)")
            continue
        missed = [f"{row['workload']} {row['ratio']:.3f}" for row in judged if row["verdict"].startswith("NOT")]
        kind, limit = pairing.target
        print(f"target {name!r}: head / base {kind} {limit:g} on {len(judged) - len(missed)} of {len(judged)} workloads"
              + (f"; not on {', '.join(missed)}" if missed else ""))  # fmt: skip


# ------------------------------------------------------------ main
def parse_pairing(values: list[str]) -> Pairing:
    """`--config NAME BASE_JSON [HEAD_JSON]`: HEAD_JSON defaults to BASE_JSON."""
    if len(values) not in (2, 3):
        raise SystemExit(f"--config takes NAME BASE_JSON [HEAD_JSON], not {values}")
    configs = [json.loads(text) for text in values[1:]]
    if not all(isinstance(c, dict) for c in configs):
        raise SystemExit(f"--config {values[0]}: each config is a JSON object of RolloutConfig fields, not {values[1:]}")
    return Pairing(values[0], configs[0], configs[-1], same_tokens=configs[0] == configs[-1])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against (a commit, tag, HEAD~1)")
    parser.add_argument("--head", default=None, help="a git revision for the other side (default: this working tree)")
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument("--rounds", type=int, default=None, help="timed ABBA rounds (default: the size's; even)")
    parser.add_argument("--model", default="bench-qwen2", help="a tiny random-weight model name (autobucket.models)")
    parser.add_argument("--workloads", default="", help="comma-separated workload name prefixes (default: all)")
    parser.add_argument("--config", dest="configs", nargs="+", action="append", metavar="NAME BASE_JSON [HEAD_JSON]",
                        help="a named config instead of the defaults (repeatable): RolloutConfig fields per side")  # fmt: skip
    parser.add_argument("--core", type=int, default=min(os.sched_getaffinity(0)), help="the core both workers are pinned to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/revisions/revisions.json")
    args = parser.parse_args(argv)
    if args.rounds is not None and (args.rounds < 2 or args.rounds % 2):
        parser.error(f"--rounds {args.rounds}: ABBA rounds come in pairs (each side first equally often); give an even number >= 2")
    return args


def tree_side(stack: ExitStack, revision: str | None) -> tuple[Path, str]:
    """(tree, commit): this working tree (its commit, "+" when it has uncommitted changes), or a checkout."""
    if revision is None:
        dirty = "+" if git("status", "--porcelain", "--untracked-files=no") else ""
        return ROOT, git("rev-parse", "HEAD") + dirty
    return stack.enter_context(checked_out(revision))


def build_workloads(model: torch.nn.Module, size: SimpleNamespace, prefixes: str, seed: int) -> list[Workload]:
    vocab = model.config.vocab_size
    workloads = [*peers_workloads(vocab, size, seed), grpo_workload(vocab, size), episodes_workload(model, size)]
    return [w for w in workloads if not prefixes or any(w.name.startswith(p) for p in prefixes.split(","))]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    size = SIZES[args.size]
    pairings = [parse_pairing(values) for values in args.configs] if args.configs else list(PAIRINGS)
    torch.set_num_threads(1)  # the precomputed episodes here; each worker sets its own
    model = build_tiny_model(args.model)
    workloads = build_workloads(model, size, args.workloads, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="autobucket-revisions-")))
        model.save_pretrained(scratch / "model")  # both sides load exactly these weights
        trees = {"base": tree_side(stack, args.base), "head": tree_side(stack, args.head)}
        sides = {side: Side(side, tree, commit, scratch / "model", args.core, out.with_suffix(f".{side}.log"), scratch / f"{side}-cache")
                 for side, (tree, commit) in trees.items()}  # fmt: skip
        for side in sides.values():  # both start at once; each is closed however the run ends
            stack.callback(side.close)
        for side in sides.values():
            side.ready()
        for workload in workloads:
            rows += [summary(m) for m in run_workload(sides, workload, pairings, args.rounds or size.rounds, args.seed)]
        facts = {side: {"commit": s.commit, "revision": getattr(args, side) or "working tree", **s.facts} for side, s in sides.items()}
    print(f"\n{args.model} fp32, one thread, core {args.core}, {host_cpu()}; base {facts['base']['commit'][:12]} "
          f"({facts['base']['revision']}), head {facts['head']['commit'][:12]} ({facts['head']['revision']}); "
          f"medians of {args.rounds or size.rounds} ABBA rounds")  # fmt: skip
    print_table(rows, {p.name: p for p in pairings})
    out.write_text(json.dumps({"argv": sys.argv, "cpu": host_cpu(), "size": args.size, "model": args.model,
                               "sides": facts, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
