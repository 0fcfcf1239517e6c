"""The README and the documentation site (docs/, mkdocs.yml) hold together: a README a newcomer reads in two
minutes, every page in the navigation, every result file a page cites present, the quick starts' commands valid.
``mkdocs build --strict`` (in `make test`) checks the links and anchors; the snippets that start a run are run by
tests/services/test_readme_snippets.py, the built site is opened in a browser by tests/services/test_docs_site.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import yaml

from scripts.mkdocs_hooks import MOUNTED
from tests.support.docs import DOCUMENTS, marked_snippets
from tests.support.running import REPO

DOCS = REPO / "docs"


def nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def site_config() -> dict:
    # mkdocs.yml is plain YAML (no !!python tags), so the navigation reads without MkDocs
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_the_readme_is_short_and_names_the_three_ways_in() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    first_screen = "\n".join(readme.splitlines()[:24])
    for way_in in ("Gymnasium", "Tinker", "Atropos"):
        assert way_in in first_screen, way_in
    for command in ("make run", "make test", "ServiceClient(base_url=...)"):
        assert command in readme, command


def test_every_page_is_in_the_navigation_and_every_entry_exists() -> None:
    listed = nav_pages(site_config()["nav"])
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    mounted = {path.relative_to(REPO).as_posix() for pattern in MOUNTED for path in REPO.glob(pattern)}
    generated = {"configuration.md"}
    assert not pages - set(listed), f"pages missing from mkdocs.yml's nav: {sorted(pages - set(listed))}"
    unknown = set(listed) - pages - mounted - generated
    assert not unknown, f"nav entries that are no page: {sorted(unknown)}"
    assert len(listed) == len(set(listed))


def test_every_result_file_the_pages_cite_is_in_the_repository() -> None:
    cited = set()
    for document in DOCUMENTS:
        # a path, not a glob (bench-learn-humanoid-*.json) nor the end of a sentence
        cited |= set(re.findall(r"bench/results/[\w./-]*[\w/](?![\w*/-]|\.\w)", document.read_text()))
    assert len(cited) > 30
    missing = sorted(path for path in cited if not (REPO / path).exists())
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_readme_links_only_to_files_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", readme) if not t.startswith("http")]
    assert targets
    assert all((REPO / target).exists() for target in targets), [
        t for t in targets if not (REPO / t).exists()
    ]


def test_the_quick_starts_name_real_configs_and_options() -> None:
    """The quick starts that run a whole training (tests/services run the same configs through `up`) are not run
    here; each line's config file exists and each option is one its command takes."""
    commands = []
    for document in DOCUMENTS:
        for name, language, code in marked_snippets(document.read_text()):
            if name.startswith("quickstart-") and language == "bash":
                commands += [line.split("#")[0].strip() for line in code.splitlines() if line.strip()]
    assert len(commands) >= 6
    environment = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    helps: dict[str, str] = {}
    for command in commands:
        program, subcommand, *arguments = shlex.split(command)
        assert program == ".venv/bin/tinker-atropos", command
        if subcommand not in helps:
            helps[subcommand] = subprocess.run(
                [str(REPO / program), subcommand, "--help"], capture_output=True, text=True, env=environment
            ).stdout
        for argument in arguments:
            if argument.startswith("--"):
                assert argument in helps[subcommand], f"{command}: `{subcommand}` takes no {argument}"
            elif argument.startswith("configs/"):
                assert (REPO / argument).is_file(), command
