"""The links between the project's documents resolve: every relative link of README.md, ARCHITECTURE.md,
BENCHMARKS.md and docs/*.md names a file that exists and, with a ``#fragment``, a heading of that file, so a
renamed section or a moved page cannot leave a reader on a dead link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(
    [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "BENCHMARKS.md", *REPO.glob("docs/*.md")]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _local_links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def _broken(document: Path) -> list[str]:
    """The relative links of ``document`` whose file or heading does not exist."""
    broken = []
    for link in _local_links(document):
        target, _, fragment = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists() or (fragment and path.suffix == ".md" and fragment not in _anchors(path)):
            broken.append(link)
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_an_existing_file_and_heading(document: Path) -> None:
    assert _broken(document) == []


def test_a_dead_link_and_a_missing_heading_are_caught(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Confidence modes (`--confidence`, `CLEF_CONFIDENCE`)\n")
    (tmp_path / "a.md").write_text(
        "# The seed\n[a](#the-seed) [b](b.md#confidence-modes---confidence-clef_confidence) [c](https://x.y/z)\n"
        "[gone](missing.md) [renamed](b.md#confidence-modes) [here](#nothing)\n"
    )
    assert _broken(tmp_path / "a.md") == ["missing.md", "b.md#confidence-modes", "#nothing"]
