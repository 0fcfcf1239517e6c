"""CleanRL's ``sac_continuous_action.py`` as one file, its environments running in tinker-atropos env services:
``envs`` is a ``tinker_atropos.RemoteVectorEnv`` instead of a ``gym.vector.SyncVectorEnv``, nothing else changes.

    tinker-atropos env --config configs/pendulum.yaml --redis-url redis://127.0.0.1:6379/0 &
    python examples/cleanrl_sac_remote.py --run pendulum --redis-url redis://127.0.0.1:6379/0

The maths is CleanRL's: twin soft Q-networks regressed on r + γ(1 - terminated)(min Q' - α log π), a tanh-squashed
Gaussian actor maximising min Q - α log π, α tuned towards an entropy of -|A|, Polyak-averaged targets. The env
services reset an ended episode in the same step (SAME_STEP), so the next observation stored for an ended
episode is ``infos["final_obs"]``, and the returns printed are the env services' own (``infos["episode"]``).
The last line printed is JSON: the episodes' returns and the steps taken.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinker_atropos import RemoteVectorEnv

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="pendulum", help="the run whose env services to step")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--total-timesteps", type=int, default=20_000)
    parser.add_argument("--learning-starts", type=int, default=1_000)
    parser.add_argument("--buffer-size", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--tau", type=float, default=0.005)
    parser.add_argument("--policy-lr", type=float, default=3e-4)
    parser.add_argument("--q-lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--target-return",
        type=float,
        default=None,
        help="stop once the mean return of the last 10 episodes reaches it",
    )
    return parser.parse_args()


class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim + act_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, act], 1))


class Actor(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: np.ndarray, high: np.ndarray) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.mean, self.log_std = nn.Linear(hidden, act_dim), nn.Linear(hidden, act_dim)
        self.register_buffer("scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def get_action(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled action in the env's bounds, and its log-probability under the squashed Gaussian."""
        h = self.trunk(obs)
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # in [min, max]
        normal = torch.distributions.Normal(self.mean(h), log_std.exp())
        x = normal.rsample()  # reparameterised: gradients flow through the sample
        y = torch.tanh(x)
        log_prob = normal.log_prob(x) - torch.log(self.scale * (1 - y.pow(2)) + 1e-6)  # the tanh's Jacobian
        return y * self.scale + self.bias, log_prob.sum(1, keepdim=True)


class ReplayBuffer:
    def __init__(self, size: int, obs_dim: int, act_dim: int) -> None:
        self.obs, self.next_obs = np.zeros((size, obs_dim), np.float32), np.zeros((size, obs_dim), np.float32)
        self.actions, self.rewards = np.zeros((size, act_dim), np.float32), np.zeros(size, np.float32)
        self.terminated, self.size, self.position = np.zeros(size, np.float32), 0, 0

    def add(self, obs, next_obs, actions, rewards, terminated) -> None:  # noqa: ANN001 - one row per env
        for row in range(len(obs)):
            i = self.position
            self.obs[i], self.next_obs[i], self.actions[i] = obs[row], next_obs[row], actions[row]
            self.rewards[i], self.terminated[i] = rewards[row], terminated[row]
            self.position, self.size = (i + 1) % len(self.obs), min(self.size + 1, len(self.obs))

    def sample(self, n: int, rng: np.random.Generator) -> list[torch.Tensor]:
        i = rng.integers(0, self.size, n)
        rows = (self.obs[i], self.next_obs[i], self.actions[i], self.rewards[i], self.terminated[i])
        return [torch.as_tensor(x) for x in rows]


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)

    envs = RemoteVectorEnv(run=args.run, redis_url=args.redis_url, seed=args.seed)  # the one changed line
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    actor = Actor(obs_dim, act_dim, args.hidden, low, high)
    qf1, qf2 = SoftQNetwork(obs_dim, act_dim, args.hidden), SoftQNetwork(obs_dim, act_dim, args.hidden)
    qf1_target, qf2_target = (
        SoftQNetwork(obs_dim, act_dim, args.hidden),
        SoftQNetwork(obs_dim, act_dim, args.hidden),
    )
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam([*qf1.parameters(), *qf2.parameters()], lr=args.q_lr)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr)
    target_entropy = -float(act_dim)
    log_alpha = torch.zeros(1, requires_grad=True)
    alpha_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr)
    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim)

    returns: list[float] = []
    start = time.monotonic()
    obs, _ = envs.reset(seed=args.seed)
    steps = 0
    while steps < args.total_timesteps:
        if steps < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions = actor.get_action(torch.as_tensor(obs))[0].numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        steps += envs.num_envs
        for i in np.flatnonzero(infos.get("_episode", [])):
            returns.append(float(infos["episode"]["r"][i]))
            print(f"step={steps} episodic_return={returns[-1]:.1f}", flush=True)
        real_next_obs = next_obs.copy()  # an ended episode's next observation is its last, not the reset one
        for i in np.flatnonzero(infos.get("_final_obs", [])):
            real_next_obs[i] = infos["final_obs"][i]
        rb.add(obs, real_next_obs, actions, rewards, terminations)
        obs = next_obs
        if (
            args.target_return is not None
            and len(returns) >= 10
            and np.mean(returns[-10:]) >= args.target_return
        ):
            break
        if steps < args.learning_starts:
            continue

        for _ in range(envs.num_envs):  # one update per env step, as CleanRL's single env does
            b_obs, b_next_obs, b_actions, b_rewards, b_terminated = rb.sample(args.batch_size, rng)
            alpha = log_alpha.exp().item()
            with torch.no_grad():
                next_actions, next_log_pi = actor.get_action(b_next_obs)
                min_q_next = torch.min(
                    qf1_target(b_next_obs, next_actions), qf2_target(b_next_obs, next_actions)
                )
                target = b_rewards + (1 - b_terminated) * args.gamma * (
                    min_q_next - alpha * next_log_pi
                ).view(-1)
            q_loss = F.mse_loss(qf1(b_obs, b_actions).view(-1), target) + F.mse_loss(
                qf2(b_obs, b_actions).view(-1), target
            )
            q_optimizer.zero_grad()
            q_loss.backward()
            q_optimizer.step()

            pi, log_pi = actor.get_action(b_obs)
            actor_loss = (alpha * log_pi - torch.min(qf1(b_obs, pi), qf2(b_obs, pi))).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()

            alpha_loss = (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()
            alpha_optimizer.zero_grad()
            alpha_loss.backward()
            alpha_optimizer.step()

            for net, target_net in ((qf1, qf1_target), (qf2, qf2_target)):
                for param, target_param in zip(net.parameters(), target_net.parameters(), strict=True):
                    target_param.data.mul_(1 - args.tau).add_(args.tau * param.data)
    envs.close()
    print(json.dumps({"steps": steps, "seconds": round(time.monotonic() - start, 1), "returns": returns}))


if __name__ == "__main__":
    main()
