"""Sampling sessions (``sampler:<id>``: the base model and the weights they sample from), and the lane their
requests run in."""

from __future__ import annotations

from tinker_atropos.tinker_api.store.namespace import Keys

SAMPLER_LANE = "sampler:"  # the lane of the requests that sample from one model: this and its weights' path


def sampler_lane(base_model: str, model_path: str | None) -> str:
    return f"{SAMPLER_LANE}{model_path or base_model}"


class Samplers(Keys):
    def add(self, sampler_id: str, base_model: str, model_path: str | None) -> None:
        self.client.hset(
            self._key("sampler", sampler_id),
            mapping={"base_model": base_model, "model_path": model_path or ""},
        )

    def get(self, sampler_id: str) -> tuple[str, str | None] | None:
        """(base model, weights' tinker path or None) of a sampling session; None for no such session."""
        base, path = self.client.hmget(self._key("sampler", sampler_id), ["base_model", "model_path"])
        return None if base is None else (base.decode(), path.decode() or None if path else None)
