"""Every command a container of compose.yaml or of a kustomization runs is handed to the real CLI with --help
appended, so that a renamed sub-command, flag or environment variable fails here instead of in a crash-looping
pod."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.support.deploy import KUSTOMIZATIONS, cli_help, container_commands, package_variables

# --- Commands against the CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["compose", *KUSTOMIZATIONS])
def test_every_container_command_is_accepted_by_the_cli(source):
    commands = container_commands(source)
    assert commands
    failures = []
    for command in commands:
        result = cli_help(*command.argv)
        if result.returncode != 0:
            failures.append(
                f"{command.where}: `tinker-atropos {shlex.join(command.argv)}` rejected:\n{result.stdout}"
                f"{result.stderr}"
            )
            continue
        # Every TA_* variable a container sets must be one the sub-command reads, or it is silently ignored:
        # an option's (in its --help) or one the package reads in every service (token, TLS, Redis password).
        unknown = [
            name
            for name in sorted(command.environment)
            if name.startswith("TA_")
            and not re.search(rf"\b{name}\b", result.stdout)
            and name not in package_variables()
        ]
        if unknown:
            failures.append(
                f"{command.where}: `tinker-atropos {command.argv[0]}` reads no {', '.join(unknown)}"
            )
    assert not failures, "\n".join(failures)
