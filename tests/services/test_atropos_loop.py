"""The full Atropos loop through ``up`` (configs/atropos-toy.yaml): an atroposlib environment, the library
unmodified (examples/atropos_env.py), samples from the trainer's inference endpoint, posts scored groups to our
trajectory API, and the trainer learns from its exact-size batches until the score rises far above the untrained
model's; the API service is SIGKILLed on the way, up restarts it and the environment carries on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from examples.atropos_env import COMPLETION_TOKENS, PROMPTS, lowercase_fraction
from tests.support.atropos import scored_group
from tests.support.processes import wait_for
from tests.support.running import atropos_up, cli, leftovers, report_rows
from tinker_atropos.frontends.http import run_key
from tinker_atropos.models import tiny_lm
from tinker_atropos.sampling.engine import sample
from tinker_atropos.sampling.params import Params
from tinker_atropos.training.served import LANGUAGE_MODELS, TINY_LM

pytestmark = pytest.mark.integration

TARGET = 0.6


def untrained_score() -> float:
    """The toy task's mean score under the weights the trainer starts from (the tiny LM's fixed seed)."""
    model, tokenizer = LANGUAGE_MODELS[TINY_LM][0](), tiny_lm.ByteTokenizer()
    scores = [
        lowercase_fraction(s.tokens)
        for prompt in PROMPTS
        for s in sample(
            model,
            tokenizer.encode(prompt),
            Params(COMPLETION_TOKENS, 16, seed=1, stop_tokens=frozenset({tokenizer.eos_id})),
        )
    ]
    return float(np.mean(scores))


def test_the_toy_environment_learns_through_our_api_and_trainer_across_a_killed_api(tmp_path: Path) -> None:
    baseline = untrained_score()
    assert baseline < 0.2, baseline  # about 26 lowercase bytes among 258 tokens
    with atropos_up(tmp_path, "atropos-toy.yaml", max_seconds=300, report_interval_s=1.0) as run:
        config, run_dir = run.config, run.run_dir
        api = f"http://127.0.0.1:{config['atropos']['port']}"

        def figures() -> dict:
            try:
                return httpx.get(f"{api}/healthz", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return {}

        wait_for(lambda: figures().get("batches_served", 0) >= 2, 180, "the trainer's first batches")
        pid = int(
            subprocess.run(
                ["pgrep", "-f", f"atropos-api --config {tmp_path}"], capture_output=True, text=True
            ).stdout.split()[0]
        )
        served_before = figures()["batches_served"]
        os.kill(pid, signal.SIGKILL)  # up restarts it; the environment's posts and status calls retry
        wait_for(
            lambda: figures().get("batches_served", 0) > served_before, 120, "batches after the API's restart"
        )

        def learned() -> bool:
            rows = [r for r in report_rows(run_dir) if r.get("episode_return_mean") is not None]
            return len(rows) >= 3 and min(r["episode_return_mean"] for r in rows[-3:]) >= TARGET

        wait_for(learned, 180, f"a mean score of {TARGET}")
        # a group no trainer could learn from: refused and counted by the API, and named in up's summary
        key = run_key("atropos-api", (run_dir / "token").read_text().strip())
        bad = scored_group(None, 2, 1, scores=[0.0, float("nan")])
        refused = httpx.post(
            f"{api}/scored_data",
            content=json.dumps(bad),
            timeout=10,
            headers={"X-API-Key": key, "Content-Type": "application/json"},
        )
        assert refused.status_code == 422, refused.text
        time.sleep(2 * config["run"]["report_interval_s"] + 1)  # a report of up sees the API's figure
    output = run.output()
    assert run.process.returncode == 0, output[-4000:]
    assert "atropos-api exited" in output, output[-3000:]  # the SIGKILL, seen and restarted by up
    env_log = (run_dir / "logs" / "atropos-env-0.log").read_text()
    assert "Traceback" not in env_log, env_log[-3000:]
    assert (run_dir / "logs" / "atropos-env-0.log").exists() and leftovers(run_dir) == ""
    assert subprocess.run(["pgrep", "-f", f"atropos_env.py serve --config {run_dir}"]).returncode == 1
    # the environment reached the API and the endpoint with the run's keys, from a file only its user reads
    assert (run_dir / "atropos_env.yaml").stat().st_mode & 0o777 == 0o600
    # atroposlib's debug lines: off
    assert env_log.count("DEBUG") == 0 and len(env_log) < 200_000, len(env_log)
    assert f"checkpoints  {run_dir / 'atropos'}/ (latest: checkpoint-" in output, output[-2000:]
    problems = next(line for line in output.splitlines() if line.startswith("  problems     "))
    assert "groups_refused_invalid 1" in problems, problems  # the API's own counter, not a run counter
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert "learning tiny-byte-lm (every parameter) from the trajectory API" in trainer, trainer[-2000:]
    shown = cli("report", str(run_dir))  # the score curve from metrics.jsonl, as a PNG
    assert shown.returncode == 0 and (run_dir / "report.png").stat().st_size > 10_000, (
        shown.stdout + shown.stderr
    )
