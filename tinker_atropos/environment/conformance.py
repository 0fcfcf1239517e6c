"""``tinker-atropos conformance ADDR``: does the server at ADDR keep the environment contract
(``protocol/v1/environment.proto``)? For ours, or a third party's in any language, before a rollout depends on it.

Each row is one clause of the contract, checked over gRPC with sessions of its own (the service must have free
instances): Describe, opening a session and its seeded reset, a batched step's shapes and types, the autoreset
rule, the episode reports (``session_clauses.py``); the statuses of bad requests (which must end only their own
stream), capacity, and instances freed on close (``refusal_clauses.py``). A row that fails says what was expected
and what came.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tinker_atropos.environment.probe import Probe, Violation
from tinker_atropos.environment.refusal_clauses import RefusalClauses
from tinker_atropos.environment.session_clauses import SessionClauses


@dataclass(frozen=True)
class Row:
    name: str  # the check: describe, open, seeded_reset, step, episodes, bad_actions, …
    clause: str
    passed: bool
    detail: str


class Conformance:
    """The checks, in order, over one connection to the server; ``run`` gives one row each."""

    CLAUSES: tuple[tuple[str, str], ...] = SessionClauses.CLAUSES + RefusalClauses.CLAUSES

    def __init__(
        self, address: str, seed: int = 0, max_steps: int = 5000, free_timeout_s: float = 5.0
    ) -> None:
        self.probe = Probe(address, seed, max_steps, free_timeout_s)
        self.client = self.probe.client
        parts = (SessionClauses(self.probe), RefusalClauses(self.probe))
        self.checks: dict[str, Callable[[], str]] = {
            name: getattr(part, f"check_{name}") for part in parts for name, _ in part.CLAUSES
        }

    def close(self) -> None:
        self.probe.close()

    def run(self) -> list[Row]:
        rows = []
        for name, clause in self.CLAUSES:
            try:
                rows.append(Row(name, clause, True, self.checks[name]()))
            except Violation as error:
                rows.append(Row(name, clause, False, str(error)))
            except grpc.RpcError as error:
                rows.append(Row(name, clause, False, f"unexpected {error.code().name}: {error.details()}"))
            except Exception as error:  # a reply that does not decode, a space we cannot read
                rows.append(Row(name, clause, False, f"{type(error).__name__}: {error}"))
        return rows
