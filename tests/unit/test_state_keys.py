"""The front-ends' own keys are spelled by ``state.keys`` (their prefixes and ``under``), so they stay inside the
run's namespace that ``run_pattern`` (``up --fresh``, the ACL users) covers, and nothing else spells the layout."""

from __future__ import annotations

import fnmatch
import re

from tests.support.running import REPO
from tinker_atropos.state import keys


def test_the_front_ends_keys_are_the_runs() -> None:
    for prefix in (keys.atropos("r1"), keys.tinker("r1")):
        key = keys.under(prefix, "queue", "7")
        assert key == f"{prefix}:queue:7"
        assert fnmatch.fnmatchcase(key, keys.run_pattern("r1"))
        assert not fnmatch.fnmatchcase(key, keys.run_pattern("r2"))
    assert keys.atropos("r1") == "ta:r1:atropos" and keys.under(keys.atropos("r1"), "*") == "ta:r1:atropos:*"


def test_only_state_keys_spells_the_key_layout() -> None:
    """No module but state/keys.py writes a run's key prefix (``f"ta:{run}…"``) or joins key parts by hand."""
    spelled = re.compile(r"""f?["']ta:[{*]|":"\.join\(""")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "tinker_atropos").rglob("*.py"))
        if path != REPO / "tinker_atropos" / "state" / "keys.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line.split("#")[0])
    ]
    assert not found, f"key layout spelled outside state/keys.py: {found}"
