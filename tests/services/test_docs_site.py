"""The documentation site as a reader gets it: built strictly by MkDocs, served over HTTP, opened in a real browser
(Debian's Chromium, headless), whose DOM after the page's scripts ran holds the navigation and a code block with the
copy button Material's JavaScript adds to it."""

from __future__ import annotations

import functools
import html
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.running import REPO

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [str(REPO / ".venv/bin/mkdocs"), "build", "--strict", "--site-dir", str(built)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    return built


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def rendered(url: str, profile: Path) -> str:
    """The page's DOM once its scripts ran, as headless Chromium dumps it."""
    assert shutil.which(CHROMIUM), (
        f"{CHROMIUM} not found: `make test` installs Debian's chromium (apt-get install chromium)"
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
    ]
    browser = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=60
    )
    assert browser.returncode == 0 and "</html>" in browser.stdout, browser.stderr[-3000:]
    return browser.stdout


def test_the_built_site_renders_its_navigation_and_code_blocks_in_a_browser(
    site: Path, served: str, tmp_path: Path
) -> None:
    dom = rendered(f"{served}/getting-started/", tmp_path / "profile")
    navigation = re.search(r'<nav class="md-nav md-nav--primary".*?</nav>\s*</div>', dom, re.S)
    assert navigation, "no primary navigation in the rendered page"
    links = {
        html.unescape(text).strip()
        for text in re.findall(
            r'class="md-nav__link[^"]*"[^>]*>\s*(?:<span[^>]*>)?\s*([^<]+)', navigation.group(0)
        )
    }
    for page in (
        "Architecture",
        "The Tinker API",
        "Atropos environments",
        "Configuration reference",
        "Benchmarks",
    ):
        assert page in links or any(page in link for link in links), (
            f"{page!r} not in the navigation: {links}"
        )
    blocks = [
        re.sub(r"<[^>]+>", "", block) for block in re.findall(r'<pre id="__code_\d+">.*?</pre>', dom, re.S)
    ]
    assert any("tinker-atropos up configs/pendulum.yaml" in block for block in blocks), (
        "no code block rendered"
    )
    # the copy button is added by the theme's JavaScript: the page ran in the browser, not just parsed
    assert 'data-clipboard-target="#__code_' in dom
    assert "data-clipboard-target" not in (site / "getting-started" / "index.html").read_text()


def test_the_architecture_diagram_is_drawn_in_the_browser_from_the_sites_own_mermaid(
    site: Path, served: str, tmp_path: Path
) -> None:
    """The ```mermaid block reaches the page as its source (``pre.diagram``) and the site's own copy of mermaid.js,
    served with it (the browser reads nothing else: the server serves only the site), draws it as an SVG in place."""
    page = (site / "architecture" / "index.html").read_text()
    assert '<pre class="diagram">' in page and "flowchart" in page
    assert (site / "assets" / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000
    dom = rendered(f"{served}/architecture/", tmp_path / "profile")
    drawn = re.findall(r'<div class="diagram"><svg\b.*?</svg>', dom, re.S)
    assert drawn, "no diagram drawn: " + ", ".join(re.findall(r'<pre class="diagram[^"]*"', dom))
    assert "environment services" in html.unescape(re.sub(r"<[^>]+>", " ", drawn[0]))
    assert '<pre class="diagram' not in dom  # every diagram of the page drawn, none left as source


def test_the_configuration_reference_is_a_page_of_the_site(site: Path) -> None:
    page = (site / "configuration" / "index.html").read_text()
    for field in ("run.seed", "trainer.ppo.learning_rate", "trainer.sac.utd_ratio", "atropos.environments"):
        assert f"<code>{field}</code>" in page, field
    assert (site / "deploy" / "index.html").exists() and (site / "bench" / "results" / "chaos.png").exists()
