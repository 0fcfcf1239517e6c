"""What the Atropos tests send: a trainer's registration and scored groups whose content is unique to a seed, and
the key our API asks of a run whose token is ``TOKEN``."""

from __future__ import annotations

from typing import Any

from tinker_atropos.frontends.http import run_key

TOKEN = "atropos-test-token"  # the run's token our API services get (TA_TOKEN): the key is derived from it
KEY = run_key("atropos-api", TOKEN)
HEADERS = {"X-API-Key": KEY}


def registration(batch_size: int, max_token_len: int = 64) -> dict[str, Any]:
    """A trainer's /register body."""
    return {"wandb_group": "g", "wandb_project": "p", "batch_size": batch_size, "max_token_len": max_token_len,
            "checkpoint_dir": "", "save_checkpoint_interval": 0, "starting_step": 0, "num_steps": 10}  # fmt: skip


def env_registration(group_size: int, name: str = "toy", **extra: Any) -> dict[str, Any]:
    """An environment's /register-env body."""
    return {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": group_size, **extra}


def scored_group(env_id: int | None, size: int, seed: int, **extra: Any) -> dict[str, Any]:
    """A scored group of ``size`` sequences; its first token is ``seed``, so served batches can be counted."""
    tokens = [[seed, k, *range(k + 3)] for k in range(size)]
    return {"tokens": tokens, "masks": [[-100] + t[1:] for t in tokens],
            "scores": [float((seed + k) % 3) for k in range(size)], "env_id": env_id, **extra}  # fmt: skip
