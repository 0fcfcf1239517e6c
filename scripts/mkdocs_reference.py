"""MkDocs hooks of the documentation site's reference pages and diagrams (mkdocs.yml, ``hooks:``), run by every build.

- The CLI reference (``reference/cli.md``): the page holds a marker, ``<!-- cli-reference -->``, replaced at each
  build by the help of every ``tinker-atropos`` command, generated from the Typer app itself
  (``tinker_atropos.launcher.cli.app``) by Typer's own Markdown writer, so an option added to the CLI is on the page
  at the next build and none is copied by hand.
- Diagrams: a fenced block of language ``mermaid`` becomes a ``<pre class="diagram">`` that ``javascripts/diagrams.js``
  draws as SVG in the browser with a local copy of mermaid.js. The site reads nothing from the network, so that copy
  is served from the site itself: ``assets/javascripts/mermaid.min.js``, taken at build from the ``artoo-mermaid``
  wheel (pinned mermaid.min.js, MIT; the Makefile installs it) and never committed. (Material's own Mermaid support
  fetches the script from a CDN and draws into a closed shadow root; ours draws into the page.)

The custom fence is set here rather than in mkdocs.yml so that mkdocs.yml stays plain YAML (no ``!!python`` tags:
tests/unit/test_docs.py reads it with ``yaml.safe_load``).
"""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path
from typing import Any

CLI_MARKER = "<!-- cli-reference -->"
MERMAID_JS = "assets/javascripts/mermaid.min.js"
MERMAID_PACKAGE = "artoo_mermaid"  # its Python part needs 3.12 and is never imported: only its asset is read
MERMAID_INSTALL = (
    ".venv/bin/python -m pip install --no-deps --ignore-requires-python artoo-mermaid==11.16.0 "
    "(the Makefile's install step does it)"
)


def diagram_fence(source: str, language: str, css_class: str, options: Any, md: Any, **kwargs: Any) -> str:
    """A ``mermaid`` block as the text diagrams.js draws: escaped, inside ``<pre class="diagram">``."""
    return f'<pre class="diagram"><code>{html.escape(source)}</code></pre>'


def on_config(config: Any) -> Any:
    superfences = config["mdx_configs"].setdefault("pymdownx.superfences", {})
    fences = [fence for fence in superfences.get("custom_fences", []) if fence.get("name") != "mermaid"]
    fences.append({"name": "mermaid", "class": "diagram", "format": diagram_fence})
    superfences["custom_fences"] = fences
    return config


def mermaid_js() -> Path:
    spec = importlib.util.find_spec(MERMAID_PACKAGE)  # finds the folder without running its __init__
    places = (spec.submodule_search_locations or []) if spec else []
    found = [Path(place) / "assets" / "mermaid.min.js" for place in places]
    found = [path for path in found if path.is_file()]
    if not found:
        raise RuntimeError(f"mermaid.min.js is not installed; the site's diagrams need it: {MERMAID_INSTALL}")
    return found[0]


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, MERMAID_JS, abs_src_path=str(mermaid_js())))
    return files


def cli_reference() -> str:
    """Every command of ``tinker-atropos`` with its usage, arguments and options, in Markdown (Typer's writer)."""
    import click
    import typer
    from typer.cli import get_docs_for_click

    from tinker_atropos.launcher.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(
        obj=command, ctx=click.Context(command, info_name="tinker-atropos"), name="tinker-atropos", title=None
    )
    # the page has its own title: the command's sections one level down, each a heading of the table of contents
    text = re.sub(r"^# .*\n", "", text, count=1)
    # the list of commands links each to its section (its heading "`tinker-atropos NAME`")
    text = re.sub(r"^\* `([a-z][a-z-]*)`:", r"* [`\1`](#tinker-atropos-\1):", text, flags=re.M)
    return text.strip() + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, cli_reference())
    return markdown
