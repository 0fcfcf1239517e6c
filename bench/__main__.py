"""The benchmarks, beside the product: ``python -m bench throughput | profile | learn | chaos | tinker | tenants | atropos | llm-rl | capacity`` from the repository
root (``make bench``, ``make bench-learn``, ``make chaos``, ``make bench-tinker``). Each runs the product as a user does, next to the peers
it is compared with, on one machine in one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tinker_atropos.launcher.cli import read_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.command()
def throughput(
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config (YAML).")] = Path(
        "configs/humanoid.yaml"
    ),
    phases: Annotated[
        str,
        typer.Option(
            help="Comma-separated: limit (MuJoCo's C++ mujoco.rollout, the machine's ceiling), raw, envpool, "
            "collect, collect_grpc, collect_secure, collect_grpc_secure, train, train_secure, sb3 (DummyVecEnv), "
            "sb3_subproc (SubprocVecEnv), sample_factory, scaling (a _secure phase: token, mutual TLS, Redis "
            "password, signed records)."
        ),
    ] = (
        "limit,raw,envpool,collect,collect_grpc,collect_secure,collect_grpc_secure,train,train_secure,sb3,"
        "sb3_subproc,sample_factory,scaling"
    ),
    env_id: Annotated[str | None, typer.Option(help="Overrides env.id.")] = None,
    instances: Annotated[int | None, typer.Option(min=1, help="Overrides env.instances.")] = None,
    window_s: Annotated[float, typer.Option(min=0.5, help="Measured seconds per phase.")] = 30.0,
    warmup_s: Annotated[float, typer.Option(min=0.0, help="Unmeasured seconds before each window.")] = 10.0,
    rounds: Annotated[
        int,
        typer.Option(
            min=1, help="Slices each window is cut into, alternated: steppers, then train with sb3."
        ),
    ] = 6,
    out: Annotated[Path, typer.Option(help="Folder for bench.json and the charts.")] = Path("bench/out"),
    scaling_services: Annotated[
        str, typer.Option(help="Env service counts of the scaling curve.")
    ] = "1,2,4,8",
    scaling_delay_ms: Annotated[
        float, typer.Option(min=0.0, help="Latency per batch step of the scaling env.")
    ] = 20.0,
    scaling_env_id: Annotated[str, typer.Option(help="Env behind the latency of the scaling curve.")] = (
        "Pendulum-v1"
    ),
    scaling_rollouts: Annotated[
        str, typer.Option(help="Rollout counts of the rollout-scaling curve (over the same env services).")
    ] = "1,2,4",
    scaling_inference_delay_ms: Annotated[
        float,
        typer.Option(min=0.0, help="Acting time per batch of each rollout on the rollout-scaling curve."),
    ] = 20.0,
) -> None:
    """Measure env steps/s of the physics limit, the simulator alone, EnvPool, collection, training, Stable-Baselines3
    PPO and Sample Factory."""
    from rich.console import Console

    from bench.phases import Timing
    from bench.throughput import BenchOptions, run_benchmark

    cfg = read_config(config)
    try:
        if env_id is not None:
            cfg.env.id = env_id
        if instances is not None:
            cfg.env.instances = instances
        options = BenchOptions(
            phases=tuple(p.strip() for p in phases.split(",") if p.strip()),
            timing=Timing(warmup_s=warmup_s, window_s=window_s, rounds=rounds),
            out=out,
            scaling_services=tuple(int(n) for n in scaling_services.split(",")),
            scaling_delay_s=scaling_delay_ms / 1000,
            scaling_env_id=scaling_env_id,
            scaling_rollouts=tuple(int(n) for n in scaling_rollouts.split(",")),
            scaling_inference_delay_s=scaling_inference_delay_ms / 1000,
        )
    except ValueError as error:  # a bad override or phase list; pydantic's errors are ValueErrors too
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    run_benchmark(cfg, options, Console(soft_wrap=True))


@app.command()
def profile(
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config (YAML).")] = Path(
        "configs/humanoid.yaml"
    ),
    seconds: Annotated[float, typer.Option(min=1, help="Sampled seconds.")] = 20.0,
    warmup_s: Annotated[float, typer.Option(min=0, help="Seconds run before sampling.")] = 10.0,
    learn: Annotated[
        bool, typer.Option(help="Profile while the trainer learns (else collection alone).")
    ] = False,
    out: Annotated[Path, typer.Option(help="Folder for profile.json.")] = Path("bench/out"),
) -> None:
    """Share of each line of the env services and the rollout in their CPU time, sampled by py-spy."""
    from rich.console import Console

    from bench.cpu_profile import run_profile

    run_profile(read_config(config), seconds, warmup_s, learn, out, Console(soft_wrap=True))


@app.command()
def learn(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")] = Path("configs/humanoid.yaml"),
    minutes: Annotated[float, typer.Option(min=0.05, help="Wall-clock budget of each run.")] = 20.0,
    seeds: Annotated[int, typer.Option(min=1, help="Runs per system, seeds run.seed, run.seed + 1, ...")] = 1,
    out: Annotated[Path, typer.Option(help="Folder for bench-learn.json and its chart.")] = Path("bench/out"),
    systems: Annotated[
        str,
        typer.Option(
            help="Comma-separated: tinker_atropos, sb3_ppo, sb3_sac, sf_appo_sync, sf_appo_async, and tinker_atropos@CONFIG "
            "(ours with another config). Default: ours and SB3 running the config's algorithm (SAC for sac, PPO otherwise)."
        ),
    ] = "",
) -> None:
    """Mean return after the same wall time: tinker-atropos against Stable-Baselines3, one after the other."""
    from rich.console import Console

    from bench.learn import LearnOptions, run_learning_benchmark

    try:
        chosen = tuple(s.strip() for s in systems.split(",") if s.strip()) or None
        options = LearnOptions(budget_s=minutes * 60, seeds=seeds, out=out, systems=chosen)
    except ValueError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    run_learning_benchmark(read_config(config), options, Console(soft_wrap=True))


@app.command()
def chaos(
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config (YAML).")] = Path(
        "configs/pendulum.yaml"
    ),
    total_steps: Annotated[int, typer.Option(min=1, help="Env steps of each of the two runs.")] = 150_000,
    chaos_interval: Annotated[
        float, typer.Option(min=0.5, help="Seconds between SIGKILLs in the chaos run.")
    ] = 8.0,
    out: Annotated[Path, typer.Option(help="Folder for chaos.json, chaos.png and the two runs.")] = Path(
        "bench/out"
    ),
) -> None:
    """Run `up` undisturbed and with chaos; learning curves of both and recovery times per killed service."""
    from rich.console import Console

    from bench.chaos import ChaosOptions, run_chaos

    options = ChaosOptions(total_steps=total_steps, chaos_interval_s=chaos_interval, out=out)
    run_chaos(read_config(config), options, Console(soft_wrap=True))


@app.command()
def tinker(
    iterations: Annotated[int, typer.Option(min=5, help="Measured round trips per case.")] = 60,
    out: Annotated[Path, typer.Option(help="Folder for bench-tinker.json.")] = Path("bench/out"),
) -> None:
    """Latency of forward_backward + optim_step through the tinker SDK against the same update in-process, then
    sampling tokens/s against Hugging Face generate on the same model and prompt."""
    from bench.tinker_latency import run

    run(out, iterations)


@app.command()
def tenants(
    flood: Annotated[int, typer.Option(min=1, help="Long samples the flooding client keeps queued.")] = 200,
    samples: Annotated[int, typer.Option(min=2, help="Short samples of the other client, timed.")] = 20,
    out: Annotated[Path, typer.Option(help="Folder for bench-tenants.json.")] = Path("bench/out"),
) -> None:
    """A client's short samples while another floods the sampler, then fresh clients after the flooder's SIGKILL."""
    from bench.tenants import run

    print(json.dumps(run(out, flood=flood, samples=samples), indent=2))


@app.command()
def atropos(
    seconds: Annotated[float, typer.Option(min=1, help="Measured seconds per round and server.")] = 10.0,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; servers alternate who goes first.")] = 2,
    posters: Annotated[int, typer.Option(min=1, help="Posting processes.")] = 2,
    stall: Annotated[
        float,
        typer.Option(min=0, help="Seconds of the stall soak (posting, no trainer pulling); 0 skips it."),
    ] = 60.0,
    out: Annotated[Path, typer.Option(help="Folder for bench-atropos.json.")] = Path("bench/out"),
) -> None:
    """Groups per second the Atropos trajectory API accepts and serves, then its memory with the trainer stalled:
    ours against atroposlib's reference."""
    from bench.atropos_api import Load, run

    run(out, Load(seconds=seconds, rounds=rounds, posters=posters, stall_seconds=stall))


@app.command("llm-rl")
def llm_rl(
    minutes: Annotated[
        str, typer.Option(help="Wall-clock minutes per system, e.g. trl=20,cookbook=10,atropos=15.")
    ] = "trl=20,cookbook=10,atropos=15",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; the order reverses each round.")] = 3,
    task: Annotated[
        str, typer.Option(help="single-digit or two-digit-plus-one (examples/atropos_arithmetic_env.py).")
    ] = "single-digit",
    out: Annotated[Path, typer.Option(help="Folder for bench-llm-rl-TASK.json and its chart.")] = Path(
        "bench/out"
    ),
) -> None:
    """Reinforcement learning of SmolLM2 on a sum: TRL's GRPOTrainer, the Tinker Cookbook's RL loop through our
    Tinker API, and the Atropos path through `up`, the same task, model, settings and budget."""
    from bench.llm_rl import SYSTEMS, TASKS, run, table

    if task not in TASKS:
        raise typer.BadParameter(f"--task: {task!r} is not one of {list(TASKS)}")

    try:
        budget = {name.strip(): float(value) for name, value in (p.split("=") for p in minutes.split(","))}
    except ValueError:
        raise typer.BadParameter(f"--minutes: give SYSTEM=MINUTES pairs, got {minutes!r}") from None
    unknown = set(budget) - set(SYSTEMS)
    if unknown:
        raise typer.BadParameter(f"--minutes: unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    data = run(out, budget, task, rounds)
    typer.echo(json.dumps(data["rounds"], indent=1))
    typer.echo(f"TRL's final reward (the mean of its last two minutes): {data.get('trl_final_reward')}")
    typer.echo(table(data))


@app.command()
def capacity(
    rollouts: Annotated[
        str, typer.Option(help="Rollout counts, raised until chunks/s stops growing.")
    ] = "1,2,4,8",
    fetchers: Annotated[
        str, typer.Option(help="Rollouts fetching each published weights record.")
    ] = "1,4,16,48",
    window: Annotated[float, typer.Option(min=1, help="Measured seconds per rollout count.")] = 20.0,
    weights_mb: Annotated[
        str, typer.Option(help="Sizes of the weights record, MB: Humanoid's policy, a larger one.")
    ] = "0.225,5",
    learners: Annotated[
        str,
        typer.Option(help="Learning phase: LEARNERSxTHREADS points, the first the others are compared with."),
    ] = "1x1,1x2,2x1",
    out: Annotated[Path, typer.Option(help="Folder for capacity.json.")] = Path("bench/out"),
) -> None:
    """Where the Redis every node shares saturates: N rollouts' chunks, leases and heartbeats and the trainer's
    reads against a Valkey with the run's ACL and signatures, then weights fetched by M rollouts at once; then the
    trainer's learning with one learner and with several (trainer.learners)."""
    from bench.capacity import CapacityOptions, run_capacity, table

    def counts(option: str, text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(n) for n in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise typer.BadParameter(f"--{option}: give comma-separated counts of 1 or more, got {text!r}")
        return values

    try:
        sizes = tuple(float(mb) for mb in weights_mb.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0:
        raise typer.BadParameter(f"--weights-mb: give comma-separated sizes above 0, got {weights_mb!r}")
    try:
        pairs = tuple(tuple(int(n) for n in point.split("x")) for point in learners.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise typer.BadParameter(
            f"--learners: give points as LEARNERSxTHREADS, e.g. 1x1,2x1, got {learners!r}"
        )
    options = CapacityOptions(
        counts("rollouts", rollouts), counts("fetchers", fetchers), window, weights_mb=sizes, learners=pairs
    )
    result = run_capacity(options, out)
    typer.echo(table(result))
    typer.echo(
        f"saturated at {result['saturated_at_rollouts']} rollouts; ACL denials: {result['acl_denials']}"
    )


@app.command()
def charts(
    result: Annotated[
        Path, typer.Argument(help="A bench.json written by `throughput` (here or on another machine).")
    ],
    out: Annotated[Path | None, typer.Option(help="Folder for the PNGs (default: beside the JSON).")] = None,
) -> None:
    """Print the table and draw the charts of a throughput result again: for one measured where nothing draws."""
    import json

    from rich.console import Console

    from bench.report import draw_charts, print_table

    data = json.loads(result.read_text())
    print_table(data, Console(soft_wrap=True))
    for path in draw_charts(data, out or result.parent):
        typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app(prog_name="python -m bench")
