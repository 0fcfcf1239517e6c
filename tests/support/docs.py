"""The Markdown the project documents itself in: the README and the pages of the site (docs/, mkdocs.yml)."""

from __future__ import annotations

import re

from tests.support.running import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def marked_snippets(text: str) -> list[tuple[str, str, str]]:
    """(name, language, code) of each block marked ``<!-- snippet: NAME ... -->`` in a Markdown text, in order."""
    return re.findall(r"<!-- snippet: (\S+)[^>]*-->\s*```(\w+)\n(.*?)```", text, re.S)
