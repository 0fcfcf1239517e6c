"""Which experience records a reader has taken, so that it takes none twice: a signature proves who wrote a
record, not that it is new (docs/security.md, "What protects each link"). One holder of the Redis password can copy
a signed record back into the stream; without this, an off-policy learner would learn it again as often as it is
copied.

Every record names its writer (``rollout_incarnation``, random per rollout start) and its number among that
writer's records (``sequence``: 1, 2, 3, ...). Per writer the reader keeps the highest number taken and, one bit
each, which of the ``WINDOW`` numbers below it were taken: the anti-replay window of IPsec (RFC 4303 §3.4.3). A
number in the window is taken once, so a rollout's sessions, which append concurrently, may reach the stream a few
records out of order; a number below the window is refused. Refusals are ``RecordError``s, counted by reason:

- ``replayed``: a number of that writer already taken;
- ``out_of_order``: below its writer's window, or from a writer the reader has forgotten (see below);
- ``before_restart``: acted by a policy older than the version a trainer resumed at past its last checkpoint
  (``restarted_at``): records it learned from after that checkpoint are in the weights it continued from, and
  this state, checkpointed, does not know them.

Memory is bounded: the ``MAX_WRITERS`` writers seen most recently are kept (a restarted rollout is a new writer).
Forgetting one raises a floor past the policy versions its records carried: a record of a writer the reader does
not know, acted by a version below that floor, is refused, since it could be a forgotten writer's. A new rollout
acts with the latest weights, above the floor of any writer long gone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from tinker_atropos.protocol.trajectory import RecordError

WINDOW = 4096  # sequence numbers per writer below its highest that are told apart (bits)
_ALL = (1 << WINDOW) - 1
MAX_WRITERS = 256  # rollout incarnations remembered


class Freshness:
    """The writers a reader has taken records from; ``state_dict`` is what a trainer checkpoints."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        # writer -> [highest sequence taken, window (bit k: highest - k taken), highest policy version seen]
        self._writers: OrderedDict[str, list[int]] = OrderedDict()
        self.floor = 0  # an unknown writer's records acted by a version below this are refused
        self.fence = 0  # every record acted by a version below this is refused (``restarted_at``)
        if state is not None:
            self._writers.update((name, list(entry)) for name, *entry in state["writers"])
            self.floor, self.fence = int(state["floor"]), int(state["fence"])

    def take(self, writer: str, sequence: int, policy_version: int) -> None:
        """Mark the record ``sequence`` of ``writer`` taken; RecordError (nothing marked) if it may not be."""
        if policy_version < self.fence:
            raise RecordError(
                "before_restart",
                f"a chunk of policy version {policy_version}, from before this "
                f"trainer resumed past its checkpoint at version {self.fence}",
            )
        entry = self._writers.get(writer)
        if entry is None:
            if policy_version < self.floor:
                raise RecordError(
                    "out_of_order",
                    f"a chunk of policy version {policy_version} from rollout "
                    f"{writer[:8]}, unknown, below the versions of the forgotten ones ({self.floor})",
                )
            entry = self._writers[writer] = [0, 0, policy_version]
            self._forget_the_oldest()
        else:
            self._writers.move_to_end(writer)
        highest, window, _ = entry
        if sequence > highest:
            ahead = sequence - highest
            entry[0] = sequence
            entry[1] = ((window << ahead) | 1) & _ALL if ahead < WINDOW else 1
        else:
            behind = highest - sequence
            if behind >= WINDOW:
                raise RecordError(
                    "out_of_order",
                    f"record {sequence} of rollout {writer[:8]}, {behind} behind "
                    f"its newest taken, past the {WINDOW} told apart",
                )
            if window >> behind & 1:
                raise RecordError("replayed", f"record {sequence} of rollout {writer[:8]} was taken before")
            entry[1] = window | 1 << behind
        entry[2] = max(entry[2], policy_version)

    def restarted_at(self, version: int) -> None:
        """A trainer continued at ``version`` from weights newer than its checkpoint: refuse what older versions
        acted."""
        self.fence = max(self.fence, version)

    def _forget_the_oldest(self) -> None:
        while len(self._writers) > MAX_WRITERS:
            _, (_, _, version) = self._writers.popitem(last=False)
            self.floor = max(self.floor, version + 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "writers": [[name, *entry] for name, entry in self._writers.items()],
            "floor": self.floor,
            "fence": self.fence,
        }
