"""The shipped language-model RL config (configs/atropos-smollm2-arithmetic.yaml) end to end with ``up`` alone,
a few steps: the atroposlib environment samples SmolLM2's answers from the trainer's endpoint, the trainer takes
LoRA steps on them, and the reward metric (the mean of the latest 64 answers) is written; the trained model leaves
the run folder as a PEFT adapter and a merged Hugging Face folder with the trainer's own log-probabilities; the
console speaks of tokens, answers and reward, and the trainer writes the TensorBoard curves TRL's and verl's users
read. Whether it learns is measured by ``make bench-llm-rl`` over 15 minutes, not here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import PeftModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner, Result

from examples.atropos_arithmetic_env import GROUP_SIZE, problems, reward
from tests.support.docs import DOCUMENTS, marked_snippets
from tests.support.hf_models import transformers_logprobs
from tests.support.processes import wait_for
from tests.support.running import atropos_up, leftovers, metrics, report_rows
from tinker_atropos.launcher.cli import app
from tinker_atropos.models import smollm2
from tinker_atropos.models.logprobs import target_logprobs
from tinker_atropos.training.served import LanguageModel

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4  # float32 log-probabilities; folding B A into W reorders the sums


def test_the_task_scores_the_last_integer_of_an_answer() -> None:
    assert problems(seed=0, count=3) == problems(seed=0, count=3) != problems(seed=1, count=3)
    assert all(0 <= a <= 9 and 0 <= b <= 9 for a, b in problems(seed=0, count=100))
    assert reward("The answer is 12.", 7, 5) == reward("7 + 5 = 12", 7, 5) == 1.0
    assert reward("7 + 5", 7, 5) == reward("twelve", 7, 5) == reward("12 or 13", 7, 5) == 0.0


def test_the_shipped_config_trains_smollm2_with_up_alone_and_writes_the_reward(tmp_path: Path) -> None:
    with atropos_up(
        tmp_path, "atropos-smollm2-arithmetic.yaml", max_seconds=400, report_interval_s=2.0, edit=evaluating
    ) as run:
        wait_for(
            lambda: (
                any(r["policy_version"] >= 2 for r in report_rows(run.run_dir)) and evaluations(run.run_dir)
            ),
            300,
            "two LoRA steps of the trainer and an evaluation",
            interval_s=1.0,
        )
    config, run_dir, output = run.config, run.run_dir, run.output()
    assert run.process.returncode == 0, output[-4000:]
    rows = [r for r in report_rows(run_dir) if r["episode_return_mean"] is not None]
    assert rows, output[-3000:]
    assert all(0.0 <= r["episode_return_mean"] <= 1.0 for r in rows)
    # each step's weight sync (the endpoint sampling with the new adapter) is timed and reported
    assert any(r["losses"].get("weight_sync_seconds", 0.0) > 0.0 for r in rows), rows[-1]
    # every answer of each batch counts, groups whose answers all scored alike too
    assert rows[-1]["episodes"] >= 2 * config["trainer"]["atropos"]["batch_size"]
    assert rows[-1]["episodes"] % GROUP_SIZE == 0
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert f"learning {smollm2.NAME} (LoRA rank 16) from the trajectory API" in trainer, trainer[-2000:]
    env_log = (run_dir / "logs" / "atropos-env-0.log").read_text()
    assert "Traceback" not in env_log and "Traceback" not in trainer, env_log[-3000:]
    assert "mean reward" in output and "(last 64 answers)" in output, output[-2000:]
    assert re.search(r"\d tokens +[\d,]+ tokens/s +answers +\d+ +reward ", output), output[-2000:]
    assert not re.search(r" lag \d", output) and "tokens/s over this session" in output, output[-2000:]
    assert_curves(run_dir)
    assert leftovers(run_dir) == ""
    periodic = evaluations(run_dir)  # those of the run, before eval's
    done = documented_commands(run_dir)
    leaves_as_an_adapter_and_merged(run_dir, config["trainer"]["atropos"]["lora_rank"], done[:2])
    evaluated_as_it_trains_and_after(run_dir, output, periodic, done[2])


def evaluating(config: dict[str, Any]) -> None:
    """The environment's own evaluation every 2 steps (atropos.eval_every_steps): 8 held-out problems, 2 samples
    each."""
    config["atropos"]["eval_every_steps"] = 2
    config["atropos"]["environments"][0] += ["--env.eval_prompts", "8", "--env.eval_samples", "2"]


def evaluations(run_dir: Path) -> list[dict[str, Any]]:
    return [row for row in metrics(run_dir) if row.get("event") == "eval"]


def documented_commands(run_dir: Path) -> list[Result]:
    """docs/atropos.md's ``llm-out`` snippet, each line run in this process (SmolLM2, built in, is read once) on
    this run's folder: what the docs say a trained model's way out of the run is, as written."""
    (code,) = [c for d in DOCUMENTS for name, _, c in marked_snippets(d.read_text()) if name == "llm-out"]
    results = []
    for line in filter(None, (line.split("#")[0].strip() for line in code.splitlines())):
        program, *arguments = shlex.split(line.replace("runs/atropos-smollm2-arithmetic", str(run_dir)))
        assert program == ".venv/bin/tinker-atropos", line
        results.append(CliRunner().invoke(app, arguments))
        assert results[-1].exit_code == 0, (line, results[-1].output[-3000:])
    return results


def evaluated_as_it_trains_and_after(
    run_dir: Path, output: str, periodic: list[dict[str, Any]], done: Result
) -> None:
    """The periodic evaluation's row and console line; then ``eval`` of the run's last checkpoint beside the base
    model, on 8 held-out problems: a row of each, a table, and the report draws them."""
    assert periodic[0]["model"] == "trained" and periodic[0]["eval/prompts"] == 8, periodic
    assert 0.0 <= periodic[0]["eval/accuracy"] <= 1.0 and "eval/pass@2" in periodic[0], periodic
    assert "evaluation of policy version" in output, output[-2000:]
    trained, base = evaluations(run_dir)[len(periodic) :]
    assert trained["model"] == "trained" and base["model"] == "base", (trained, base)
    assert Path(trained["checkpoint"]).parent == run_dir / "atropos" and trained["policy_version"] >= 2
    assert trained["env_steps"] > 0 and base["checkpoint"] == smollm2.NAME and base["policy_version"] == 0
    for row in (trained, base):
        assert row["environment"] == "arithmetic_eval" and row["eval/prompts"] == 8, row
        assert 0.0 <= row["eval/accuracy"] <= 1.0 and 0.0 <= row["eval/pass@2"] <= 1.0, row
        assert 0 < row["eval/answer_tokens"] <= 12 and row["seconds"] > 0, row
    assert "accuracy" in done.output and "pass@2" in done.output, done.output
    assert CliRunner().invoke(app, ["report", str(run_dir)]).exit_code == 0


def assert_curves(run_dir: Path) -> None:
    """The trainer's TensorBoard curves of the loop's steps (``trainer.tensorboard: true`` in the config)."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    curves = {
        "reward/mean",
        "reward/std",
        "answers/length_mean",
        "policy/kl_sampler_learner",
        "policy/entropy",
        "policy/clip_fraction",  # the config's loss is PPO
        "train/loss",
        "train/grad_norm",
        "throughput/sampled_tokens_per_s",
        "throughput/trained_tokens_per_s",
        "time/weight_sync_s",
    }
    assert curves <= set(events.Tags()["scalars"]), events.Tags()["scalars"]
    assert len(events.Scalars("train/loss")) >= 2


def leaves_as_an_adapter_and_merged(run_dir: Path, rank: int, made: list[Result]) -> None:
    """``export RUN --format peft`` and ``merged`` (``made``) found the loop's last checkpoint (written at stop) in
    RUN/atropos; the adapter and the merged folder give, in transformers and PEFT alone, the log-probabilities of
    the trainer's own model restored from that checkpoint."""
    checkpoint = max((run_dir / "atropos").glob("checkpoint-*.pt"), default=None)
    assert checkpoint is not None, sorted(run_dir.iterdir())
    assert all(f" of {smollm2.NAME} from {checkpoint} " in done.output for done in made), made[0].output

    core = torch.load(checkpoint, weights_only=True)["core"]
    trained = LanguageModel(smollm2.NAME, core["spec"]["lora"], torch.device("cpu"))  # as the loop built it
    trained.core.load_state_dict(core)
    tokens = smollm2.tokenizer().encode("What is 7 + 5? The answer is 12.")
    with torch.no_grad():
        ours = target_logprobs(trained.core.model, [torch.tensor(tokens[:-1])], [torch.tensor(tokens[1:])])
    ours = ours[0].numpy()
    adapter = json.loads((run_dir / "export-peft" / "adapter_config.json").read_text())
    assert adapter["r"] == rank
    base = AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"])
    assert np.abs(transformers_logprobs(base, tokens[:-1], tokens[1:]) - ours).max() > 10 * TOLERANCE
    peft = PeftModel.from_pretrained(base, run_dir / "export-peft")
    assert np.abs(transformers_logprobs(peft, tokens[:-1], tokens[1:]) - ours).max() < TOLERANCE
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export-merged")
    assert np.abs(transformers_logprobs(merged, tokens[:-1], tokens[1:]) - ours).max() < TOLERANCE
