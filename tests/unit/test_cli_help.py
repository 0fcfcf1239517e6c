"""What ``tinker-atropos --help`` prints is plain text: the docstrings it comes from are reStructuredText (for the
API docs), and Typer prints their double backticks as they are."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from tinker_atropos.launcher.cli import app, plain_help

SUBCOMMANDS: list[str] = sorted(getattr(typer.main.get_command(app), "commands", {}))


def test_the_cli_has_subcommands() -> None:
    assert {"up", "trainer", "status", "health"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("words", [[], *([name] for name in SUBCOMMANDS)], ids=lambda w: " ".join(w) or "top")
def test_help_shows_no_double_backticks(words: list[str]) -> None:
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert "``" not in result.output


def test_plain_help_drops_inline_literal_markers() -> None:
    assert plain_help("run ``up`` or ``env``") == "run up or env"
