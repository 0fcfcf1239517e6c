"""The trainer's batch is counted in env steps, not chunks: the same config learns alike whatever the size of
each env service, and a rollout pauses on the same count."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from tests.support.envs import pendulum_env
from tests.support.records import serialized_chunk
from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.rollout.assignment import units_of
from tinker_atropos.rollout.collector import Collector, SessionContext
from tinker_atropos.state.experience import ExperienceWriter, queued_chunks
from tinker_atropos.trainer.experience_loop import ExperienceLoop

LENGTH = 8  # steps of serialized_chunk's records


def test_an_update_takes_whole_chunks_until_it_holds_samples_per_update(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """40 samples per update from chunks of 2 x 8 = 16 steps: 3 chunks (48 steps) per update."""
    config = parse_config({"run": {"name": "batch"}, "trainer": {"samples_per_update": 40}})
    writer = ExperienceWriter(redis_client, "batch", max_queued_chunks=64)
    for seed in range(7):
        writer.append(serialized_chunk(2, seed), env_steps=2 * LENGTH)
    trainer = ExperienceLoop(config, redis_client, tmp_path)
    trainer.setup(pendulum_env())
    stop = threading.Event()
    thread = threading.Thread(target=trainer.train, args=(stop,))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while trainer.updates < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a third update would need two more chunks than are left
    finally:
        stop.set()
        thread.join(timeout=30)

    assert trainer.updates == 2 and trainer.env_steps_trained == 2 * 48
    assert trainer.batcher.chunks_consumed == 7, "6 for the updates, and the 7th read towards the next one"
    assert queued_chunks(redis_client, "batch") == 0


class CountingWriter:
    def __init__(self, queued_after: list[int]) -> None:
        self.polls = queued_after

    def queued(self) -> int:
        return self.polls.pop(0)


@pytest.mark.parametrize(("chunk_size", "polls"), [(256, 0), (512, 1)])
def test_a_pausing_session_waits_while_a_batch_of_samples_is_queued(chunk_size: int, polls: int) -> None:
    """4,096 samples per update and 8 chunks queued: chunks of 4 x 64 make half a batch, so the session goes
    on; chunks of 8 x 64 make a whole one, so it waits until the trainer has taken some (7 left)."""
    writer = CountingWriter([7])
    unit = units_of("e", "env-0", "a", "", 8, 1)[0]
    context = SessionContext(None, writer, "r", None, lambda _: True, pause_at_samples=4096)  # type: ignore[arg-type]
    session = Collector(unit, 0, parse_config({"rollout": {"chunk_length": 64}}).rollout, context)

    session.wait_for_trainer(queued=8, chunk_size=chunk_size)

    assert len(writer.polls) == 1 - polls


def test_the_old_chunk_count_setting_is_refused_with_what_replaced_it() -> None:
    with pytest.raises(ConfigError, match="samples_per_update"):
        parse_config({"trainer": {"chunks_per_update": 4}})
