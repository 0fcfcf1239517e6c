"""Fast backend for gymnasium's MuJoCo locomotion envs: Humanoid, Ant, HalfCheetah, Hopper and Walker2d (v5).

gymnasium steps one env at a time from Python, so 16 Humanoids run no faster than one. Here the physics of all
instances runs on several threads without the GIL, and observations, rewards and terminations are computed with
numpy over the whole batch. The MuJoCo calls, the formulas and the reset-noise draws are gymnasium's own, so
under the same seeds and actions the results equal those of ``gymnasium.make(env_id, **kwargs)`` (the time limit
included); the tests compare the two.

Two physics engines: envs that read contact forces (Humanoid, Ant) keep one MjData per instance on Python threads,
the others run in one ``mujoco.batch.Batch``, whose C++ threads need no Python per instance at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium.envs.mujoco.mujoco_env import expand_model_path
from gymnasium.utils import seeding
from mujoco.batch import Batch

from tinker_atropos.environment.backends.base import BatchSetup
from tinker_atropos.protocol.steps import StepBatch

Fields = dict[str, np.ndarray]  # MjData field name -> its values for a batch of instances, [K, *field_shape]


class _ThreadedPhysics:
    """One MjData per instance, stepped on a thread pool (``mj_step`` releases the GIL).

    Needed when a task reads ``cfrc_ext``: gymnasium computes it with ``mj_rnePostConstraint`` on the MjData
    that ``mj_step`` leaves behind (with RK4, the last Runge-Kutta stage), which ``mujoco.batch`` does not keep.
    """

    def __init__(
        self,
        model: mujoco.MjModel,
        num_instances: int,
        frame_skip: int,
        num_threads: int,
        derived: tuple[str, ...],
    ) -> None:
        self._model = model
        self._frame_skip = frame_skip
        self._datas = [mujoco.MjData(model) for _ in range(num_instances)]
        names = ("qpos", "qvel", *derived)
        self.fields: Fields = {
            name: np.zeros((num_instances, *getattr(self._datas[0], name).shape)) for name in names
        }
        # MjData's arrays are views of its buffer, valid as long as it lives: fetched once, not on every step.
        self._ctrls = [data.ctrl for data in self._datas]
        self._copies = [
            [(self.fields[name][i], getattr(data, name)) for name in names]
            for i, data in enumerate(self._datas)
        ]
        # The calling thread is one of the num_threads.
        self._helpers = min(num_threads, num_instances) - 1
        self._pool = ThreadPoolExecutor(self._helpers) if self._helpers else None

    def step(self, ctrl: np.ndarray) -> None:
        # The threads take instances from one shared iterator (atomic under the GIL) rather than fixed halves:
        # an instance in heavy contact takes longer, and a fixed split would leave one thread idle meanwhile.
        todo = iter(range(len(self._datas)))
        pool = self._pool
        futures = [pool.submit(self._step_from, todo, ctrl) for _ in range(self._helpers)] if pool else []
        self._step_from(todo, ctrl)
        for future in futures:
            future.result()

    def _step_from(self, todo: Iterator[int], ctrl: np.ndarray) -> None:
        model, frame_skip = self._model, self._frame_skip
        for i in todo:
            data = self._datas[i]
            self._ctrls[i][:] = ctrl[i]
            mujoco.mj_step(model, data, nstep=frame_skip)
            mujoco.mj_rnePostConstraint(model, data)
            for dst, src in self._copies[i]:
                np.copyto(dst, src)

    def reset(self, ids: np.ndarray, qpos: np.ndarray, qvel: np.ndarray) -> None:
        """As ``MujocoEnv.reset`` then ``set_state``: defaults, the given state, ``mj_forward``."""
        for k, i in enumerate(ids):
            data = self._datas[i]
            mujoco.mj_resetData(self._model, data)
            data.qpos[:] = qpos[k]
            data.qvel[:] = qvel[k]
            mujoco.mj_forward(self._model, data)
            for dst, src in self._copies[i]:
                np.copyto(dst, src)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown()


class _BatchPhysics:
    """All instances in one ``mujoco.batch.Batch``, stepped by its C++ thread pool with no Python per instance.

    Bit-identical to one MjData per instance; used for tasks that read no field ``mj_rnePostConstraint`` computes.
    """

    def __init__(
        self,
        model: mujoco.MjModel,
        num_instances: int,
        frame_skip: int,
        num_threads: int,
        derived: tuple[str, ...],
    ) -> None:
        self._batch = Batch(model, num_instances, nthread=num_threads)
        self._frame_skip = frame_skip
        # Live views: state fields are the batch's state rows, derived fields are refreshed by each call.
        self.fields: Fields = {name: self._batch.bind(name) for name in ("qpos", "qvel", *derived)}
        self._ctrl = self._batch.bind("ctrl")

    def step(self, ctrl: np.ndarray) -> None:
        self._ctrl[:] = ctrl
        self._batch.step(nstep=self._frame_skip)

    def reset(self, ids: np.ndarray, qpos: np.ndarray, qvel: np.ndarray) -> None:
        self._batch.reset(ids, stage=mujoco.mjtStage.mjSTAGE_NONE)
        self.fields["qpos"][ids] = qpos
        self.fields["qvel"][ids] = qvel
        self._batch.forward(ids)

    def close(self) -> None:
        """Nothing to release: the batch's threads end with the object."""


class _Task:
    """What a gymnasium locomotion env computes around the physics, for a batch of instances.

    The reward is always ``(forward + healthy) - costs``, gymnasium's order of operations; an env without a
    notion of health (HalfCheetah) is always healthy and gets a healthy reward of 0.
    """

    defaults: ClassVar[dict[str, Any]]  # the env constructor's keyword arguments, with gymnasium's defaults
    derived: ClassVar[tuple[str, ...]] = ()  # MjData fields read besides qpos and qvel
    needs_contact_forces: ClassVar[bool] = False  # reads cfrc_ext, so needs mj_rnePostConstraint
    normal_qvel_noise: ClassVar[bool] = False  # reset noise on qvel: Gaussian, else uniform like qpos

    def __init__(self, params: dict[str, Any], model: mujoco.MjModel) -> None:
        self.params = params
        self.healthy_reward = float(params.get("healthy_reward", 0.0))
        self.terminate_when_unhealthy = bool(params.get("terminate_when_unhealthy", False))

    def observe(self, f: Fields) -> list[np.ndarray]:
        """The parts of the observation, [K, part] each, in gymnasium's order."""
        raise NotImplementedError

    def x_position(self, f: Fields) -> np.ndarray:
        """What the forward reward differentiates: the x of the root joint by default."""
        return f["qpos"][:, 0]

    def is_healthy(self, f: Fields) -> np.ndarray:
        return np.ones(len(f["qpos"]), dtype=bool)

    def costs(self, f: Fields, actions: np.ndarray) -> np.ndarray:
        """Control cost on the action as given (in its dtype, as gymnasium), plus any contact cost."""
        return self.params["ctrl_cost_weight"] * np.sum(np.square(actions), axis=1)


class _HalfCheetah(_Task):
    defaults: ClassVar[dict[str, Any]] = {
        "xml_file": "half_cheetah.xml",
        "frame_skip": 5,
        "forward_reward_weight": 1.0,
        "ctrl_cost_weight": 0.1,
        "reset_noise_scale": 0.1,
        "exclude_current_positions_from_observation": True,
    }
    normal_qvel_noise = True

    def observe(self, f: Fields) -> list[np.ndarray]:
        return [f["qpos"][:, int(self.params["exclude_current_positions_from_observation"]) :], f["qvel"]]


class _PlanarWalker(_Task):
    """Hopper and Walker2d observe alike: positions (less x) and velocities clipped to ±10."""

    def observe(self, f: Fields) -> list[np.ndarray]:
        skip = int(self.params["exclude_current_positions_from_observation"])
        return [f["qpos"][:, skip:], np.clip(f["qvel"], -10, 10)]


class _Hopper(_PlanarWalker):
    defaults: ClassVar[dict[str, Any]] = {
        "xml_file": "hopper.xml",
        "frame_skip": 4,
        "forward_reward_weight": 1.0,
        "ctrl_cost_weight": 1e-3,
        "healthy_reward": 1.0,
        "terminate_when_unhealthy": True,
        "healthy_state_range": (-100.0, 100.0),
        "healthy_z_range": (0.7, float("inf")),
        "healthy_angle_range": (-0.2, 0.2),
        "reset_noise_scale": 5e-3,
        "exclude_current_positions_from_observation": True,
    }

    def is_healthy(self, f: Fields) -> np.ndarray:
        qpos = f["qpos"]
        z, angle = qpos[:, 1], qpos[:, 2]
        state = np.concatenate((qpos, f["qvel"]), axis=1)[:, 2:]
        min_state, max_state = self.params["healthy_state_range"]
        min_z, max_z = self.params["healthy_z_range"]
        min_angle, max_angle = self.params["healthy_angle_range"]
        healthy_state = np.all((min_state < state) & (state < max_state), axis=1)
        return healthy_state & (min_z < z) & (z < max_z) & (min_angle < angle) & (angle < max_angle)


class _Walker2d(_PlanarWalker):
    defaults: ClassVar[dict[str, Any]] = {
        "xml_file": "walker2d_v5.xml",
        "frame_skip": 4,
        "forward_reward_weight": 1.0,
        "ctrl_cost_weight": 1e-3,
        "healthy_reward": 1.0,
        "terminate_when_unhealthy": True,
        "healthy_z_range": (0.8, 2.0),
        "healthy_angle_range": (-1.0, 1.0),
        "reset_noise_scale": 5e-3,
        "exclude_current_positions_from_observation": True,
    }

    def is_healthy(self, f: Fields) -> np.ndarray:
        z, angle = f["qpos"][:, 1], f["qpos"][:, 2]
        min_z, max_z = self.params["healthy_z_range"]
        min_angle, max_angle = self.params["healthy_angle_range"]
        return (min_z < z) & (z < max_z) & (min_angle < angle) & (angle < max_angle)


class _Ant(_Task):
    defaults: ClassVar[dict[str, Any]] = {
        "xml_file": "ant.xml",
        "frame_skip": 5,
        "forward_reward_weight": 1.0,
        "ctrl_cost_weight": 0.5,
        "contact_cost_weight": 5e-4,
        "healthy_reward": 1.0,
        "main_body": 1,
        "terminate_when_unhealthy": True,
        "healthy_z_range": (0.2, 1.0),
        "contact_force_range": (-1.0, 1.0),
        "reset_noise_scale": 0.1,
        "exclude_current_positions_from_observation": True,
        "include_cfrc_ext_in_observation": True,
    }
    derived = ("xpos", "cfrc_ext")
    needs_contact_forces = True
    normal_qvel_noise = True

    def __init__(self, params: dict[str, Any], model: mujoco.MjModel) -> None:
        super().__init__(params, model)
        self._main_body = model.body(params["main_body"]).id

    def _contact_forces(self, f: Fields) -> np.ndarray:
        return np.clip(f["cfrc_ext"], *self.params["contact_force_range"])

    def observe(self, f: Fields) -> list[np.ndarray]:
        parts = [
            f["qpos"][:, 2 * int(self.params["exclude_current_positions_from_observation"]) :],
            f["qvel"],
        ]
        if self.params["include_cfrc_ext_in_observation"]:
            parts.append(self._contact_forces(f)[:, 1:].reshape(len(f["qpos"]), -1))
        return parts

    def x_position(self, f: Fields) -> np.ndarray:
        return f["xpos"][:, self._main_body, 0]

    def is_healthy(self, f: Fields) -> np.ndarray:
        qpos = f["qpos"]
        finite = np.isfinite(qpos).all(axis=1) & np.isfinite(f["qvel"]).all(axis=1)
        min_z, max_z = self.params["healthy_z_range"]
        return finite & (min_z <= qpos[:, 2]) & (qpos[:, 2] <= max_z)

    def costs(self, f: Fields, actions: np.ndarray) -> np.ndarray:
        contact_cost = self.params["contact_cost_weight"] * np.sum(
            np.square(self._contact_forces(f)), axis=(1, 2)
        )
        return super().costs(f, actions) + contact_cost


class _Humanoid(_Task):
    defaults: ClassVar[dict[str, Any]] = {
        "xml_file": "humanoid.xml",
        "frame_skip": 5,
        "forward_reward_weight": 1.25,
        "ctrl_cost_weight": 0.1,
        "contact_cost_weight": 5e-7,
        "contact_cost_range": (-np.inf, 10.0),
        "healthy_reward": 5.0,
        "terminate_when_unhealthy": True,
        "healthy_z_range": (1.0, 2.0),
        "reset_noise_scale": 1e-2,
        "exclude_current_positions_from_observation": True,
        "include_cinert_in_observation": True,
        "include_cvel_in_observation": True,
        "include_qfrc_actuator_in_observation": True,
        "include_cfrc_ext_in_observation": True,
    }
    derived = ("xipos", "cinert", "cvel", "qfrc_actuator", "cfrc_ext")
    needs_contact_forces = True

    def __init__(self, params: dict[str, Any], model: mujoco.MjModel) -> None:
        super().__init__(params, model)
        self._mass = model.body_mass.copy()
        self._total_mass = np.sum(self._mass)

    def observe(self, f: Fields) -> list[np.ndarray]:
        p, n = self.params, len(f["qpos"])
        parts = [f["qpos"][:, 2 * int(p["exclude_current_positions_from_observation"]) :], f["qvel"]]
        if p["include_cinert_in_observation"]:
            parts.append(f["cinert"][:, 1:].reshape(n, -1))
        if p["include_cvel_in_observation"]:
            parts.append(f["cvel"][:, 1:].reshape(n, -1))
        if p["include_qfrc_actuator_in_observation"]:
            parts.append(f["qfrc_actuator"][:, 6:])
        if p["include_cfrc_ext_in_observation"]:
            parts.append(f["cfrc_ext"][:, 1:].reshape(n, -1))
        return parts

    def x_position(self, f: Fields) -> np.ndarray:
        """The x of the centre of mass, as gymnasium's ``mass_center``."""
        return np.sum(self._mass[:, None] * f["xipos"], axis=1)[:, 0] / self._total_mass

    def is_healthy(self, f: Fields) -> np.ndarray:
        min_z, max_z = self.params["healthy_z_range"]
        z = f["qpos"][:, 2]
        return (min_z < z) & (z < max_z)

    def costs(self, f: Fields, actions: np.ndarray) -> np.ndarray:
        """Humanoid's control cost reads ``data.ctrl``, the action as float64, unlike the others."""
        ctrl_cost = self.params["ctrl_cost_weight"] * np.sum(np.square(actions.astype(np.float64)), axis=1)
        contact_cost = self.params["contact_cost_weight"] * np.sum(np.square(f["cfrc_ext"]), axis=(1, 2))
        return ctrl_cost + np.clip(contact_cost, *self.params["contact_cost_range"])


_TASKS: dict[str, type[_Task]] = {
    "Ant-v5": _Ant,
    "HalfCheetah-v5": _HalfCheetah,
    "Hopper-v5": _Hopper,
    "Humanoid-v5": _Humanoid,
    "Walker2d-v5": _Walker2d,
}
# gymnasium.make's own arguments; the env checker only validates, so disabling it changes nothing here.
_MAKE_KWARGS = ("max_episode_steps", "disable_env_checker")


class MujocoBatch:
    """N instances of one gymnasium MuJoCo locomotion env, equal in results to N ``gymnasium.make`` envs."""

    def __init__(self, setup: BatchSetup) -> None:
        env_id, kwargs = setup.env_id, setup.kwargs
        num_instances, num_threads = setup.num_instances, setup.num_threads
        if env_id not in _TASKS:
            raise ValueError(
                f"the mujoco backend does not implement {env_id!r}; it supports {', '.join(sorted(_TASKS))}"
                " (use backend 'gymnasium' for other envs)"
            )
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        task_cls = _TASKS[env_id]
        unsupported = sorted(set(kwargs) - set(task_cls.defaults) - set(_MAKE_KWARGS))
        if unsupported:
            raise ValueError(
                f"the mujoco backend does not support the kwarg(s) {', '.join(map(repr, unsupported))} for "
                f"{env_id}; supported: {', '.join(sorted([*task_cls.defaults, *_MAKE_KWARGS]))}"
                " (use backend 'gymnasium' for the others)"
            )
        params = {**task_cls.defaults, **{k: v for k, v in kwargs.items() if k not in _MAKE_KWARGS}}
        self._max_episode_steps = self._time_limit(env_id, kwargs.get("max_episode_steps"))

        model = mujoco.MjModel.from_xml_path(expand_model_path(params["xml_file"]))
        frame_skip = int(params["frame_skip"])
        self._task = task_cls(params, model)
        physics_cls = _ThreadedPhysics if task_cls.needs_contact_forces else _BatchPhysics
        self._physics = physics_cls(model, num_instances, frame_skip, num_threads, task_cls.derived)
        self._dt = model.opt.timestep * frame_skip
        self._forward_reward_weight = params["forward_reward_weight"]
        self._noise_scale = params["reset_noise_scale"]
        self._init_qpos = model.qpos0.copy()
        self._init_qvel = np.zeros(model.nv)

        self.num_instances = num_instances
        low, high = model.actuator_ctrlrange.copy().astype(np.float32).T
        self.action_space = gym.spaces.Box(low=low, high=high, dtype=np.float32)
        obs_size = sum(part.shape[1] for part in self._task.observe(self._physics.fields))
        self.observation_space = gym.spaces.Box(low=-np.inf, high=np.inf, shape=(obs_size,), dtype=np.float64)
        self.observation_layout = None  # the locomotion tasks observe a Box

        # Unseeded until reset(seed), as a gymnasium env: then instance i draws from seeding.np_random(seed + i).
        self._rngs = [np.random.default_rng() for _ in range(num_instances)]
        self._elapsed = np.zeros(num_instances, dtype=np.int64)
        # x_position after the last step or reset, which the next forward reward differentiates.
        self._x: np.ndarray | None = None

    @staticmethod
    def _time_limit(env_id: str, max_episode_steps: Any) -> int | None:
        """gymnasium.make's rule: None means the registered limit, -1 none, else a positive integer."""
        if max_episode_steps is None:
            return gym.spec(env_id).max_episode_steps
        if max_episode_steps == -1:
            return None
        if not isinstance(max_episode_steps, int) or max_episode_steps <= 0:
            raise ValueError(f"max_episode_steps must be a positive integer or -1, got {max_episode_steps!r}")
        return max_episode_steps

    def reset(self, seed: int | None) -> np.ndarray:
        if seed is not None:
            self._rngs = [seeding.np_random(seed + i)[0] for i in range(self.num_instances)]
        self._reset_instances(np.arange(self.num_instances))
        self._x = np.array(self._task.x_position(self._physics.fields))
        return self._observe(self._physics.fields)

    def step(self, actions: np.ndarray) -> StepBatch:
        if self._x is None:
            raise RuntimeError("MujocoBatch.step called before reset")
        task, fields = self._task, self._physics.fields
        self._physics.step(np.asarray(actions, dtype=np.float64))

        x_after = np.array(task.x_position(fields))  # a copy: the next step overwrites the fields
        x_velocity = (x_after - self._x) / self._dt
        healthy = task.is_healthy(fields)
        forward_reward = self._forward_reward_weight * x_velocity
        rewards = (forward_reward + healthy * task.healthy_reward) - task.costs(fields, actions)
        terminated = ~healthy if task.terminate_when_unhealthy else np.zeros(self.num_instances, dtype=bool)
        self._elapsed += 1
        if self._max_episode_steps is None:
            truncated = np.zeros(self.num_instances, dtype=bool)
        else:
            truncated = self._elapsed >= self._max_episode_steps

        observations = self._observe(fields)
        done = np.flatnonzero(terminated | truncated)
        final_observations = observations[done]
        if done.size:
            self._reset_instances(done)
            reset_fields = {name: values[done] for name, values in fields.items()}
            observations[done] = self._observe(reset_fields)
            x_after[done] = task.x_position(reset_fields)
        self._x = x_after
        return StepBatch(
            observations=observations,
            rewards=rewards.astype(np.float32),
            terminated=terminated,
            truncated=truncated,
            final_observations=final_observations,
            final_indices=done.astype(np.int32),
        )

    def reset_instances(self, indices: np.ndarray) -> np.ndarray:
        if self._x is None:
            raise RuntimeError("MujocoBatch.reset_instances called before reset")
        indices = np.asarray(indices)
        self._reset_instances(indices)
        reset_fields = {name: values[indices] for name, values in self._physics.fields.items()}
        self._x[indices] = self._task.x_position(reset_fields)
        return self._observe(reset_fields)

    def _observe(self, fields: Fields) -> np.ndarray:
        return np.concatenate(self._task.observe(fields), axis=1, dtype=np.float32)

    def _reset_instances(self, ids: np.ndarray) -> None:
        """gymnasium's ``reset_model``: qpos noise first, then qvel noise, from each instance's own RNG."""
        scale = self._noise_scale
        qpos = np.empty((len(ids), len(self._init_qpos)))
        qvel = np.empty((len(ids), len(self._init_qvel)))
        for k, i in enumerate(ids):
            rng = self._rngs[i]
            qpos[k] = self._init_qpos + rng.uniform(low=-scale, high=scale, size=qpos.shape[1])
            if self._task.normal_qvel_noise:
                qvel[k] = self._init_qvel + scale * rng.standard_normal(qvel.shape[1])
            else:
                qvel[k] = self._init_qvel + rng.uniform(low=-scale, high=scale, size=qvel.shape[1])
        self._physics.reset(ids, qpos, qvel)
        self._elapsed[ids] = 0

    def close(self) -> None:
        self._physics.close()
