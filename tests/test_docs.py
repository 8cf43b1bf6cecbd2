"""The docs stay true to the code: the config reference is the schema's own rendering, and every
relative link in the README and docs/ reaches a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from longboat.config.compositions import page as compositions_page
from longboat.config.reference import COMMAND, render

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_config_reference_is_current() -> None:
    page = ROOT / "docs" / "config.md"
    assert page.exists(), f"docs/config.md is missing; generate it with `{COMMAND}`"
    assert page.read_text() == render(), (
        f"docs/config.md differs from the config schema; regenerate it with `{COMMAND}`"
    )


def test_compositions_page_is_current() -> None:
    page = ROOT / "docs" / "compositions.md"
    command = compositions_page.COMMAND
    assert page.exists(), f"docs/compositions.md is missing; generate it with `{command}`"
    assert page.read_text() == compositions_page.render(), (
        f"docs/compositions.md differs from the table of compositions; regenerate it with "
        f"`{command}`"
    )


def _relative_links(page: Path) -> list[str]:
    text = page.read_text()
    # Links inside code blocks and inline code are examples, not links.
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        targets.append(target)
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_files(page: Path) -> None:
    broken = [
        t for t in _relative_links(page) if not (page.parent / t.split("#")[0]).resolve().exists()
    ]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"\]\(([^)#\s]+\.md)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert not pages - listed, f"docs/index.md does not list: {sorted(pages - listed)}"
