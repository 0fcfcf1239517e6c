"""Reinforcement learning of a language model against TRL (``make bench-llm-rl``): the same task, model
and budget for each system, one after the other on this machine, the order alternating between rounds.

Task: a sum (``examples/atropos_arithmetic_env.py``: its prompts, drawn with seed 0, in SmolLM2's chat template,
and its reward, 1 when the last integer of the answer is the sum), of two single digits (``single-digit``, the
untrained model right about one time in six) or of a two-digit and a one-digit number (``two-digit-plus-one``, right
about one time in fifteen: carries to learn). Model: SmolLM2-135M-Instruct in float32 with LoRA of rank 16 (alpha
32) on every attention and MLP projection (TRL refuses one on the output layer; the Tinker Cookbook's loop asks for
the SDK's default LoRA, which adapts it too, and runs unmodified: the one setting that differs). Every system takes steps of 4 prompts x 8 answers
of at most 12 tokens, sampled at temperature 1, group-relative advantages (reward - the group's mean, no division by
its deviation), the clipped PPO ratio (0.8 to 1.2), no KL term, Adam at 1e-3 (betas 0.9 and 0.95, eps 1e-8) without
gradient clipping (the Tinker Cookbook's loop sets its Adam parameters itself, with no clipping, and it runs
unmodified), on-policy (one update per batch). ``SETTINGS`` holds them; each result file states them, and each
system's own settings as it ran:

- ``trl``: TRL's ``GRPOTrainer`` (the peer), generation by transformers' ``generate``, PEFT's LoRA; its
  defaults of gradient checkpointing and bf16 mixed precision turned off, to train as the others do;
- ``cookbook``: the Tinker Cookbook's RL loop (``tinker_cookbook.rl.train``, unmodified, synchronous) through our
  Tinker API, a trainer serving SmolLM2;
- ``atropos``: ``tinker-atropos up configs/atropos-smollm2-arithmetic.yaml`` (the atroposlib environment, our
  trajectory API, our trainer and its inference endpoint), as shipped: its settings are checked against these.

Each writes, over wall-clock time from its first sampling's start (model loading left out for every system), the
mean reward of its latest 64 answers, sampled and trained tokens, and each step's time split into generation,
log-probs, training and weight sync where the system separates them. ``python -m bench llm-rl`` runs them and
draws the chart.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from examples.atropos_arithmetic_env import COMPLETION_TOKENS, GROUP_SIZE, TASKS, chat, problems, reward
from tinker_atropos.models import smollm2

GROUPS = 4  # prompts a step
RANK, LEARNING_RATE, CLIP = 16, 1e-3, 0.2
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8  # the Tinker Cookbook loop's own
GRAD_CLIP = 0.0  # none: the Tinker Cookbook loop's (its Adam parameters carry no clip)
SETTINGS = {
    "precision": "float32",
    "lora": f"rank {RANK}, alpha 32, every attention and MLP projection",
    # TRL refuses an adapter on the output layer; the cookbook's loop asks the SDK's default LoRA, which adapts it
    # (an unmodified loop cannot say otherwise): its adapter has the output layer's too
    "lora_unembed": {"trl": False, "atropos": False, "cookbook": True},
    "adam": {"learning_rate": LEARNING_RATE, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": 0.0},
    "grad_clip_norm": GRAD_CLIP,
    "ppo_clip": CLIP,
    "kl": 0.0,
    "batch": f"{GROUPS} prompts x {GROUP_SIZE} answers of <= {COMPLETION_TOKENS} tokens, temperature 1",
    "clock": "from the first sampling's start, model loading left out",
}
WINDOW = 64  # answers in the reported mean reward
FINAL_S = 120.0  # the final reward: the mean of the last two minutes
SYSTEMS = ("trl", "cookbook", "atropos")
REPO = Path(__file__).resolve().parents[1]


class Curve:
    """Points of (seconds since the first step started, mean reward of the latest 64 answers, sampled tokens,
    trained tokens), and each step's time split."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.rewards: deque[float] = deque(maxlen=WINDOW)
        self.sampled = self.trained = 0
        self.points: list[dict[str, float]] = []
        self.steps: list[dict[str, float]] = []

    def add(self, rewards: list[float], sampled: int, trained: int, split: dict[str, float]) -> None:
        self.rewards.extend(rewards)
        self.sampled, self.trained = self.sampled + sampled, self.trained + trained
        self.points.append(
            {
                "seconds": time.monotonic() - self.start,
                "reward": float(np.mean(self.rewards)),
                "sampled_tokens": self.sampled,
                "trained_tokens": self.trained,
            }
        )
        self.steps.append(split)

    def result(self, **about: Any) -> dict[str, Any]:
        return {"points": self.points, "steps": self.steps, **about}


# TRL ----------------------------------------------------------------------------------------------------------
def run_trl(seconds: float, work: Path, task: str, steps: int = 100_000) -> dict[str, Any]:
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    smollm2.load()  # the GGUF file converted once into the cache (a transformers folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2.cache_dir(), dtype="float32")
    tokenizer = smollm2.tokenizer()
    items = problems(seed=0, count=100_000, task=task)
    dataset = Dataset.from_list([{"prompt": chat(a, b), "a": a, "b": b} for a, b in items])

    def arithmetic(completions: list, a: list[int], b: list[int], **_: Any) -> list[float]:
        return [reward(c[0]["content"], x, y) for c, x, y in zip(completions, a, b, strict=True)]

    curve = Curve()
    timing: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(part: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            timing[part] = time.monotonic() - started

    class Timed(trl.GRPOTrainer):
        def _generate(self, prompts: list) -> Any:
            with timed("generation"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            with timed("scored"):  # generation, rewards and (when asked) old log-probs
                return super()._generate_and_score_completions(inputs)

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            timing["step_started"] = time.monotonic()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **_: Any) -> None:
            if not logs or "reward" not in logs:
                return
            step = time.monotonic() - timing["step_started"]
            tokens = int(round(logs["completions/mean_length"] * GROUPS * GROUP_SIZE))
            correct = int(round(logs["reward"] * GROUPS * GROUP_SIZE))  # 0/1 rewards: the batch's count
            split = {
                "generation": timing["generation"],
                "logprobs": timing["scored"] - timing["generation"],
                "training": step - timing["scored"],
                "weight_sync": 0.0,
                "step": step,
            }
            curve.add([1.0] * correct + [0.0] * (GROUPS * GROUP_SIZE - correct), tokens, tokens, split)
            if curve.points[-1]["seconds"] >= seconds:
                control.should_training_stop = True

    config = trl.GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=GROUPS * GROUP_SIZE,
        num_generations=GROUP_SIZE,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=COMPLETION_TOKENS,
        temperature=1.0,
        beta=0.0,
        epsilon=CLIP,
        loss_type="dapo",
        scale_rewards="none",
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=BETA1,
        adam_beta2=BETA2,
        adam_epsilon=EPS,
        max_grad_norm=GRAD_CLIP,  # 0: the Trainer clips nothing
        # its defaults (GRPOConfig's own): checkpointing trades compute for memory, bf16 mixed precision changes
        # the numbers; the other systems run neither
        gradient_checkpointing=False,
        bf16=False,
        max_steps=steps,
        shuffle_dataset=False,
        seed=0,
        disable_tqdm=True,
    )
    # every attention and MLP projection ("all-linear" is these; TRL refuses an adapter on lm_head)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    trainer = Timed(
        model=model,
        reward_funcs=arithmetic,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Record()],
    )
    curve.start = time.monotonic()
    trainer.train()
    about = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "config": {k: v for k, v in config.to_dict().items() if k in TRL_SHOWN},
        "lora_targets": targets,
    }
    return curve.result(**about)


TRL_SHOWN = (
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "temperature",
    "beta",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "num_iterations",
    "steps_per_generation",
)


# the Tinker Cookbook through our Tinker API --------------------------------------------------------------------
def run_cookbook(seconds: float, work: Path, task: str, steps: int = 100_000) -> dict[str, Any]:
    import chz
    import tinker
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.rl import types as rl
    from tinker_cookbook.tokenizer_utils import register_tokenizer

    from bench.tinker_server import serving

    tokenizer = smollm2.tokenizer()
    register_tokenizer(smollm2.NAME, smollm2.tokenizer)

    class Addition(rl.Env):
        def __init__(self, a: int, b: int) -> None:
            self.a, self.b = a, b

        async def initial_observation(self) -> tuple[tinker.ModelInput, list[int]]:
            prompt = tokenizer.apply_chat_template(
                chat(self.a, self.b), tokenize=False, add_generation_prompt=True
            )
            return tinker.ModelInput.from_ints(tokenizer.encode(prompt)), [int(tokenizer.eos_token_id)]

        async def step(self, action: list[int], *, extra: Any = None) -> rl.StepResult:
            text = tokenizer.decode(action, skip_special_tokens=True)
            return rl.StepResult(
                reward=reward(text, self.a, self.b),
                episode_done=True,
                next_observation=tinker.ModelInput.from_ints([]),
                next_stop_condition=[],
            )

    class Group(rl.EnvGroupBuilder):
        def __init__(self, a: int, b: int) -> None:
            self.a, self.b = a, b

        async def make_envs(self) -> list[rl.Env]:
            return [Addition(self.a, self.b) for _ in range(GROUP_SIZE)]

    items = problems(seed=0, count=100_000, task=task)

    class Problems(rl.RLDataset):
        def get_batch(self, index: int) -> list[rl.EnvGroupBuilder]:
            return [Group(*item) for item in items[index * GROUPS : (index + 1) * GROUPS]]

        def __len__(self) -> int:
            return min(steps, len(items) // GROUPS)

    @chz.chz
    class Builder(rl.RLDatasetBuilder):
        async def __call__(self) -> tuple[rl.RLDataset, None]:
            return Problems(), None

    key = "tml-bench-llm-rl-0123456789abcdef"
    # every core for its torch, as the Atropos config has it (the trainer's default, one, leaves a core to envs)
    with serving(work / "server", key=key, trainer={"torch_threads": None}) as served:
        os.environ["TINKER_API_KEY"] = key
        config = rl_train.Config(
            learning_rate=LEARNING_RATE,
            dataset_builder=Builder(),
            model_name=smollm2.NAME,
            recipe_name="bench_llm_rl",
            max_tokens=COMPLETION_TOKENS,
            temperature=1.0,
            log_path=str(work / "cookbook"),
            base_url=served.url,
            lora_rank=RANK,
            eval_every=0,
            save_every=0,
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 1 - CLIP, "clip_high_threshold": 1 + CLIP},
        )
        # its budget and the model's loading (a minute at most); the steps past the budget are cut below
        with contextlib.suppress(TimeoutError):
            asyncio.run(asyncio.wait_for(rl_train.main(config), seconds + 60))
    import tinker_cookbook

    rows = [json.loads(x) for x in (work / "cookbook" / "metrics.jsonl").read_text().splitlines()]
    curve = _cookbook_curve(rows)
    kept = [i for i, p in enumerate(curve["points"]) if p["seconds"] <= seconds + 30]
    curve["points"], curve["steps"] = [curve["points"][i] for i in kept], [curve["steps"][i] for i in kept]
    return curve | {"tinker_cookbook": tinker_cookbook.__version__}


def _cookbook_curve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cookbook's metrics.jsonl as a curve: its per-step reward and token counts, its timings."""
    curve = Curve()
    for row in rows:
        if "env/all/reward/total" not in row:
            continue
        answers = row["env/all/total_episodes"]
        correct = int(round(row["env/all/reward/total"] * answers))
        tokens = row[
            "tokens/sampled"
        ]  # every answer is trained on (those of a group scored alike with advantage 0)
        times = {k.removeprefix("time/"): v for k, v in row.items() if k.startswith("time/")}
        # its sampler's log-probs are the trainer's (no pass of their own); the weights are synced when the loop
        # saves the adapter for sampling and opens a sampling client on it
        split = {
            "generation": times.get("sampling", 0.0),
            "logprobs": 0.0,
            "training": times.get("train_step", 0.0),
            "weight_sync": times.get("save_checkpoint_and_get_sampling_client", 0.0),
            "step": times.get("total", 0.0),
            "all": times,
        }
        curve.add([1.0] * correct + [0.0] * (answers - correct), tokens, tokens, split)
        # the loop's steps follow one another: its clock is the sum of their times (the model's loading before)
        curve.points[-1]["seconds"] = sum(s["step"] for s in curve.steps)
    return curve.result()


# the Atropos path ---------------------------------------------------------------------------------------------
def run_atropos(seconds: float, work: Path, task: str) -> dict[str, Any]:
    from tinker_atropos.processes import free_port

    config = yaml.safe_load((REPO / "configs" / "atropos-smollm2-arithmetic.yaml").read_text())
    _check_shipped(config["trainer"]["atropos"])
    config["atropos"]["environments"][0] += ["--env.task", task]
    config["atropos"]["port"] = free_port()
    config["trainer"]["atropos"]["inference_port"] = free_port()
    config["run"]["report_interval_s"] = 5.0
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    run_dir = work / "run"
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinker_atropos",
            "up",
            str(work / "run.yaml"),
            "--run-dir",
            str(run_dir),
            "--max-seconds",
            str(int(seconds) + 60),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if up.returncode != 0:
        raise RuntimeError(f"up failed:\n{up.stdout[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    registered = _registered_at((run_dir / "logs" / "trainer.log").read_text())
    return _atropos_curve([r for r in rows if "event" not in r], registered) | {
        "config": config["trainer"]["atropos"]
    }


def _check_shipped(section: dict[str, Any]) -> None:
    """The shipped config's settings are the benchmark's: what it measures is what a user runs."""
    expected = {
        "lora_rank": RANK,
        "learning_rate": LEARNING_RATE,
        "adam_beta1": BETA1,
        "adam_beta2": BETA2,
        "grad_clip_norm": GRAD_CLIP,
        "lora_train_unembed": False,
        "batch_size": GROUPS * GROUP_SIZE,
        "loss": "ppo",
    }
    differ = {k: (section.get(k), v) for k, v in expected.items() if section.get(k) != v}
    if differ:
        raise RuntimeError(f"configs/atropos-smollm2-arithmetic.yaml differs from the benchmark's: {differ}")


REGISTERED = (
    "from the trajectory API at"  # the trainer's line once registered: the environment starts sampling
)


def _registered_at(log: str) -> float:
    """The unix time of the trainer's registration with the trajectory API, from its log line's timestamp."""
    line = next(line for line in log.splitlines() if REGISTERED in line)
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.astimezone().timestamp()


def _atropos_curve(rows: list[dict[str, Any]], registered: float) -> dict[str, Any]:
    """up's report rows as a curve, timed from the trainer's registration, when the environment starts sampling
    its first batch (the services' start-up and the model's loading before it are not counted, as TRL's and the
    cookbook's model loading is not)."""
    trained = [
        r for r in rows if r["policy_version"] >= 1 and r["losses"]
    ]  # the last row: read once all stopped
    first = trained[0]
    zero = first["wall_time_s"] - (first["time"] - registered)
    points, steps = [], []
    for row in trained:
        figures = row["losses"]
        share = figures["sequences_trained"] / max(1, row["episodes"])
        points.append(
            {
                "seconds": row["wall_time_s"] - zero,
                "reward": row["episode_return_mean"],
                "sampled_tokens": row["env_steps"],
                "trained_tokens": int(row["env_steps"] * share),
            }
        )
        sync = figures.get("weight_sync_seconds", 0.0)
        new_step = not steps or steps[-1]["version"] != row["policy_version"]  # a report row per 5 s
        # a batch whose groups all scored alike teaches nothing: its time is not a step's (the sync shown is the
        # step's before)
        if new_step and figures["step_seconds"] > sync:
            steps.append(
                {
                    "training": figures["step_seconds"] - sync,
                    "weight_sync": sync,
                    "version": row["policy_version"],
                }
            )
    return {"points": points, "steps": steps, "note": "generation runs beside training (its own process)"}


RUNS = {"trl": run_trl, "cookbook": run_cookbook, "atropos": run_atropos}


def run(out: Path, minutes: dict[str, float], task: str, rounds: int = 1) -> dict[str, Any]:
    """Each system of ``minutes`` for its budget on ``task``, in a process of its own, one after the other (the
    order reversed each round); ``bench-llm-rl-TASK.json`` and its chart written to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    order = [s for s in SYSTEMS if s in minutes]
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in order}
    for round_ in range(rounds):
        for system in order if round_ % 2 == 0 else order[::-1]:
            work = out / "llm-rl" / task / f"{system}-{round_}"
            print(f"{system}: {minutes[system]:g} min ...", flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "bench.llm_rl", system, str(minutes[system] * 60), str(work), task],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{system} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
            results[system].append(json.loads((work / "result.json").read_text()))
    return write(out, minutes, task, results)


def write(
    out: Path, minutes: dict[str, float], task: str, results: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The systems' results (each round's ``result.json``) summed up into ``bench-llm-rl-TASK.json`` and its
    chart."""
    data = {
        "task": task,
        "title": title(task),
        "settings": SETTINGS,
        "minutes": minutes,
        "machine": f"{os.cpu_count()} CPU cores",
        "systems": {s: [{"summary": summary(r), **r} for r in runs] for s, runs in results.items()},
    }
    data["rounds"] = {s: over_rounds([r["summary"] for r in runs]) for s, runs in data["systems"].items()}
    if "trl" in results:
        target = data["rounds"]["trl"]["final_reward"]  # the mean over TRL's rounds
        data["trl_final_reward"] = target
        data["reached_trl_final_at_s"] = {
            s: [reached_at(r["points"], target) for r in runs] for s, runs in results.items()
        }
    (out / f"bench-llm-rl-{task}.json").write_text(json.dumps(data, indent=1))
    chart(data, out / f"bench-llm-rl-{task}.png")
    return data


def title(task: str) -> str:
    """The chart's title: the task, then the settings every system ran with."""
    return (
        f"{TASKS[task].title}, SmolLM2-135M-Instruct float32, LoRA rank {RANK}, {GROUPS} prompts x {GROUP_SIZE} "
        f"answers of <= {COMPLETION_TOKENS} tokens a step, temperature 1, PPO clip {CLIP}, Adam lr {LEARNING_RATE} "
        f"betas ({BETA1}, {BETA2}), no gradient clipping"
    )


def chart(data: dict[str, Any], path: Path) -> None:
    """Mean reward of the latest 64 answers against wall-clock time, one line per system and round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for system, runs in data["systems"].items():
        for i, result in enumerate(runs):
            points = result["points"]
            label = system if len(runs) == 1 else f"{system} ({i + 1})"
            axes.plot([p["seconds"] / 60 for p in points], [p["reward"] for p in points], label=label)
    axes.set_xlabel("wall-clock minutes from the first step")
    axes.set_ylabel(f"mean reward, latest {WINDOW} answers")
    axes.set_title("\n".join(textwrap.wrap(data["title"], 100)), fontsize=8)
    axes.set_ylim(0, 1)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summary(result: dict[str, Any]) -> dict[str, float]:
    """A system's figures: its final and best reward, tokens/s, and mean step split."""
    points = result["points"]
    last = points[-1]
    # the reward at the end: the mean over the last two minutes (a 64-answer window moves by 0.2 from step to step)
    final = float(np.mean([p["reward"] for p in points if p["seconds"] >= last["seconds"] - FINAL_S]))
    figures = {
        "final_reward": final,
        "seconds": last["seconds"],
        "sampled_tokens_per_s": last["sampled_tokens"] / last["seconds"],
        "trained_tokens_per_s": last["trained_tokens"] / last["seconds"],
    }
    for part in ("generation", "logprobs", "training", "weight_sync", "step"):
        values = [s[part] for s in result["steps"] if part in s]
        if values:
            figures[f"{part}_s"] = float(np.mean(values))
    return figures


def over_rounds(summaries: list[dict[str, float]]) -> dict[str, Any]:
    """A system's figures over its rounds: the mean of each, and the final rewards' lowest and highest."""
    finals = [s["final_reward"] for s in summaries]
    mean = {
        k: float(np.mean([s[k] for s in summaries])) for k in summaries[0] if all(k in s for s in summaries)
    }
    return mean | {"rounds": len(summaries), "final_reward_range": [min(finals), max(finals)]}


def table(data: dict[str, Any]) -> str:
    """The result as the Markdown table of docs/benchmarks.md: per system, the means over its rounds (the final
    rewards' range beside them) and the ratios to TRL's."""
    rows = [
        "| system | rounds | minutes | final reward (range) | reached TRL's final at | sampled tokens/s | × TRL "
        "| trained tokens/s | step s: generation / log-probs / training / weight sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    trl = data["rounds"].get("trl")
    for system, figures in data["rounds"].items():
        reached = [r for r in data.get("reached_trl_final_at_s", {}).get(system, []) if r is not None]
        ratio = f"{figures['sampled_tokens_per_s'] / trl['sampled_tokens_per_s']:.2f}" if trl else "-"
        split = " / ".join(
            f"{figures[p + '_s']:.2f}" if p + "_s" in figures else "-"
            for p in ("generation", "logprobs", "training", "weight_sync")
        )
        low, high = figures["final_reward_range"]
        when = f"{np.mean(reached) / 60:.1f} min ({len(reached)} of {figures['rounds']})" if reached else "-"
        rows.append(
            f"| {system} | {figures['rounds']} | {figures['seconds'] / 60:.1f} | {figures['final_reward']:.2f} "
            f"({low:.2f}-{high:.2f}) | {when} | {figures['sampled_tokens_per_s']:.1f} | {ratio} | "
            f"{figures['trained_tokens_per_s']:.1f} | {split} |"
        )
    return "\n".join(rows)


def reached_at(points: list[dict[str, float]], target: float) -> float | None:
    """The first time the curve's mean reward reached ``target``."""
    return next((p["seconds"] for p in points if p["reward"] >= target), None)


if (
    __name__ == "__main__"
):  # one system in a process of its own: python -m bench.llm_rl SYSTEM SECONDS WORK TASK [STEPS]
    system, budget, folder, task = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    folder.mkdir(parents=True, exist_ok=True)
    # a step budget too (the tests' short runs of TRL and the cookbook): both stop at whichever comes first
    steps = {"steps": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    result = RUNS[system](budget, folder, task, **steps)
    (folder / "result.json").write_text(json.dumps(result | {"task": task, "settings": SETTINGS}))
