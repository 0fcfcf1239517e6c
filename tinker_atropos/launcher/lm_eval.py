"""``tinker-atropos eval`` of a language model, and the evaluations an Atropos run's environments make as it trains.

What held-out accuracy means is the environment's to say: an atroposlib ``BaseEnv``'s own ``evaluate`` (its
``evaluate`` subcommand), which samples from an OpenAI-compatible endpoint and writes ``metrics.json`` with
``evaluate_log``. ``eval`` serves the model of a checkpoint (the Atropos loop's, the Tinker API's, or an exported
Hugging Face folder) in this process on a free 127.0.0.1 port under a key made for it, runs each of the run's
``atropos.environments`` with ``evaluate`` in place of ``serve`` and a ``--config`` file naming that endpoint, reads
what it wrote, then does the same for the base model: RL's first figure is the trained model beside the one it
started from. Each result is one row of the run's ``metrics.jsonl`` (``"event": "eval"``, its figures under
``eval/``), which ``report`` draws on the learning curve.

While ``up`` trains, ``atropos.eval_every_steps`` has the environments evaluate every that many steps (atroposlib's
``steps_per_eval``) into ``RUN_DIR/evals/``; ``PeriodicEvals`` turns each new result there into a row.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker_atropos.config import Config
from tinker_atropos.errors import FatalError
from tinker_atropos.launcher.client_files import EVALS, tokenizer_folder, write_environment_config
from tinker_atropos.launcher.run_folder import metric_rows
from tinker_atropos.processes import child_preexec

if TYPE_CHECKING:
    from tinker_atropos.training.served import LanguageModel

ERROR_LINE = re.compile(r"[\w.]*(Error|Exception|Interrupt)\b")  # how a Python exception's last line starts
EVENT = "eval"  # a metrics.jsonl row of an evaluation: {"event": "eval", ...}, never a report row
HEADLINE = ("eval/accuracy", "eval/mean_reward")  # the figure `report` draws, the first a row holds


@dataclass(frozen=True)
class Candidate:
    """A model to evaluate: which (``trained`` or ``base``), where it came from, the name it is served under and
    the tokenizer folder its environments read."""

    label: str
    source: str
    model: LanguageModel
    version: int
    tokenizer: str


@dataclass(frozen=True)
class Scored:
    """One environment's evaluation of one model: its metrics (``eval/...``) and the seconds it took."""

    candidate: Candidate
    environment: str
    metrics: dict[str, float]
    seconds: float

    def row(self, env_steps: int | None) -> dict[str, Any]:
        """As a metrics.jsonl row; ``env_steps``: the run's when the model was trained so far (None: unknown)."""
        model = self.candidate
        return eval_row(
            model.label, model.source, model.model.base_model, model.version, env_steps, self.environment
        ) | {"seconds": round(self.seconds, 1), **self.metrics}


def eval_row(
    label: str, source: str, base_model: str | None, version: int, env_steps: int | None, environment: str
) -> dict[str, Any]:
    """What every evaluation's row says besides its figures (``base_model`` None: the run's, as trained)."""
    return {
        "event": EVENT,
        "time": round(time.time(), 3),
        "model": label,
        "checkpoint": source,
        "base_model": base_model,
        "policy_version": version,
        "env_steps": env_steps,
        "environment": environment,
    }


def is_language_model_run(config: Config) -> bool:
    """Whether ``eval`` scores a language model: the Atropos loop's run, or a config that lists environments (a
    Tinker API run's model, evaluated with ``--config`` naming one)."""
    return config.trainer.atropos.enabled or bool(config.atropos.environments)


# ----------------------------------------------------------------------------------------------- the models


def trained_model(config: Config, run_dir: Path, checkpoint: str | None, where: str) -> Candidate:
    """The model ``checkpoint`` names (a checkpoint file of the Atropos loop or the Tinker API, a ``tinker://``
    path, an exported Hugging Face folder), or the run's newest checkpoint; ``where``: the run config's path.
    FatalError, one line, for anything else."""
    from tinker_atropos.launcher.lm_export import checkpoint_of, load_language_model, tinker_root

    tinker = config.trainer.tinker
    if checkpoint is not None and Path(checkpoint).is_dir():
        return _folder_model(config, Path(checkpoint))
    file = checkpoint_of(run_dir, tinker_root(run_dir, tinker.checkpoint_dir), checkpoint)
    model, version = load_language_model(file, tinker, where)
    return Candidate(
        "trained", str(file), model, version, tokenizer_folder(config, run_dir, model.base_model)
    )


def _folder_model(config: Config, folder: Path) -> Candidate:
    """An exported (merged) Hugging Face folder, served as a model of its own, fully (its tokenizer its own)."""
    from tinker_atropos.tinker_api import base_models
    from tinker_atropos.training.served import LanguageModel

    if (folder / "adapter_config.json").is_file():
        raise FatalError(
            f"{folder} is a PEFT adapter: evaluate the checkpoint it was exported from, or export it "
            "with --format merged"
        )
    name = str(folder.resolve())
    base_models.register(config.trainer.tinker.model_copy(update={"base_models": {name: name}}), _cpu())
    return Candidate("trained", name, LanguageModel(name, {}, _cpu()), 0, name)


def base_model(config: Config, run_dir: Path, trained: Candidate) -> Candidate:
    """The model ``trained`` started from, fresh (rank 0: every weight the base's); for an exported folder, the
    Atropos run's ``trainer.atropos.base_model``."""
    from tinker_atropos.tinker_api import base_models
    from tinker_atropos.training.served import LanguageModel

    name = trained.model.base_model
    if name == trained.source:  # an exported folder: no record of its base
        if not config.trainer.atropos.enabled:
            raise FatalError(
                f"{name} records no base model: evaluate the checkpoint it was exported from, or pass --no-base"
            )
        name = config.trainer.atropos.base_model
        tinker = config.trainer.tinker
        if name in tinker.base_models:
            base_models.register(
                tinker.model_copy(update={"base_models": {name: tinker.base_models[name]}}), _cpu()
            )
    return Candidate(
        "base", name, LanguageModel(name, {}, _cpu()), 0, tokenizer_folder(config, run_dir, name)
    )


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


# ------------------------------------------------------------------------------------------ the evaluation


def environment_commands(config: Config) -> list[list[str]]:
    """The run's environment programs with ``evaluate`` in place of ``serve``; FatalError when there are none or
    one has no ``serve``."""
    commands = config.atropos.environments
    if not commands:
        raise FatalError(
            "the run has no atropos.environments: eval runs an atroposlib environment's own `evaluate` "
            '(e.g. ["{python}", "-m", "examples.atropos_arithmetic_env", "serve", "--config", '
            '"{atropos_config}"])'
        )
    swapped = []
    for i, argv in enumerate(commands):
        if "serve" not in argv:
            raise FatalError(
                f"atropos.environments[{i}] has no `serve` to run as `evaluate`: {' '.join(argv)}"
            )
        at = argv.index("serve")
        swapped.append([*argv[:at], "evaluate", *argv[at + 1 :]])
    return swapped


def evaluate(
    config: Config, run_dir: Path, candidate: Candidate, commands: list[list[str]], extra: list[str]
) -> list[Scored]:
    """``candidate`` served on a free 127.0.0.1 port, evaluated by each environment of ``commands`` (``extra``
    appended to each: their own options, such as ``--env.eval_prompts 16``)."""
    with (
        tempfile.TemporaryDirectory(prefix="tinker-atropos-eval-") as scratch,
        serving(config, candidate) as endpoint,
    ):
        return [
            _run_environment(run_dir, candidate, argv, extra, endpoint, Path(scratch) / str(i))
            for i, argv in enumerate(commands)
        ]


@contextlib.contextmanager
def serving(config: Config, candidate: Candidate) -> Any:
    """The inference endpoint over ``candidate``'s weights (frozen: the sampler shares every tensor), its key a
    fresh one; yields (its OpenAI base URL, the key)."""
    from tinker_atropos.frontends.http import BackgroundServer
    from tinker_atropos.frontends.inference.app import build_app
    from tinker_atropos.frontends.inference.sampler import Sampler
    from tinker_atropos.frontends.inference.tokens import served_tokens
    from tinker_atropos.training.served import shared_tensors

    model, batching, key = candidate.model, config.trainer.tinker, secrets.token_urlsafe(24)
    network = model.core.model
    sampler = Sampler(
        network,
        candidate.version,
        served_tokens(model),
        shared_tensors(network),
        batching.kv_cache_tokens,
        batching.prefill_chunk_tokens,
    )
    limit = int(config.trainer.atropos.inference_max_request_mb * 2**20)
    server = BackgroundServer(
        build_app(sampler, model.base_model, [key], limit), "127.0.0.1", 0, "evaluation endpoint"
    )
    try:
        server.start(threading.Event())
        yield f"{server.url}/v1", key
    finally:
        server.close()
        sampler.close()


def _run_environment(
    run_dir: Path,
    candidate: Candidate,
    argv: list[str],
    extra: list[str],
    endpoint: tuple[str, str],
    scratch: Path,
) -> Scored:
    """One environment's ``evaluate`` of the served model, its output in RUN_DIR/logs/eval-LABEL.log."""
    url, key = endpoint
    scratch.mkdir(parents=True)
    results = scratch / "results"
    env = {"use_wandb": False, "data_dir_to_save_evals": str(results)}
    # its requests wait behind one another as long as the evaluation takes: no timeout to retry them after
    openai = {"base_url": url, "api_key": key, "model_name": candidate.model.base_model, "timeout": 3600}
    config_file = write_environment_config(scratch / "config.yaml", env, openai, candidate.tokenizer, "eval")
    values = {
        "python": sys.executable,
        "api_url": "",
        "inference_url": url,
        "atropos_config": str(config_file),
    }
    command = [arg.format(**values) for arg in argv] + extra
    log = run_dir / "logs" / f"eval-{candidate.label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "ab") as output:
        output.write(f"\n$ {' '.join(command)}\n".encode())
        output.flush()
        offset = output.tell()  # this evaluation's output starts here
        code = subprocess.call(command, stdout=output, stderr=subprocess.STDOUT, preexec_fn=child_preexec)
    seconds = time.monotonic() - started
    found = read_results(results / "metrics.json")
    if code != 0 or found is None:
        last = _last_error(log.read_bytes()[offset:].decode(errors="replace"))
        what = f"exited with code {code}" if code else "wrote no results (its evaluate calls no evaluate_log)"
        raise FatalError(
            f"`{' '.join(argv)}` {what} evaluating the {candidate.label} model ({last}): see {log}"
        )
    environment, metrics = found
    return Scored(candidate, environment, metrics, seconds)


def _last_error(output: str) -> str:
    """The line of a program's output that names its error (a Python exception's last line), else its last."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or [""])[-1]


def read_results(path: Path) -> tuple[str, dict[str, float]] | None:
    """The task and the metrics of an atroposlib ``evaluate_log`` file, each under ``eval/``; None when there is
    none (yet), or it is not whole."""
    try:
        return parse_results(path.read_text())
    except OSError:
        return None


def parse_results(text: str) -> tuple[str, dict[str, float]] | None:
    """``read_results`` of the file's text."""
    try:
        tasks = json.loads(text)["results"]
        metrics = tasks["all"]
    except (ValueError, KeyError, TypeError):
        return None
    task = next((name for name in tasks if name != "all"), "eval").split("|")
    environment = task[1] if len(task) > 1 else task[0]
    return environment, {
        (name if name.startswith("eval/") else f"eval/{name}"): float(value)
        for name, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def evaluate_run(
    config: Config, run_dir: Path, checkpoint: str | None, where: str, base: bool, extra: list[str]
) -> list[dict[str, Any]]:
    """``eval`` of a language-model run: the trained model (``trained_model``), then its base unless not
    ``base``, by each of the run's environments; their rows, appended to the run's metrics.jsonl."""
    commands = environment_commands(config)
    trained = trained_model(config, run_dir, checkpoint, where)
    steps = None if trained.source == trained.model.base_model else env_steps_at(run_dir, trained.version)
    rows = [scored.row(steps) for scored in evaluate(config, run_dir, trained, commands, extra)]
    if base:
        fresh = base_model(config, run_dir, trained)
        rows += [scored.row(None) for scored in evaluate(config, run_dir, fresh, commands, extra)]
    append_rows(run_dir, rows)
    return rows


def side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as the console shows them: per environment, a line per figure, a column per model."""
    lines = []
    for environment in dict.fromkeys(row["environment"] for row in rows):
        shown = [row for row in rows if row["environment"] == environment]
        names = list(dict.fromkeys(n for row in shown for n in row if n.startswith("eval/")))
        models = ", ".join(f"{row['model']}: {row['checkpoint']}" for row in shown)
        lines.append(f"{environment} ({models})")
        lines.append(f"  {'':<24}" + "".join(f"{row['model']:>12}" for row in shown))
        for name in names:
            lines.append(
                f"  {name.removeprefix('eval/'):<24}"
                + "".join(f"{_figure(row.get(name)):>12}" for row in shown)
            )
        lines.append(f"  {'seconds':<24}" + "".join(f"{row['seconds']:>12.1f}" for row in shown))
    return lines


def _figure(value: object) -> str:
    """A figure as the console shows it: a count whole, a fraction or a mean to three places."""
    if not isinstance(value, int | float):
        return "-"
    if float(value).is_integer() and abs(value) > 1:
        return f"{value:.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def env_steps_at(run_dir: Path, version: int) -> int | None:
    """The run's env steps when its policy first reached ``version`` (its report rows), the last row's for a
    checkpoint past them (written at stop); None without rows."""
    rows = metric_rows(run_dir / "metrics.jsonl")
    reached = (int(r["env_steps"]) for r in rows if int(r.get("policy_version") or 0) >= version)
    return next(reached, int(rows[-1]["env_steps"]) if rows else None)


def append_rows(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """The rows, appended to the run's metrics.jsonl, whole."""
    path = run_dir / "metrics.jsonl"
    with open(path, "a") as file:
        file.write("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------------- while `up` trains


class PeriodicEvals:
    """The evaluations the run's environments write as it trains (atroposlib's ``evaluate_log``: each one rewrites
    RUN_DIR/evals/metrics.json): each new one, once, as a metrics.jsonl row of the report row it was read at."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / EVALS / "metrics.json"
        self.last = self._text()  # a resumed run's last one is not new

    def _text(self) -> str:
        try:
            return self.path.read_text()
        except OSError:
            return ""

    def new(self, report: dict[str, Any]) -> dict[str, Any] | None:
        """The row of a result written since the last call (None: none, or one not yet whole); a result of the
        same figures is new too (its file names its own time)."""
        text = self._text()
        found = parse_results(text) if text != self.last else None
        if found is None:
            return None
        self.last = text
        environment, metrics = found
        version, steps = int(report.get("policy_version") or 0), report.get("env_steps")
        row = eval_row("trained", "up", None, version, steps, environment)
        return row | {"wall_time_s": report.get("wall_time_s"), **metrics}


def eval_line(row: dict[str, Any]) -> str:
    """A periodic evaluation's console line."""
    figures = ", ".join(
        f"{name.removeprefix('eval/')} {_figure(value)}"
        for name, value in row.items()
        if name.startswith("eval/")
    )
    return f"evaluation of policy version {row['policy_version']} ({row['environment']}): {figures}"


def eval_rows(path: Path) -> list[dict[str, Any]]:
    """The evaluation rows of a metrics.jsonl (lines cut short skipped)."""
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path) as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and row.get("event") == EVENT:
                    rows.append(row)
    return rows


def headline(row: dict[str, Any]) -> tuple[str, float] | None:
    """The figure of an evaluation row that stands for it: accuracy, else mean reward, else its first."""
    names = [name for name in HEADLINE if name in row] or [name for name in row if name.startswith("eval/")]
    return (names[0], float(row[names[0]])) if names else None


def draw_evaluations(axis: Any, path: Path) -> None:
    """The evaluations of metrics.jsonl at ``path`` on the run's learning curve (``axis``, against its steps): the
    trained model's where it had got to, the latest of its base's as a dashed line."""
    shown = [(row, found) for row in eval_rows(path) if (found := headline(row)) is not None]
    trained = [
        (r["env_steps"], v, n)
        for r, (n, v) in shown
        if r["model"] == "trained" and r.get("env_steps") is not None
    ]
    if trained:
        steps, values, names = zip(*trained, strict=True)
        axis.plot(steps, values, "o", color="tab:orange", label=f"held-out {names[-1].removeprefix('eval/')}")
    base = [(n, v) for r, (n, v) in shown if r["model"] == "base"]
    if base:
        name, value = base[-1]
        axis.axhline(
            value, color="tab:gray", linestyle="--", label=f"base model's {name.removeprefix('eval/')}"
        )
    if trained or base:
        axis.legend(loc="lower right")
