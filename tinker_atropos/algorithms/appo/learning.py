"""V-trace (Espeholt et al. 2018, IMPALA), top to bottom: value targets and policy-gradient advantages for
experience acted by an older policy (the behaviour policy mu), corrected towards the current one (pi) by truncated
importance weights. The update itself is PPO's clipped objective over these advantages (``ppo.learning``)."""

from __future__ import annotations

import numpy as np


def compute_vtrace(
    behaviour_log_probs: np.ndarray,
    target_log_probs: np.ndarray,
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    truncation_values: np.ndarray,
    bootstrap_values: np.ndarray,
    gamma: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    trace_lambda: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """V-trace over time-major [T, N] arrays; returns (value targets v_t, advantages).

    ``values`` and ``bootstrap_values`` are the *current* critic's V(x_t) and V(x_T). With rho_t = min(rho_bar,
    pi/mu) and c_t = lambda * min(c_bar, pi/mu):

        delta_t = rho_t * (r_t + gamma * V(x_t+1) - V(x_t))
        v_t - V(x_t) = delta_t + gamma * c_t * (v_t+1 - V(x_t+1))
        advantage_t = rho_t * (r_t + gamma * v_t+1 - V(x_t))

    Episode ends as in GAE: a terminated step has no future; a truncated one has its reward completed by gamma *
    V(final observation) (``truncation_values``, the acting critic's), and nothing is carried across either.
    """
    ratio = np.exp(target_log_probs - behaviour_log_probs)
    rho = np.minimum(rho_bar, ratio)
    c = trace_lambda * np.minimum(c_bar, ratio)
    rewards = rewards + gamma * truncation_values * truncated
    goes_on = 1.0 - (terminated | truncated).astype(np.float32)

    next_values = np.concatenate([values[1:], bootstrap_values[None]])
    deltas = rho * (rewards + gamma * goes_on * next_values - values)
    corrections = np.zeros_like(values, dtype=np.float32)  # v_t - V(x_t)
    carried = np.zeros(values.shape[1], dtype=np.float32)
    for t in reversed(range(values.shape[0])):
        carried = deltas[t] + gamma * goes_on[t] * c[t] * carried
        corrections[t] = carried
    targets = values + corrections

    next_targets = np.concatenate([targets[1:], bootstrap_values[None]])
    advantages = rho * (rewards + gamma * goes_on * next_targets - values)
    return targets.astype(np.float32), advantages.astype(np.float32)
