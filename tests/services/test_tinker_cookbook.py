"""The Tinker Cookbook's own training loops (tinker-cookbook, pinned), unmodified, against our Tinker API: its
supervised loop with evals, periodic and rolling checkpoints (saved with a TTL, the rolling ones deleted) and a
resume with the optimizer state, and its math recipe's RL loop, on the tiny byte-level LM and local data. Every
request the cookbook makes is answered: it logs no warning about our server (its ``logs.log`` is read), and the
SDK under it raises on any refused call."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis
import tinker
from tinker_cookbook import checkpoint_utils
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer

from tests.support.tinker_server import KEY, TinkerTrainer, serving
from tinker_atropos.models.tiny_lm import ByteTokenizer
from tinker_atropos.state.embedded import EmbeddedValkey

pytestmark = pytest.mark.integration

LM = "tiny-byte-lm"
RENDERER = "role_colon"  # the cookbook's generic chat format: "User: ...\n\nAssistant: ...", stop "\n\nUser:"
# what may be logged that says nothing of our server: the cookbook's pricing file is on the internet, and the SDK
# notes where the cookbook's RL loop calls its synchronous .result() inside a coroutine (rl/train.py)
NOT_OURS = ("Could not fetch model pricing", "tinker.lib.sync_only:")


@pytest.fixture(scope="module")
def trainer(valkey: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerTrainer]:
    with serving(
        tmp_path_factory.mktemp("tk-cookbook"), valkey.url, "tk-cookbook", long_poll_s=0.5
    ) as server:
        yield server


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The cookbook's loops put their own handlers on the root logger (its console and ``<log_path>/logs.log``,
    replacing pytest's): they go once the test ran, and the root level is put back."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def warnings_logged(log_path: Path) -> list[str]:
    """What the cookbook and the SDK under it logged at WARNING or above (every logger's records reach its
    ``logs.log``), but ``NOT_OURS``."""
    lines = (log_path / "logs.log").read_text().splitlines()
    return [
        line
        for line in lines
        if any(f"[{level}]" in line for level in ("WARNING", "ERROR", "CRITICAL"))
        and not any(text in line for text in NOT_OURS)
    ]


@pytest.fixture
def cookbook(
    trainer: TinkerTrainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_logging: None
) -> Path:
    """The cookbook pointed at the trainer: its API key in the environment, as a user sets it, and the tiny LM's
    tokenizer registered under the model's name (the cookbook's own hook for models not on the hub)."""
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    folder = ByteTokenizer().save_pretrained(tmp_path / "tokenizer")
    register_tokenizer(LM, lambda: AutoTokenizer.from_pretrained(folder))
    data = tmp_path / "sums.jsonl"
    with data.open("w") as file:
        for a in range(6):
            for b in range(4):
                conversation = [
                    {"role": "user", "content": f"{a}+{b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
                file.write(json.dumps({"messages": conversation}) + "\n")
    return data


def supervised(trainer: TinkerTrainer, data: Path, log_path: Path, epochs: int) -> train.Config:
    builder = FromConversationFileBuilder(
        file_path=str(data),
        test_size=4,
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=LM, renderer_name=RENDERER, max_length=64, batch_size=4
        ),
    )
    return train.Config(
        log_path=str(log_path),
        model_name=LM,
        recipe_name="tinker_atropos_test",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=3e-3,
        lora_rank=8,
        base_url=trainer.url,
        save_every=2,
        eval_every=2,
        rolling_save_every=1,
        ttl_seconds=3600,
        rolling_ttl_seconds=600,
        num_epochs=epochs,
    )


def test_the_cookbooks_supervised_loop_trains_checkpoints_and_resumes(
    trainer: TinkerTrainer, cookbook: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "sl"
    asyncio.run(train.main(supervised(trainer, cookbook, log_path, epochs=1)))
    first = checkpoint_utils.get_last_checkpoint(str(log_path))
    # a second epoch asked for: the loop resumes from the first run's last state, optimizer included
    asyncio.run(train.main(supervised(trainer, cookbook, log_path, epochs=2)))
    assert not warnings_logged(log_path), warnings_logged(log_path)

    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "train_mean_nll" in m]
    assert steps == list(range(10)), steps  # five batches, then five more after the resume
    # the held-out NLL, every 2 steps
    assert [m["step"] for m in metrics if "test/nll" in m] == [
        0,
        2,
        4,
        6,
        8,
    ]
    assert metrics[-1]["train_mean_nll"] < metrics[0]["train_mean_nll"]

    assert first is not None
    rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(first.state_path).result(timeout=30)
    assert run.user_metadata is not None and run.user_metadata.get("renderer_name") == RENDERER
    final = checkpoint_utils.get_last_checkpoint(str(log_path))
    assert final is not None and final.state_path != first.state_path
    resumed = rest.get_training_run_by_tinker_path(final.state_path).result(timeout=30)
    listed = rest.list_checkpoints(resumed.training_run_id).result(timeout=30).checkpoints
    assert final.state_path in {c.tinker_path for c in listed}
    # the rolling checkpoints the loop deleted are gone, files too; the periodic ones carry their TTL, the final
    # one none
    expiring = {c.checkpoint_id: c.expires_at is not None for c in listed}
    assert expiring == {
        f"{kind}/{name}": name != "final"
        for kind in ("weights", "sampler_weights")
        for name in ("000006", "000008", "final")
    }, expiring
    assert not list(trainer.directory.rglob("000009.*"))
    assert "Traceback" not in trainer.log(), trainer.log()[-3000:]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "stable_reinforce"])
def test_the_cookbooks_rl_loop_samples_with_its_stop_string_and_trains(
    trainer: TinkerTrainer, cookbook: Path, tmp_path: Path, loss_fn: str
) -> None:
    """The RL loop of the cookbook's math recipe on its arithmetic env: groups sampled with the renderer's stop
    string (a multi-byte one, which this server refused before), rewarded, trained with the loss, a checkpoint
    saved. importance_sampling synchronously; ppo asynchronously, sampling up to a step ahead; and the async loop
    as the cookbook configures it by default, whose loss is stable_reinforce (samples recorded, provenance on
    every datum)."""
    dataset = ArithmeticDatasetBuilder(
        batch_size=2,
        model_name_for_tokenizer=LM,
        renderer_name=RENDERER,
        n_batches=3,
        group_size=4,
        include_fewshot=False,
    )
    chosen = {} if loss_fn == "stable_reinforce" else {"loss_fn": loss_fn}  # the cookbook's default, unset
    async_config = rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2, **chosen)
    assert async_config.loss_fn == loss_fn or loss_fn == "importance_sampling"
    config = rl_train.Config(
        learning_rate=1e-3,
        dataset_builder=dataset,
        model_name=LM,
        recipe_name="tinker_atropos_test",
        max_tokens=12,
        log_path=str(tmp_path / "rl"),
        renderer_name=RENDERER,
        lora_rank=8,
        base_url=trainer.url,
        eval_every=0,
        save_every=2,
        **chosen,
        async_config=None if loss_fn == "importance_sampling" else async_config,
    )
    sequences_recorded = partial(
        redis.Redis.from_url(trainer.redis_url).keys, "ta:tk-cookbook:tinker:sequence:*"
    )
    before = set(sequences_recorded())
    asyncio.run(rl_train.main(config))
    assert not warnings_logged(tmp_path / "rl"), warnings_logged(tmp_path / "rl")
    metrics = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    # the log-probs our sampler returned are the ones our trainer computes for the same tokens
    kl = [m["optim/kl_sample_train_v1"] for m in metrics if "optim/kl_sample_train_v1" in m]
    assert len(kl) == 3 and all(abs(v) < 1e-4 for v in kl), kl
    assert [m["step"] for m in metrics if "env/all/reward/total" in m] == [0, 1, 2], metrics[-1]
    assert checkpoint_utils.get_last_checkpoint(str(tmp_path / "rl")) is not None
    # the sampler recorded its sequences only where the loss asked for them (3 steps of 2 groups of 4, at least)
    recorded = len(set(sequences_recorded()) - before)
    assert (recorded >= 24) == (loss_fn == "stable_reinforce"), recorded
    assert "Traceback" not in trainer.log(), trainer.log()[-3000:]
