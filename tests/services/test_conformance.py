"""The env conformance kit: our env service passes every clause (Box and Discrete actions, truncated and
terminated episodes), a third party's written from the .proto passes too, and a service broken in one way fails
on the row of that clause and no other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.processes import Processes, wait_for
from tests.support.running import cli, config_file
from tests.support.toy_env_server import serve
from tinker_atropos.environment.conformance import Conformance
from tinker_atropos.state.registry import live_services

CHECKS = {name for name, _ in Conformance.CLAUSES}


@pytest.mark.parametrize(
    ("defect", "failing"),
    [
        ("none", set()),
        ("episode_length", {"episodes"}),
        ("no_autoreset", {"episodes"}),
        ("accepts_bad_actions", {"bad_actions"}),
    ],
)
def test_a_third_party_service_passes_or_fails_on_the_clause_it_breaks(
    defect: str, failing: set[str]
) -> None:
    server, address = serve(defect)
    checker = Conformance(address, max_steps=50)
    try:
        rows = checker.run()
    finally:
        checker.close()
        server.stop(0).wait()
    assert [row.name for row in rows] == [name for name, _ in Conformance.CLAUSES]
    assert {row.name for row in rows if not row.passed} == failing, [r for r in rows if not r.passed]
    details = {row.name: row.detail for row in rows}
    if defect == "episode_length":
        assert "reported length 6, stepped 5" in details["episodes"]
    if defect == "no_autoreset":
        assert "no reset in the same step" in details["episodes"]
    if defect == "accepts_bad_actions":
        assert details["bad_actions"].startswith("a batch of the wrong size: accepted, not INVALID_ARGUMENT")


@pytest.mark.integration
@pytest.mark.parametrize("env_id", ["Pendulum-v1", "CartPole-v1"])
def test_our_env_service_keeps_the_contract(
    tmp_path: Path, valkey, redis_client, processes: Processes, env_id: str
) -> None:
    config = config_file(tmp_path, run={"name": "conformance"}, env={"id": env_id, "instances": 3})
    processes.start("env", "--config", str(config), "--redis-url", valkey.url, "--port", "0", name="env")
    [service] = wait_for(lambda: live_services(redis_client, "conformance", "env"), 60, "the env service")
    shown = cli("conformance", service.address, "--json", "--max-steps", "600")
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    assert shown.returncode == 0 and all(row["passed"] for row in rows), rows
    assert {row["check"] for row in rows} == CHECKS
    table = cli("conformance", service.address)
    assert table.returncode == 0 and table.stdout.count("pass") == len(CHECKS) and "FAIL" not in table.stdout


def test_an_address_where_nothing_answers_is_one_line() -> None:
    shown = cli("conformance", "127.0.0.1:1")
    assert shown.returncode == 2 and shown.stdout == "", shown.stdout
    assert shown.stderr.startswith("error: no env service answers at 127.0.0.1:1: UNAVAILABLE: ")
    assert len(shown.stderr.strip().splitlines()) == 1
