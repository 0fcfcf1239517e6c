"""Who the trajectory API serves: the trainer's registration (its batch size, token length, W&B names, starting
step) and each env's (its id, name, weight and group size; connected or not), with what an env asks of its
status. Each change is written to Redis before the mirror takes it (``redis_state.py``)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict
from typing import Any

from tinker_atropos.frontends.atropos.packing import EnvEntry, Queued, env_status
from tinker_atropos.frontends.atropos.redis_state import RedisState


class Registrations:
    """The reference server's registration and env routes over the run's state; each returns its JSON answer."""

    def __init__(self, state: RedisState) -> None:
        self.state = state

    def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        m = self.state.fresh()
        if not m.registered:  # a later trainer's registration changes nothing, as in the reference
            step = registration["starting_step"]
            meta = {"registered": 1, "started": 0, "step": step, "registration": json.dumps(registration)}
            self.state.client.hset(self.state.key("meta"), mapping=meta)
            m.registered, m.started, m.step, m.registration = True, False, step, registration
        return {"uuid": uuid.uuid4().int}  # as the reference: a random 128-bit id that nothing later uses

    def info(self) -> dict[str, Any]:
        m = self.state.fresh()
        r = m.registration if m.registered else {}
        return {"batch_size": r.get("batch_size", -1), "max_token_len": r.get("max_token_len", -1)}

    def wandb_info(self) -> dict[str, Any]:
        m = self.state.fresh()
        r = m.registration if m.registered else {}
        return {"group": r.get("wandb_group"), "project": r.get("wandb_project")}

    def register_env(self, fields: dict[str, Any]) -> dict[str, Any]:
        m = self.state.fresh()
        if not m.started:
            return {"status": "wait for trainer to start"}
        name = fields["desired_name"]
        entry = EnvEntry(
            max_context_len=fields["max_token_length"],
            weight=fields["weight"] if fields["weight"] is not None else 1.0,
            desired_name=name,
            real_name=f"{name}_{sum(e.desired_name == name for e in m.envs)}",
            registered_id=len(m.envs),
            last_update=time.time(),
            connected=True,
            min_batch_allocation=fields.get("min_batch_allocation"),
            group_size=fields["group_size"],
        )
        self.state.client.rpush(self.state.key("envs"), json.dumps(asdict(entry)))
        m.envs.append(entry)
        r = m.registration
        return {
            "status": "success",
            "env_id": entry.registered_id,
            "wandb_name": entry.real_name,
            "checkpoint_dir": r.get("checkpoint_dir", ""),
            "starting_step": m.step,
            "checkpoint_interval": r.get("save_checkpoint_interval"),
            "num_steps": r.get("num_steps"),
        }

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        m = self.state.fresh()
        if not 0 <= env_id < len(m.envs):
            return {"status": "failure", "error": "list index out of range"}
        m.envs[env_id].connected = False
        self._save_env(env_id)
        return {"status": "success"}

    def status_env(self, env_id: int) -> dict[str, Any] | None:
        """None for an env id never registered."""
        m = self.state.fresh()
        if not 0 <= env_id < len(m.envs):
            return None
        queued = [Queued(e.size, e.env_id) for e in m.queue]
        answer, group_size = env_status(queued, m.envs, env_id, m.step, m.registration.get("batch_size", 0))
        if group_size != m.envs[env_id].group_size:
            m.envs[env_id].group_size = group_size
            self._save_env(env_id)
        return answer

    def _save_env(self, env_id: int) -> None:
        """The mirror's entry of ``env_id``, changed, written over its entry in Redis."""
        self.state.client.lset(
            self.state.key("envs"), env_id, json.dumps(asdict(self.state.mirror.envs[env_id]))
        )
