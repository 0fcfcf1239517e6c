"""Tests that start real servers or service processes (a Valkey server, the services as OS processes, a gRPC server
in the test process): each is marked ``integration`` by its folder, so ``-m 'not integration'`` is the unit run."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)
