"""The user's docs stay what they are for: a README that is an overview (at most 200 lines) linking
every task page under docs/, a BENCHMARKS.md of each benchmark's latest table (at most 400 lines),
a CHANGELOG whose release entries are a line or two a change (at most 150 lines each), prose lines
of at most 120 characters, and relative links that resolve."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

pytestmark = pytest.mark.quick

PAGES = sorted((REPO / "docs").glob("*.md"))
MARKDOWN = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md", REPO / "CHANGELOG.md", *PAGES]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside code blocks and tables (neither can wrap)."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.lstrip().startswith("|"):
            out.append(line)
    return out


def releases(changelog: str) -> dict[str, int]:
    """Lines of each release's entry, by its heading."""
    parts = re.split(r"^## (.+)$", changelog, flags=re.M)
    return {heading: len(body.strip().splitlines()) for heading, body in zip(parts[1::2], parts[2::2])}


def test_the_readme_is_an_overview_that_links_every_task_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert len(PAGES) >= 6 and [p.name for p in PAGES if f"docs/{p.name}" not in readme] == []


def test_benchmarks_md_and_the_changelog_stay_short():
    assert len((REPO / "BENCHMARKS.md").read_text().splitlines()) <= 400
    entries = releases((REPO / "CHANGELOG.md").read_text())
    assert entries and {h: n for h, n in entries.items() if n > 150} == {}


def test_prose_lines_are_at_most_120_characters():
    long = [f"{p.relative_to(REPO)}: {line[:60]}" for p in MARKDOWN for line in prose_lines(p.read_text())
            if len(line) > 120]
    assert long == []


def test_relative_links_resolve():
    broken = [f"{p.relative_to(REPO)}: {target}" for p in MARKDOWN for target, _ in LINK.findall(p.read_text())
              if "://" not in target and not target.startswith("mailto:") and not (p.parent / target).exists()]
    assert broken == []


def test_the_checks_find_a_long_line_a_long_release_and_a_link():
    text = "intro\n```\n" + "x" * 130 + "\n```\n| " + "y" * 130 + " |\n" + "z" * 121 + "\n"
    assert [len(line) for line in prose_lines(text)] == [5, 121]
    assert releases("# C\n## [1.0]\n" + "- a\n" * 151 + "## [0.9]\n- b\n") == {"[1.0]": 151, "[0.9]": 1}
    assert LINK.findall("see [a](docs/a.md#x) and [b](https://b)") == [("docs/a.md", "#x"), ("https://b", "")]
