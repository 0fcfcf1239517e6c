"""A toy Atropos environment for the tiny byte-level LM: a plain atroposlib ``BaseEnv`` subclass, offline.

Each item is a prompt asking for lowercase text; a completion of 8 tokens (bytes) scores the fraction of its bytes
that are lowercase ASCII letters. An untrained tiny LM samples bytes nearly uniformly (score about 0.1); a few
minutes of training through our services raise it past 0.6. It samples through atroposlib's ``ManagedServer``
(exact tokens and log-probs from SGLang's ``/generate``, which the trainer's inference endpoint serves), and its
tokenizer is the tiny LM's, written as a Hugging Face folder: nothing is downloaded.

    python examples/atropos_env.py serve --config runs/atropos-toy/atropos_env.yaml

(``configs/atropos-toy.yaml`` has ``up`` start it so beside the trajectory API and the trainer: that file, which
``up`` writes with mode 0600, holds both URLs and the run's keys, as atroposlib's ``--config`` reads them.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

from tinker_atropos.models.tiny_lm import ByteTokenizer

# atroposlib sets its env logger to DEBUG when imported, and its first logging.debug() call gives the root logger a
# handler: every request's debug lines (and the merged config, keys included) would reach the log
logging.getLogger("atroposlib.envs.base").setLevel(logging.INFO)

PROMPTS = ("write lowercase:", "say it small:", "letters please:", "lower:")
COMPLETION_TOKENS = 8


def tokenizer_folder() -> str:
    """The tiny LM's tokenizer as a Hugging Face folder, written once per user (atomically: envs start together)."""
    folder = Path(
        os.environ.get(
            "TA_TOKENIZER_DIR", Path(tempfile.gettempdir()) / f"tinker-atropos-bytes-{os.getuid()}"
        )
    )
    if not (folder / "tokenizer.json").exists():
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
        ByteTokenizer().save_pretrained(staging)
        with contextlib.suppress(OSError):  # another env wrote it first
            staging.rename(folder)
    return str(folder)


def lowercase_fraction(tokens: list[int]) -> float:
    return sum(ord("a") <= t <= ord("z") for t in tokens) / max(1, len(tokens))


def scored_group(nodes: list, score: Callable[[list[int]], float]) -> ScoredDataGroup:
    """The group atroposlib's API takes from ``ManagedServer``'s nodes: each sequence's tokens, its mask (-100 on
    the prompt), the sampler's log-probs, and ``score`` of its completion tokens."""
    group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
    for node in nodes:
        group["tokens"].append(node.tokens)
        group["masks"].append(node.masked_tokens)
        group["inference_logprobs"].append(node.logprobs)
        group["scores"].append(score([t for t in node.masked_tokens if t != -100]))
    return group


class LowercaseEnv(BaseEnv):
    name = "lowercase"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        tokenizer = tokenizer_folder()
        env = BaseEnvConfig(
            tokenizer_name=tokenizer,
            group_size=8,
            use_wandb=False,
            max_token_length=64,
            rollout_server_url="http://127.0.0.1:8000",
            total_steps=-1,
            batch_size=-1,
            steps_per_eval=10**9,
            wandb_name=cls.name,
            max_num_workers=8,
            ensure_scores_are_not_same=True,
        )
        server = APIServerConfig(
            model_name="tiny-byte-lm",
            base_url="http://127.0.0.1:8001/v1",
            api_key="none",
            server_type="sglang",
            tokenizer_name=tokenizer,
            timeout=60,
            health_check=False,
        )
        return env, [server]

    async def setup(self) -> None:
        self.rng = random.Random(0)

    async def get_next_item(self) -> str:
        return self.rng.choice(PROMPTS)

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup | None, list]:
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=item, n=self.config.group_size, max_tokens=COMPLETION_TOKENS, temperature=1.0
            )
            nodes = managed.get_state()["nodes"]
        return scored_group(nodes, lowercase_fraction), []

    async def evaluate(self, *args, **kwargs) -> None:
        """No held-out evaluation: the training scores are the curve."""


if __name__ == "__main__":
    LowercaseEnv.cli()
