"""PPO on Pendulum-v1 written only against the tinker SDK and ``tinker_atropos.experience_source``: our env and rollout
services collect with the policy this loop last saved, the trainer's Tinker API learns.

    tinker-atropos up examples/tinker_pendulum.yaml &     # env, rollout, trainer serving the Tinker API
    source runs/tinker-pendulum/client.env                 # once up printed "Tinker API at ..."
    python examples/tinker_ppo_loop.py

(``client.env``, which ``up`` writes to the run folder, exports what joining the run takes: ``TINKER_BASE_URL``
and ``TINKER_API_KEY``, the Redis URL ``TA_REDIS_URL`` and the files of its password and of the run's token, which
signs the experience. ``--base-url`` and ``--redis-url`` override the first and the third.)

The maths is CleanRL's ``ppo_continuous_action.py``: GAE over each trajectory, advantages normalised per batch,
the clipped surrogate (Tinker's ``ppo`` loss) plus the critic's squared error on the returns, several epochs of
minibatches per batch. Tinker's losses are sums over targets: advantages and the value coefficient are divided
by the minibatch size to make them the usual means.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import tinker
from tinker import types

from tinker_atropos.experience_source import ExperienceSource, Trajectory


@dataclass
class Args:
    base_url: str = os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000")
    redis_url: str = os.environ.get("TA_REDIS_URL", "redis://127.0.0.1:6379/0")
    run: str = "tinker-pendulum"
    env_id: str = "Pendulum-v1"
    steps_per_batch: int = 2048
    minibatches: int = 4  # 512-step minibatches: half the round trips of 8, and -700 sooner in wall time
    epochs: int = 10
    learning_rate: float = 1e-3
    gamma: float = 0.9
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    reward_scale: float = 0.1  # Pendulum's rewards, -16..0 per step, to about -1.6..0
    max_grad_norm: float = 0.5
    target_return: float = -400.0
    max_minutes: float = 10.0


def gae(t: Trajectory, gamma: float, lam: float, reward_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns [T, N] of one trajectory, bootstrapped from its last observation's value and, where
    an episode was truncated, from the value of its final observation."""
    rewards = t.rewards * reward_scale
    next_values = np.concatenate([t.values[1:], t.bootstrap_values[None]])
    next_values = np.where(t.truncated, t.truncation_values, next_values)
    not_done = 1.0 - (t.terminated | t.truncated)
    advantages, last = np.zeros_like(rewards), np.zeros_like(rewards[0])
    for step in reversed(range(len(rewards))):
        bootstrap = np.where(t.terminated[step], 0.0, next_values[step])
        delta = rewards[step] + gamma * bootstrap - t.values[step]
        last = delta + gamma * lam * not_done[step] * last
        advantages[step] = last
    return advantages, advantages + t.values


def datums(batch: list[Trajectory], args: Args) -> list[types.Datum]:
    """One datum per instance of each trajectory: T steps of (observation, action, log-prob, advantage, return)."""
    rows = []
    for t in batch:
        advantages, returns = gae(t, args.gamma, args.gae_lambda, args.reward_scale)
        for n in range(t.rewards.shape[1]):
            rows.append(
                (t.observations[:, n], t.actions[:, n], t.log_probs[:, n], advantages[:, n], returns[:, n])
            )
    all_adv = np.concatenate([r[3] for r in rows])
    mean, std = all_adv.mean(), all_adv.std() + 1e-8
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints([0] * len(obs)),
            loss_fn_inputs={
                "observations": obs,
                "actions": act,
                "logprobs": logp,
                "advantages": ((adv - mean) / std).astype(np.float32),
                "returns": ret,
            },
        )
        for obs, act, logp, adv, ret in rows
    ]


def main(args: Args) -> float:
    service = tinker.ServiceClient(base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY"))
    policy = service.create_lora_training_client(base_model=f"mlp-gaussian/{args.env_id}").result()
    policy.save_weights_for_sampler("v0").result()  # the rollouts start acting with it
    source = ExperienceSource(args.redis_url, args.run)
    adam = types.AdamParams(
        learning_rate=args.learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=args.max_grad_norm
    )
    start, version, mean_return = time.monotonic(), source.policy_version() or 0, float("-inf")
    while time.monotonic() - start < args.max_minutes * 60:
        data = datums(source.batch(args.steps_per_batch, min_policy_version=version - 1), args)
        steps = sum(d.model_input.length for d in data)
        size = max(1, len(data) // args.minibatches)
        config = {
            "clip_low_threshold": 1 - args.clip,
            "clip_high_threshold": 1 + args.clip,
            "value_coef": args.value_coef / (steps / args.minibatches),
        }
        scale = args.minibatches / steps  # advantages as means over a minibatch
        order = np.random.default_rng(version).permutation
        futures = []
        for _ in range(args.epochs):
            perm = order(len(data))
            for first in range(0, len(data), size):
                minibatch = [data[i] for i in perm[first : first + size]]
                scaled = [
                    types.Datum(
                        model_input=d.model_input,
                        loss_fn_inputs={
                            **d.loss_fn_inputs,
                            "advantages": d.loss_fn_inputs["advantages"].to_numpy() * scale,
                        },
                    )
                    for d in minibatch
                ]
                futures.append(policy.forward_backward(scaled, "ppo", config))
                futures.append(policy.optim_step(adam))
        losses = [f.result().metrics["loss:sum"] for f in futures[::2]]
        for f in futures[1::2]:
            f.result()
        version += 1
        policy.save_weights_for_sampler(f"v{version}").result()  # the rollouts act with it from now on
        returns = source.recent_returns(32)
        mean_return = float(np.mean(returns)) if returns else float("-inf")
        print(
            f"version {version:4d}  steps {steps}  loss {np.mean(losses):8.4f}  mean return {mean_return:8.1f}  "
            f"{time.monotonic() - start:6.1f} s",
            flush=True,
        )
        if len(returns) >= 16 and mean_return >= args.target_return:
            print(f"reached {args.target_return} in {time.monotonic() - start:.0f} s", flush=True)
            break
    return mean_return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    main(Args(**vars(parser.parse_args())))
