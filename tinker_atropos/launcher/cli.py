"""The ``tinker-atropos`` command: run the whole system locally (``up``) or one service (``env``, ``rollout``,
``trainer``, ``atropos-api``) as a container or another machine would, look at a run (``status``, ``health``) and at its
policy (``eval``, ``export``)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from tinker_atropos.config import Config, ConfigError, load_config
from tinker_atropos.logs import route_mujoco_warnings
from tinker_atropos.service_host import Endpoint


def plain_help(doc: str) -> str:
    """``doc`` (a docstring, reStructuredText for the API docs) as ``--help`` prints it: without the double
    backticks of its inline literals, which Typer shows as they are."""
    return doc.replace("``", "")


app = typer.Typer(add_completion=False, no_args_is_help=True, help=plain_help(__doc__ or ""))


def _checked_url(url: str | None) -> str | None:
    """A --redis-url (or TA_REDIS_URL) the Redis client cannot use is a usage error naming the option."""
    from tinker_atropos.state.connection import check_url

    if url is not None:
        try:
            check_url(url)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    return url


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", envvar="TA_CONFIG", help="Run config (YAML).")]
RedisOpt = Annotated[
    str | None,
    typer.Option(envvar="TA_REDIS_URL", callback=_checked_url, help="redis:// URL; overrides redis.url."),
]
HostOpt = Annotated[str, typer.Option(envvar="TA_HOST", help="Address to bind.")]
AdvertiseOpt = Annotated[
    str | None,
    typer.Option(envvar="TA_ADVERTISE_HOST", help="Host written to the registry (default: the bound host)."),
]
PortOpt = Annotated[int, typer.Option(envvar="TA_PORT", min=0, max=65535, help="gRPC port; 0 = any free.")]
NameOpt = Annotated[
    str | None,
    typer.Option(envvar="TA_SERVICE_NAME", help="Stable name across restarts (default KIND@ADDRESS)."),
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        envvar="TA_METRICS_PORT",
        min=0,
        max=65535,
        help="Serve Prometheus metrics on this port of --host (0: a free one, named in the registry).",
    ),
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        envvar="TA_INSECURE",
        help="Serve without protection, for a local experiment: the HTTP endpoints (Tinker, Atropos, inference) "
        "without API keys, a non-loopback address without the token or TLS (both refused otherwise).",
    ),
]
RunDirOpt = Annotated[
    Path | None, typer.Option(envvar="TA_RUN_DIR", help="Run folder (default runs/RUN_NAME).")
]


def read_config(path: Path, settings: list[str] | None = None) -> Config:
    """The config at ``path`` with ``settings`` (``--set KEY=VALUE``) over it, or its errors on stderr and exit
    code 2 (for every command that reads one)."""
    try:
        config = load_config(path, settings or ())
    except ConfigError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    from tinker_atropos.errors import EnvError
    from tinker_atropos.launcher.sizing import resolve_auto

    try:
        resolve_auto(config)  # 'auto' sizes become numbers here, before anyone reads them
    except EnvError as error:
        typer.echo(f"cannot size env.* or rollout.replicas 'auto': {error}", err=True)
        raise typer.Exit(2) from None
    return config


def _redis_url(config: Config, override: str | None) -> str:
    url = override or config.redis.url
    if not url:
        typer.echo(
            "no Redis URL: pass --redis-url, set TA_REDIS_URL or redis.url in the config "
            "(only `up` starts an embedded server)",
            err=True,
        )
        raise typer.Exit(2)
    return url


@app.command()
def up(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    total_steps: Annotated[int | None, typer.Option(min=1, help="Stop after this many env steps.")] = None,
    run_dir: RunDirOpt = None,
    redis_url: RedisOpt = None,
    target_return: Annotated[
        float | None,
        typer.Option(
            help="Stop once the mean return (a language model's: reward) of the latest run.return_window "
            "episodes (answers) reaches this."
        ),
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(min=1, help="Stop after this much wall time of this invocation, start-up included."),
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Start the run over: clear its folder and its keys in Redis.")
    ] = False,
    metrics: Annotated[
        bool,
        typer.Option(
            "--metrics", help="Every service serves Prometheus metrics on a free port (see status)."
        ),
    ] = False,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Set a config field over the file's (repeatable): a dotted path, a YAML value, e.g. "
            "--set trainer.ppo.learning_rate=3e-4 --set env.instances=4.",
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(min=0, help="The run's seed (run.seed): envs, policy sampling, network init."),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="A local experiment on a machine nobody else uses: the run's HTTP endpoints (Tinker API, Atropos "
            "trajectory API, inference) take no API key.",
        ),
    ] = False,
) -> None:
    """Start Redis (embedded Valkey unless a URL is given) and every service as its own process.

    A run folder that holds a run is resumed: the counters and --total-steps go on from where it stopped."""
    began = time.monotonic()  # up's clock (UpOptions.began) counts its imports and the config's sizing too
    from tinker_atropos.launcher.up import UpOptions, run_local

    cfg = read_config(config, [*(settings or ()), *(() if seed is None else (f"run.seed={seed}",))])
    run_dir = run_dir or Path("runs") / cfg.run.name
    options = UpOptions(total_steps, target_return, max_seconds, fresh, metrics, insecure, began=began)
    raise typer.Exit(run_local(cfg, run_dir, redis_url, options))


def _or_exit(call: Callable[..., Any], *args: object) -> Any:
    """``call(*args)``; a FatalError ends the command with its one line and exit code 2."""
    from tinker_atropos.errors import EXIT_FATAL, FatalError

    try:
        return call(*args)
    except FatalError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_FATAL) from None


def _serve_check(host: str, insecure: bool) -> None:
    """Refuse (exit 2) a non-loopback bind without the token and TLS, or warn when ``insecure`` lets it be."""
    from tinker_atropos.security import check_exposure

    warning = _or_exit(check_exposure, host, insecure)
    if warning:
        typer.echo(f"warning: {warning}", err=True)


def _serve(
    serve: Callable[..., None], insecure: bool, config: Config, url: str, endpoint: Endpoint, *extra: object
) -> None:
    """Run a service; a failure a restart cannot fix, or a Redis that stays away, ends it with one line. A
    non-loopback bind without the token and TLS is such a failure, unless ``insecure``."""
    from tinker_atropos.state.connection import RedisUnreachable

    _serve_check(endpoint.host, insecure)
    if insecure:  # what the HTTP front-ends read (security.insecure), as when TA_INSECURE is set
        os.environ["TA_INSECURE"] = "1"
    try:
        _or_exit(serve, config, url, endpoint, *extra)
    except RedisUnreachable as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None


def _endpoint(
    host: str, port: int, advertise_host: str | None, name: str | None, metrics_port: int | None
) -> Endpoint:
    return Endpoint(host=host, port=port, advertise_host=advertise_host, name=name, metrics_port=metrics_port)


@app.command()
def env(
    config: ConfigOpt,
    redis_url: RedisOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 50051,
    advertise_host: AdvertiseOpt = None,
    name: NameOpt = None,
    metrics_port: MetricsPortOpt = None,
    insecure: InsecureOpt = False,
    instances: Annotated[
        int | None, typer.Option(envvar="TA_INSTANCES", min=1, help="Overrides env.instances.")
    ] = None,
    role: Annotated[
        str,
        typer.Option(envvar="TA_ENV_ROLE", help="train (the rollouts') or eval (trainer.evaluation's only)."),
    ] = "train",
) -> None:
    """Run one environment service."""
    from tinker_atropos.environment.service import serve

    if role not in ("train", "eval"):
        typer.echo(f"error: --role {role!r} is not one of: train, eval", err=True)
        raise typer.Exit(2)
    cfg = read_config(config)
    if instances is not None:
        cfg.env.instances = instances
    endpoint = _endpoint(host, port, advertise_host, name, metrics_port)
    _serve(serve, insecure, cfg, _redis_url(cfg, redis_url), endpoint, role)


@app.command()
def rollout(
    config: ConfigOpt,
    redis_url: RedisOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 50052,
    advertise_host: AdvertiseOpt = None,
    name: NameOpt = None,
    metrics_port: MetricsPortOpt = None,
    insecure: InsecureOpt = False,
) -> None:
    """Run one rollout service."""
    from tinker_atropos.rollout.service import serve

    cfg = read_config(config)
    _serve(
        serve,
        insecure,
        cfg,
        _redis_url(cfg, redis_url),
        _endpoint(host, port, advertise_host, name, metrics_port),
    )


@app.command()
def trainer(
    config: ConfigOpt,
    redis_url: RedisOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 50053,
    advertise_host: AdvertiseOpt = None,
    name: NameOpt = None,
    metrics_port: MetricsPortOpt = None,
    run_dir: RunDirOpt = None,
    insecure: InsecureOpt = False,
    inference_host: Annotated[
        str | None,
        typer.Option(
            envvar="TA_INFERENCE_HOST",
            help="Address of the Atropos inference endpoint; overrides trainer.atropos.inference_host.",
        ),
    ] = None,
) -> None:
    """Run the trainer service (checkpoints under RUN_DIR/checkpoints)."""
    from tinker_atropos.trainer.service import serve

    cfg = read_config(config)
    endpoint = _endpoint(host, port, advertise_host, name, metrics_port)
    if cfg.trainer.tinker.enabled:  # its HTTP port is exposed as much as the gRPC one
        _serve_check(cfg.trainer.tinker.host, insecure)
    if inference_host is not None:
        cfg.trainer.atropos.inference_host = inference_host
    if cfg.trainer.atropos.enabled:
        _serve_check(cfg.trainer.atropos.inference_host, insecure)
    _serve(serve, insecure, cfg, _redis_url(cfg, redis_url), endpoint, run_dir or Path("runs") / cfg.run.name)


@app.command("atropos-api")
def atropos_api(
    config: ConfigOpt,
    redis_url: RedisOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 50054,
    advertise_host: AdvertiseOpt = None,
    name: NameOpt = None,
    metrics_port: MetricsPortOpt = None,
    insecure: InsecureOpt = False,
    http_host: Annotated[
        str | None,
        typer.Option(envvar="TA_ATROPOS_HOST", help="Address of the HTTP API; overrides atropos.host."),
    ] = None,
    http_port: Annotated[
        int | None,
        typer.Option(
            envvar="TA_ATROPOS_PORT", min=0, max=65535, help="Port of the HTTP API; overrides atropos.port."
        ),
    ] = None,
    http_fd: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Serve HTTP on this inherited listening socket (what `up` hands down, so that "
            "clients wait instead of being refused while it restarts).",
        ),
    ] = None,
) -> None:
    """Run the Atropos trajectory API (HTTP on atropos.host:atropos.port; health and status on the gRPC port)."""
    from tinker_atropos.frontends.atropos.service import serve

    cfg = read_config(config)
    cfg.atropos.host = http_host if http_host is not None else cfg.atropos.host
    cfg.atropos.port = http_port if http_port is not None else cfg.atropos.port
    _serve_check(cfg.atropos.host, insecure)  # its HTTP port is exposed as much as the gRPC one
    endpoint = _endpoint(host, port, advertise_host, name, metrics_port)
    _serve(serve, insecure, cfg, _redis_url(cfg, redis_url), endpoint, http_fd)


@app.command()
def status(
    run_dir: Annotated[
        Path | None,
        typer.Argument(
            help="Run folder of a running `up`: its Redis and password are read from there (default: this "
            "folder if it is one, or the only run under ./runs)."
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="TA_REDIS_URL",
            callback=_checked_url,
            help="redis:// URL of the run's Redis, instead of a run folder (default without either: "
            "redis://127.0.0.1:6379/0).",
        ),
    ] = None,
    run: Annotated[str | None, typer.Option(help="Run name (default: every run found).")] = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch", help="Redraw every --interval seconds, with a steps/s sparkline, until Ctrl-C."
        ),
    ] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between two views of --watch.")] = 1.0,
) -> None:
    """Print the live services of a run and its counters, from the Redis registry."""
    from tinker_atropos.launcher.status import RunNotRunning, find_run, print_status, watch_status

    try:
        found = _or_exit(find_run, run_dir, redis_url, Path.cwd())
    except RunNotRunning as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(1) from None
    run = run or found.run
    if watch:
        raise typer.Exit(watch_status(found.url, run, interval, lost=found.lost))
    raise typer.Exit(print_status(found.url, run, found.lost))


RunConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="Run config (default RUN_DIR/config.yaml, written by `up`).")
]
CheckpointOpt = Annotated[Path | None, typer.Option(help="Checkpoint file (default: the run's newest).")]
BestOpt = Annotated[
    bool,
    typer.Option(
        "--best", help="The policy of the run's best periodic evaluation (RUN_DIR/checkpoints/best.pt)."
    ),
]


def _checkpoint(run_dir: Path, checkpoint: Path | None, best: bool) -> Path | None:
    """The checkpoint ``--checkpoint`` or ``--best`` names (None: the run's newest); exit 2 when ``--best`` finds
    none, or both are given."""
    from tinker_atropos.errors import EXIT_FATAL
    from tinker_atropos.state.checkpoint_files import BEST

    if not best:
        return checkpoint
    path = run_dir / "checkpoints" / BEST
    if checkpoint is not None:
        typer.echo("error: --best and --checkpoint name two checkpoints: give one", err=True)
        raise typer.Exit(EXIT_FATAL)
    if not path.exists():
        typer.echo(
            f"error: {path} does not exist: the trainer keeps the best policy when trainer.evaluation."
            "every_updates is on (e.g. up --set trainer.evaluation.every_updates=10)",
            err=True,
        )
        raise typer.Exit(EXIT_FATAL)
    return path


def _run_config(run_dir: Path, config: Path | None) -> Config:
    """The config of a run folder: ``config``, or the one ``up`` wrote there; exit 2 when there is none, or no
    such folder."""
    from tinker_atropos.errors import EXIT_FATAL

    if not run_dir.is_dir():
        typer.echo(f"error: run folder {run_dir} does not exist (`up` makes runs/RUN_NAME)", err=True)
        raise typer.Exit(EXIT_FATAL)
    config = config or run_dir / "config.yaml"
    if not config.exists():
        typer.echo(f"error: {config} does not exist: pass the run's config with --config", err=True)
        raise typer.Exit(EXIT_FATAL)
    return read_config(config)


@app.command("eval")
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="Run folder (its config.yaml and checkpoints/).")],
    env_args: Annotated[
        list[str] | None,
        typer.Argument(
            help="A language model's run: after --, options of the environments' evaluate (e.g. -- "
            "--env.eval_prompts 16).",
            show_default=False,
        ),
    ] = None,
    config: RunConfigOpt = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint file (default: the run's newest); of a language model also a tinker:// path or an "
            "exported Hugging Face folder (export --format merged)."
        ),
    ] = None,
    best: BestOpt = False,
    base: Annotated[
        bool, typer.Option("--base/--no-base", help="A language model's base, evaluated beside it.")
    ] = True,
    episodes: Annotated[int, typer.Option(min=1, help="Whole episodes to play.")] = 10,
    stochastic: Annotated[
        bool,
        typer.Option("--stochastic", help="Sample actions as in training instead of acting with the mode."),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the env instances (instance i: seed + i).")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object instead of a line of text.")
    ] = False,
    video: Annotated[
        Path | None, typer.Option(help="Also render episodes offscreen to this MP4, and a GIF beside it.")
    ] = None,
    video_episodes: Annotated[int, typer.Option(min=1, help="Episodes in the video.")] = 1,
    video_frames: Annotated[int, typer.Option(min=1, help="At most this many frames in the video.")] = 1000,
) -> None:
    """Evaluate a run's policy in this process: a control policy plays whole episodes (no service needed); a
    language model is scored by its environments' own evaluation (an atroposlib BaseEnv's evaluate), beside its base."""
    if video is not None:
        from tinker_atropos.launcher.video import use_offscreen_rendering

        use_offscreen_rendering()  # before anything imports mujoco
    from tinker_atropos.errors import EXIT_FATAL
    from tinker_atropos.launcher.evaluate import acting_policy
    from tinker_atropos.launcher.evaluate import evaluate as run_evaluation
    from tinker_atropos.launcher.lm_eval import is_language_model_run

    cfg = _run_config(run_dir, config)
    if is_language_model_run(cfg):
        _evaluate_language_model(run_dir, cfg, config, checkpoint, best, base, env_args or [], as_json)
        return
    if env_args:
        typer.echo(
            f"error: {' '.join(env_args)}: options after -- go to a language model's environments", err=True
        )
        raise typer.Exit(EXIT_FATAL)
    file = _checkpoint(run_dir, None if checkpoint is None else Path(checkpoint), best)
    result = _or_exit(run_evaluation, cfg, run_dir, episodes, not stochastic, seed, file)
    recorded = None
    if video is not None:
        from tinker_atropos.launcher.video import record

        policy, _ = _or_exit(acting_policy, cfg, run_dir, file, seed)
        recorded = _or_exit(record, cfg, policy, video, video_episodes, video_frames, not stochastic, seed)
    if as_json:
        extra: dict[str, Any] = {}
        if recorded is not None:
            extra = {
                "video": str(recorded.mp4),
                "gif": str(recorded.gif),
                "video_frames": recorded.frames,
                "video_returns": recorded.episode_returns,
            }
        typer.echo(json.dumps({**result.as_dict(), **extra}))
        return
    if recorded is not None:
        typer.echo(
            f"{recorded.mp4} and {recorded.gif}: {recorded.frames} frames, returns "
            f"{', '.join(f'{r:.1f}' for r in recorded.episode_returns)}"
        )
    mode = "deterministic" if result.deterministic else "stochastic"
    typer.echo(
        f"{cfg.env.id}, policy version {result.policy_version} ({mode}): mean return {result.return_mean:.1f} "
        f"± {result.return_std:.1f} over {result.episodes} episodes (min {result.return_min:.1f}, max "
        f"{result.return_max:.1f}, mean length {result.length_mean:.0f})"
    )


def _evaluate_language_model(
    run_dir: Path,
    cfg: Config,
    config: Path | None,
    checkpoint: str | None,
    best: bool,
    base: bool,
    env_args: list[str],
    as_json: bool,
) -> None:
    """``eval`` of a language model: its table (or JSON rows), the rows appended to the run's metrics.jsonl."""
    from tinker_atropos.errors import EXIT_FATAL
    from tinker_atropos.launcher.lm_eval import evaluate_run, side_by_side

    if best:
        typer.echo(
            "error: --best names a control policy's checkpoint; give a language model's with --checkpoint",
            err=True,
        )
        raise typer.Exit(EXIT_FATAL)
    started = time.monotonic()
    where = str(config or run_dir / "config.yaml")
    rows = _or_exit(evaluate_run, cfg, run_dir, checkpoint, where, base, env_args)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for line in side_by_side(rows):
        typer.echo(line)
    typer.echo(f"{time.monotonic() - started:.0f} s in all; rows appended to {run_dir / 'metrics.jsonl'}")


@app.command()
def conformance(
    address: Annotated[
        str, typer.Argument(help="host:port of a server that claims the environment contract.")
    ],
    seed: Annotated[int, typer.Option(help="Seed of the sessions it opens and the random actions.")] = 0,
    max_steps: Annotated[int, typer.Option(min=1, help="Steps to wait for episodes to end.")] = 5000,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per row instead of a table.")
    ] = False,
) -> None:
    """Check that an env service keeps the environment contract (ours or a third party's): a pass/fail table;
    exit code 1 if a row failed. It needs free instances: run it before the rollouts connect."""
    import grpc
    from rich.console import Console
    from rich.table import Table

    from tinker_atropos.environment.conformance import Conformance

    checker = Conformance(address, seed, max_steps)
    try:
        checker.client.describe(timeout_s=5.0)
    except grpc.RpcError as error:  # nothing to check: one line, not ten rows of the same failure
        checker.close()
        typer.echo(
            f"error: no env service answers at {address}: {error.code().name}: {error.details()}", err=True
        )
        raise typer.Exit(2) from None
    try:
        rows = checker.run()
    finally:
        checker.close()
    if as_json:
        for row in rows:
            typer.echo(
                json.dumps(
                    {"check": row.name, "clause": row.clause, "passed": row.passed, "detail": row.detail}
                )
            )
    else:
        table = Table(title=f"environment contract at {address}")
        for column in ("clause", "result", "detail"):
            table.add_column(column)
        for row in rows:
            table.add_row(row.clause, "[green]pass[/]" if row.passed else "[red]FAIL[/]", row.detail)
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    raise typer.Exit(0 if all(row.passed for row in rows) else 1)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run folder (its metrics.jsonl, written by up).")],
    out: Annotated[Path | None, typer.Option(help="PNG to write (default RUN_DIR/report.png).")] = None,
) -> None:
    """Draw a run's learning curve, throughput, policy lag and trainer busy over time to a PNG."""
    from tinker_atropos.launcher.report import draw_report

    typer.echo(_or_exit(draw_report, run_dir, out))


ExportCheckpointOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint",
        help="Checkpoint file (default: the run's newest); for peft and merged, a checkpoint file of the Atropos "
        "loop (RUN_DIR/atropos) or of the Tinker API, or its tinker://MODEL/weights/NAME path.",
    ),
]


@app.command()
def export(
    run_dir: Annotated[
        Path, typer.Argument(help="Run folder (its config.yaml and checkpoints/, atropos/ or tinker/).")
    ],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="onnx or pt2 (torch.export): a run's control policy; peft (adapter folder) or merged (Hugging "
            "Face model folder): a language model trained by the Atropos loop or through the Tinker API.",
        ),
    ] = "onnx",
    out: Annotated[
        Path | None,
        typer.Option(
            help="File to write (default RUN_DIR/policy.onnx or .pt2), or folder (RUN_DIR/export-FORMAT)."
        ),
    ] = None,
    config: RunConfigOpt = None,
    checkpoint: ExportCheckpointOpt = None,
    best: BestOpt = False,
) -> None:
    """Write a run's deterministic policy, its observation normaliser folded in, for ONNX Runtime or torch; or a
    trained language model's LoRA adapter for PEFT, or the model with it folded in for transformers."""
    from tinker_atropos.errors import EXIT_FATAL
    from tinker_atropos.launcher.run_folder import run_policy
    from tinker_atropos.models.export import FORMATS, MissingExtra, export_policy
    from tinker_atropos.tinker_api.engine.weights_out import FORMATS as LM_FORMATS

    if fmt not in FORMATS + LM_FORMATS:
        typer.echo(f"error: --format {fmt!r} is not one of: {', '.join(FORMATS + LM_FORMATS)}", err=True)
        raise typer.Exit(EXIT_FATAL)
    if fmt in LM_FORMATS:
        _export_language_model(run_dir, fmt, out, config, checkpoint, best)
        return
    cfg = _run_config(run_dir, config)
    file = None if checkpoint is None else Path(checkpoint)
    found = _or_exit(run_policy, run_dir, _checkpoint(run_dir, file, best), cfg.trainer.model.network)
    target = out or run_dir / f"policy.{fmt}"
    try:
        paths = export_policy(found.model, target, fmt)
    except MissingExtra as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_FATAL) from None
    except OSError as error:
        why = (
            "a file stands where its folder would be"
            if isinstance(error, FileExistsError)
            else error.strerror
        )
        typer.echo(f"error: cannot write {target}: {why or error}", err=True)
        raise typer.Exit(1) from None
    written = " and ".join(str(path) for path in paths)
    typer.echo(
        f"{written}: policy version {found.version} of {found.checkpoint}, observations in, actions out"
    )


def _export_language_model(
    run_dir: Path, fmt: str, out: Path | None, config: Path | None, checkpoint: str | None, best: bool
) -> None:
    """``export --format peft|merged``: the language model of an Atropos loop's or a Tinker API's checkpoint to a
    folder, over the base the run's config (its ``trainer.tinker``: checkpoint folder, model folders) served."""
    from tinker_atropos.config import TinkerSection
    from tinker_atropos.errors import EXIT_FATAL
    from tinker_atropos.launcher.lm_export import checkpoint_of, export_language_model, tinker_root

    if best:
        typer.echo(
            "error: --best names a control policy's checkpoint; give a language model's with --checkpoint",
            err=True,
        )
        raise typer.Exit(EXIT_FATAL)
    if not run_dir.is_dir():
        typer.echo(f"error: run folder {run_dir} does not exist", err=True)
        raise typer.Exit(EXIT_FATAL)
    path = config or run_dir / "config.yaml"
    if config is not None or path.exists():
        tinker, where = read_config(path).trainer.tinker, str(path)
    else:  # a trainer started without `up`, which writes it: the built-in models only
        tinker, where = TinkerSection(), f"{path}, which does not exist"
    file = _or_exit(checkpoint_of, run_dir, tinker_root(run_dir, tinker.checkpoint_dir), checkpoint)
    target = out or run_dir / f"export-{fmt}"
    exported = _or_exit(export_language_model, file, fmt, target, tinker, where)
    what = "PEFT adapter" if fmt == "peft" else "Hugging Face model folder"
    typer.echo(
        f"{target}: {what} of {exported.base_model} from {exported.checkpoint} "
        f"({', '.join(path.name for path in exported.files)})"
    )


@app.command("secrets")
def make_secrets(
    folder: Annotated[Path, typer.Argument(help="Folder to write them to (made 0700).")],
    name: Annotated[
        list[str] | None,
        typer.Option("--name", help="Another host name or IP the certificate must cover (repeatable)."),
    ] = None,
    days: Annotated[int, typer.Option(min=1, help="Validity of the services' certificate.")] = 365,
    world_readable: Annotated[
        bool,
        typer.Option(
            "--world-readable",
            help="Keys, token and password 0644 instead of 0600: for Compose, whose bind-mounted secrets keep "
            "their owner, when the containers run as another user. Keep the folder itself private.",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace files already there.")] = False,
) -> None:
    """Make the token, a Redis password, a CA and the services' TLS certificate for a deployment."""
    from tinker_atropos.launcher.secrets import FILES, write_secrets

    try:
        paths = write_secrets(folder, tuple(name or ()), days, 0o644 if world_readable else 0o600, force)
    except FileExistsError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    for path in paths:
        typer.echo(f"{path}  {FILES[path.name]}")


@app.command("api-keys")
def api_keys() -> None:
    """Print the API keys of the run's Atropos trajectory API and inference endpoint, derived from its token
    (TA_TOKEN_FILE or TA_TOKEN): what an Atropos environment outside `up` needs (`up` writes them for its own)."""
    from tinker_atropos.frontends.http import run_key

    for purpose in ("atropos-api", "inference"):
        typer.echo(f"{purpose}  {_or_exit(run_key, purpose)}")


@app.command()
def health(address: Annotated[str, typer.Argument(help="host:port of a service.")]) -> None:
    """Exit 0 when the service's gRPC health check reports SERVING (for container health checks)."""
    from tinker_atropos.service_host import check_health

    serving = check_health(address)
    typer.echo("SERVING" if serving else "NOT_SERVING")
    raise typer.Exit(0 if serving else 1)


def main() -> None:
    """The command, every service process included (``up`` starts them through it): MuJoCo's warnings, if it is
    imported, go to the log, not to a ``MUJOCO_LOG.TXT`` in the working directory."""
    route_mujoco_warnings()
    app(prog_name="tinker-atropos")


if __name__ == "__main__":
    sys.exit(main())
