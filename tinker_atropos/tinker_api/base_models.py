"""Which model a Tinker base-model name builds, and the models ``get_server_capabilities`` lists: the control policy
of the run's env (``mlp-gaussian/<env.id>`` or ``mlp-categorical/<env.id>``, its spec from the env's spaces and the
config's ``trainer.model``), the tiny byte-level LM, SmolLM2 when installed, and the local model folders of
``trainer.tinker.base_models``. A name is only ever looked up among these: no part of it reaches an import (an env
id of the form ``module:Class`` would import the module). The models themselves and the calling convention each
follows are the training floor's (``training/served.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch

from tinker_atropos.config import ModelSection, TinkerSection
from tinker_atropos.environment.envs import env_maker
from tinker_atropos.errors import FatalError
from tinker_atropos.models import hf_lm, smollm2, tiny_lm
from tinker_atropos.models.mlp import mlp_spec
from tinker_atropos.tinker_api.wire import WireError
from tinker_atropos.training.served import (
    LANGUAGE_MODELS,
    TINY_LM,
    LanguageModel,
    PolicyModel,
    ServedModel,
    register_folder,
)

POLICY_KINDS = {"mlp-gaussian": gym.spaces.Box, "mlp-categorical": gym.spaces.Discrete}


@dataclass(frozen=True)
class Capability:
    name: str
    trainable: bool
    sampleable: bool
    max_context_length: int | None


def unknown(base_model: object, served: Iterable[str]) -> WireError:
    """The refusal of a base-model name that is none of the ``served`` models, naming them."""
    return WireError(
        f"unknown base model {base_model!r}: this server serves {', '.join(served)} (get_server_capabilities)"
    )


def policy_spec(base_model: str, model: ModelSection) -> dict[str, Any]:
    """The spec of the control policy ``base_model`` names (``mlp-gaussian/Pendulum-v1``), from the env's
    spaces; WireError for a name that is no such policy. Only for the run's env (``build`` checks)."""
    kind, _, env_id = base_model.partition("/")
    try:
        env = env_maker(env_id)()
    except Exception as error:
        raise WireError(f"base model {base_model!r}: cannot build env {env_id!r}: {error}") from None
    try:
        observation_space, action_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(action_space, POLICY_KINDS[kind]):
        other = next(k for k, space in POLICY_KINDS.items() if isinstance(action_space, space))
        raise WireError(f"{env_id} acts in {action_space}: its policy is {other}/{env_id}")
    return mlp_spec(
        observation_space, action_space, model, normalize_observations=False, normalize_returns=False
    )


# models are built one at a time: their initial weights come from torch's global RNG (seeded for a policy, the
# tiny LM's own seed under fork_rng, LoRA's A without a seed), which two lanes building at once would interleave
_BUILDING = threading.Lock()


def build(
    base_model: str,
    lora: dict[str, Any],
    model: ModelSection,
    device: torch.device,
    seed: int,
    env_id: str | None,
) -> ServedModel:
    """A fresh model of ``base_model``: a served language model, or the policy of the run's env ``env_id`` (None:
    no policy in this process); WireError naming the served models for any other name. Checked here too, not only
    by the routes: the name is read back from Redis, which a route's check does not guard."""
    if base_model in LANGUAGE_MODELS:
        if LANGUAGE_MODELS[base_model][0] is smollm2.load and not smollm2.available():
            raise WireError(
                f"{base_model} is not installed on this trainer (see docs/tinker.md, The Tinker API: Models)"
            )
        with _BUILDING:
            try:
                return LanguageModel(base_model, lora, device)
            except hf_lm.FolderError as error:  # its folder changed since the start: unreadable weights
                raise WireError(f"{base_model}: {error}") from None
    policies = [f"{kind}/{env_id}" for kind in POLICY_KINDS] if env_id else []
    if base_model not in policies:
        raise unknown(base_model, [*LANGUAGE_MODELS, *policies])
    spec = policy_spec(base_model, model)
    with _BUILDING:
        return PolicyModel(base_model, spec, device, seed)


def dtype(section: TinkerSection, device: torch.device) -> torch.dtype:
    """The weights' type of the configured base models on ``device``."""
    if section.base_model_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return hf_lm.DTYPES[section.base_model_dtype]


def register(section: TinkerSection, device: torch.device) -> list[Capability]:
    """Serve ``trainer.tinker.base_models`` (in each process that builds models: the worker's, the sampler's);
    FatalError, one line naming the folder, for one that cannot be served or is bigger than ``max_models_mb``."""
    listed = []
    for name, path in section.base_models.items():
        try:
            folder = register_folder(name, path, dtype(section, device))
        except hf_lm.FolderError as error:
            raise FatalError(f"trainer.tinker.base_models[{name!r}]: {error}") from None
        size_mb = folder.parameters * dtype(section, device).itemsize / 1e6
        if section.max_models_mb is not None and size_mb > section.max_models_mb:
            raise FatalError(
                f"trainer.tinker.base_models[{name!r}]: model folder {folder.path}: its weights take "
                f"{size_mb:,.0f} MB, more than trainer.tinker.max_models_mb ({section.max_models_mb:,.0f})"
            )
        listed.append(Capability(name, True, True, folder.context))
    return listed


def capabilities(
    env_id: str, action_space: gym.Space | None, configured: list[Capability] = ()
) -> list[Capability]:
    """What ``get_server_capabilities`` lists: the run's env policy (when its spaces are known) and the LMs."""
    listed = [Capability(TINY_LM, True, True, tiny_lm.TinyLMConfig.max_seq_len)]
    names = {c.name for c in configured}
    if smollm2.available() and smollm2.NAME not in names:
        listed.append(Capability(smollm2.NAME, True, True, 2048))
    listed += configured
    if action_space is not None:
        kind = next((k for k, space in POLICY_KINDS.items() if isinstance(action_space, space)), None)
        if kind is not None:
            listed.insert(0, Capability(f"{kind}/{env_id}", True, False, None))
    return listed
