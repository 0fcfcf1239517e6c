"""The evaluation of a language model around its environment's own ``evaluate``: the command it runs, the results
it reads back (``evaluate_log``'s metrics.json, each new one once while ``up`` trains), what ``up`` writes for the
environments, and the refusals that need no model. The whole of ``eval`` on a trained SmolLM2 is in
``tests/services/test_atropos_smollm2.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.support.running import REPO
from tinker_atropos.config import Config, parse_config
from tinker_atropos.errors import FatalError
from tinker_atropos.launcher.cli import app
from tinker_atropos.launcher.client_files import write_atropos_config
from tinker_atropos.launcher.lm_eval import PeriodicEvals, environment_commands, read_results


def arithmetic_run(**atropos: Any) -> Config:
    """The shipped arithmetic run's config on the tiny LM (no SmolLM2 tokenizer to write), ``atropos`` set."""
    data = yaml.safe_load((REPO / "configs" / "atropos-smollm2-arithmetic.yaml").read_text())
    data["trainer"]["atropos"]["base_model"] = "tiny-byte-lm"
    data["atropos"] |= atropos
    return parse_config(data)


def evaluate_log(path: Path, metrics: dict[str, Any], seconds: float = 1.0) -> None:
    """What atroposlib's ``BaseEnv.evaluate_log`` writes (its task: the arithmetic environment's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    general = {"model_name": "m", "total_evaluation_time_seconds": str(seconds)}
    results = {"atropos|arithmetic_eval|0": metrics, "all": metrics}
    path.write_text(json.dumps({"config_general": general, "results": results}))


def test_each_environment_evaluates_in_place_of_serve_and_a_run_without_one_is_refused() -> None:
    (command,) = environment_commands(arithmetic_run())
    assert command == [
        "{python}",
        "-m",
        "examples.atropos_arithmetic_env",
        "evaluate",
        "--config",
        "{atropos_config}",
    ]
    with pytest.raises(FatalError, match=r"^atropos.environments\[0\] has no `serve` to run as `evaluate`"):
        environment_commands(arithmetic_run(environments=[["{python}", "env.py", "process"]]))
    with pytest.raises(FatalError, match="the run has no atropos.environments: eval runs"):
        environment_commands(arithmetic_run(environments=[]))


def test_a_result_is_read_under_eval_and_each_new_one_becomes_a_row_once(tmp_path: Path) -> None:
    path = tmp_path / "evals" / "metrics.json"
    evaluate_log(path, {"eval/accuracy": 0.25, "pass@4": 0.5, "note": "text", "flag": True})
    assert read_results(path) == ("arithmetic_eval", {"eval/accuracy": 0.25, "eval/pass@4": 0.5})
    periodic = PeriodicEvals(tmp_path)  # a resumed run: what is there already is not new
    report = {"policy_version": 7, "env_steps": 900, "wall_time_s": 12.5}
    assert periodic.new(report) is None
    path.write_text('{"results": {"all": {"eval/accura')  # being written: read at a later report
    assert periodic.new(report) is None
    evaluate_log(path, {"eval/accuracy": 0.75})
    row = periodic.new(report)
    assert row is not None and periodic.new(report) is None
    assert row["event"] == "eval" and row["model"] == "trained" and row["environment"] == "arithmetic_eval"
    assert (row["policy_version"], row["env_steps"], row["eval/accuracy"]) == (7, 900, 0.75)
    evaluate_log(path, {"eval/accuracy": 0.75}, seconds=3.0)  # the same figures again: a later evaluation
    again = periodic.new(report)
    assert again is not None and again["eval/accuracy"] == 0.75


def test_up_has_the_environments_evaluate_every_n_steps_into_the_run_folder(tmp_path: Path) -> None:
    every = yaml.safe_load(
        write_atropos_config(arithmetic_run(eval_every_steps=5), tmp_path, None).read_text()
    )
    assert every["env"]["steps_per_eval"] == 5
    assert every["env"]["data_dir_to_save_evals"] == str((tmp_path / "evals").resolve())
    never = yaml.safe_load(write_atropos_config(arithmetic_run(), tmp_path, None).read_text())
    assert never["env"]["steps_per_eval"] == 0 and "data_dir_to_save_evals" not in never["env"]


def test_eval_of_a_peft_adapter_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(arithmetic_run().to_yaml())
    adapter = tmp_path / "export-peft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    done = CliRunner().invoke(app, ["eval", str(run), "--checkpoint", str(adapter)])
    assert done.exit_code == 2
    assert done.output.strip().splitlines() == [
        f"error: {adapter} is a PEFT adapter: evaluate the checkpoint it was exported from, or export it with "
        "--format merged"
    ]
