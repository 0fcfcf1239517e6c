"""Every benchmark module imports: a product module moved or renamed breaks `make bench-tinker` or `make bench`
at its first line otherwise, found only when someone measures (a split of the Tinker worker did just that)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("module", sorted(p.stem for p in BENCH.glob("*.py")))
def test_the_benchmark_module_imports(module: str) -> None:
    importlib.import_module(f"bench.{module}")
