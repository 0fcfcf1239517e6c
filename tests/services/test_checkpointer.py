"""One checkpointer for every driver that checkpoints (``trainer/checkpointing.py``): the experience loop and the
Atropos loop on the same cadence (``trainer.checkpoint.every_updates``) and retention (``keep``), the Atropos loop's
``state.pt`` of earlier versions still resumed from, and a trainer whose run folder another `up` took over writes
nothing there and stops."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from tests.support.atropos import join_as_env, reference_api, start_atropos_trainer, tiny_lm_group
from tests.support.loops import started_loop
from tests.support.processes import Processes, wait_for
from tests.support.records import serialized_chunk
from tinker_atropos.config import Config, parse_config
from tinker_atropos.models import tiny_lm
from tinker_atropos.processes import free_port
from tinker_atropos.state.checkpoint_files import save_torch
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.run_dir import LOCK_NAME, OWNER_VARIABLE, Holder
from tinker_atropos.trainer.atropos_loop import EARLIER_STATE, AtroposLoop
from tinker_atropos.trainer.checkpointing import Checkpointer

TOKENIZER = tiny_lm.ByteTokenizer()
CADENCE = {"every_updates": 2, "every_seconds": 3600, "keep": 2}


def versions(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in folder.glob("checkpoint-*.pt"))


def preference_group(seed: int) -> dict[str, Any]:
    """Four replies to one prompt, 'a' scored above 'b'."""
    prompt, replies = TOKENIZER.encode(f"pick {seed}:", add_bos=True), TOKENIZER.encode("abab")
    return {
        "tokens": [prompt + [r] for r in replies],
        "masks": [[-100] * len(prompt) + [r] for r in replies],
        "scores": [1.0 if r == replies[0] else 0.0 for r in replies],
    }


def atropos_config(run: str) -> Config:
    """Run ``run``'s trainer running the Atropos loop alone, checkpointed on ``CADENCE``."""
    trainer = {"experience_loop": False, "checkpoint": CADENCE, "atropos": {"enabled": True, "batch_size": 4}}
    return parse_config({"run": {"name": run}, "trainer": trainer})


def atropos_loop(config: Config, client: redis.Redis, run_dir: Path) -> tuple[AtroposLoop, Checkpointer]:
    loop = AtroposLoop(config, client, run_dir, torch.device("cpu"))
    checkpointer = Checkpointer(loop, loop.folder, config.trainer.checkpoint, None, earlier=EARLIER_STATE)
    checkpointer.resume()
    return loop, checkpointer


@pytest.mark.parametrize("driver", ["experience", "atropos"])
def test_one_checkpointer_drives_either_loop_every_n_updates_and_keeps_the_newest(
    tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    monkeypatch.setenv("TA_TOKEN", "the-run-token")  # the Atropos loop's inference endpoint derives its key
    if driver == "experience":  # a chunk of 2 x 8 steps is one update
        config = parse_config(
            {"run": {"name": "cadence"}, "trainer": {"samples_per_update": 16, "checkpoint": CADENCE}}
        )
        loop, checkpointer = started_loop(config, redis_client, tmp_path)
        step = lambda seed: loop.step([serialized_chunk(2, seed, version=loop.version)])  # noqa: E731
    else:
        config = atropos_config("cadence")
        loop, checkpointer = atropos_loop(config, redis_client, tmp_path)
        step = lambda seed: loop.learn([preference_group(seed)])  # noqa: E731
    written = []
    for seed in range(1, 7):
        step(seed)
        written.append(checkpointer.save())  # as the trainer service asks, ten times a second
    assert loop.progress() == 6 and written == [False, True, False, True, False, True]
    assert versions(checkpointer.folder) == [4, 6]  # every 2 updates, the newest 2 kept
    assert not (tmp_path / "atropos" / EARLIER_STATE).exists()


def test_the_state_pt_of_an_earlier_atropos_loop_still_resumes_and_numbered_checkpoints_follow(
    tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TA_TOKEN", "the-run-token")
    config = atropos_config("earlier")
    earlier = AtroposLoop(config, redis_client, tmp_path, torch.device("cpu"))
    for seed in (1, 2, 3):
        earlier.learn([preference_group(seed)])
    # what the loop wrote before the checkpointer: one file, {"core", "step", "counters"}
    state = {"core": earlier.model.core.state_dict(), "step": earlier.step, "counters": earlier.counters}
    save_torch(tmp_path / "atropos" / EARLIER_STATE, state)

    resumed, checkpointer = atropos_loop(config, redis_client, tmp_path)
    assert (resumed.step, resumed.sampler.version, resumed.counters) == (3, 3, earlier.counters)
    assert resumed.progress() == 0
    for seed in (4, 5):
        resumed.learn([preference_group(seed)])
    assert checkpointer.save() and versions(tmp_path / "atropos") == [5]
    again, _ = atropos_loop(config, redis_client, tmp_path)  # the numbered checkpoint, newer than state.pt
    assert (again.step, again.model.core.version) == (5, 5)


@pytest.mark.integration
def test_an_atropos_trainer_whose_run_folder_another_up_took_over_writes_nothing_there_and_stops(
    tmp_path: Path, valkey, redis_client: redis.Redis, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer started by an `up` (``TA_RUN_LOCK``), learning from atroposlib's run-api, a checkpoint per update
    of which it keeps 2; then another `up` holds the folder: the next checkpoint is refused, none at stop either,
    and the trainer exits 2 saying why."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = Holder("the-up-that-started-it", "up", 1, "host", "2025-01-01T00:00:00+0000", "owner")
    (run_dir / LOCK_NAME).write_text(json.dumps(asdict(holder)))
    monkeypatch.setenv(OWNER_VARIABLE, holder.id)
    monkeypatch.setenv("TA_TOKEN", "the-run-token")
    with reference_api(tmp_path / "reference.log") as api_url:
        atropos = {"api_url": api_url, "batch_size": 4, "max_token_len": 64, "inference_port": free_port()}
        checkpoint = {"every_updates": 1, "keep": 2}
        trainer = start_atropos_trainer(
            processes, valkey.url, run_dir, "owner", trainer={"checkpoint": checkpoint}, **atropos
        )
        api = httpx.Client(base_url=api_url, timeout=30)
        join_as_env(api, processes, trainer, batch_size=4, name="owner")
        folder = run_dir / "atropos"
        for seed in (1, 2, 3):  # one update each, and its checkpoint
            api.post("/scored_data", json=tiny_lm_group(seed)).raise_for_status()
            wait_for(lambda s=seed: versions(folder)[-1:] == [s], 60, f"the checkpoint of update {seed}")
        assert versions(folder) == [2, 3]  # trainer.checkpoint.keep

        taken_over = Holder("another-up", "up", 2, "host", "2025-01-02T00:00:00+0000", "owner")
        (run_dir / LOCK_NAME).write_text(json.dumps(asdict(taken_over)))
        api.post("/scored_data", json=tiny_lm_group(4)).raise_for_status()
        wait_for(
            lambda: live_services(redis_client, "owner", "trainer") == [] or trainer.poll() is not None,
            60,
            "stop",
        )
        assert trainer.wait(timeout=60) == 2, processes.log("trainer")[-3000:]
    log = processes.log("trainer")
    assert "belongs to `up` (pid 2 on host)" in log and "not writing there" in log, log[-3000:]
    assert "no final checkpoint" in log, log[-3000:]
    assert versions(folder) == [2, 3] and not (folder / EARLIER_STATE).exists()
