"""The ``trainer`` section and the sections of learning inside it (``model``, ``checkpoint``, ``wandb``,
``evaluation``); the algorithm's own section, ``trainer.<algorithm>``, is validated here by the algorithm's model."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from tinker_atropos.config.atropos import AtroposTrainerSection
from tinker_atropos.config.field_types import Device
from tinker_atropos.config.tinker import SMOLLM2, TINY_LM, TinkerSection
from tinker_atropos.config.validation_errors import line_error, nested_error
from tinker_atropos.sections import Section


class ModelSection(Section):
    hidden_sizes: list[int] = Field(
        [64, 64], min_length=1, description="Widths of the actor and critic MLPs."
    )
    activation: Literal["tanh", "relu"] = Field("tanh", description="Hidden-layer activation.")
    init_log_std: float = Field(0.0, description="Initial log standard deviation of Gaussian actions.")
    network: str = Field(
        "mlp",
        description="'mlp', or 'module:Class' of your own network: a subclass of "
        "tinker_atropos.models.mlp.ActorCritic built from the same spec (docs: Algorithms and models, Plugging in a model); the "
        "trainer and every rollout import it.",
    )

    @field_validator("network")
    @classmethod
    def _network_reference(cls, reference: str) -> str:
        if reference != "mlp" and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", reference):
            raise ValueError(
                f"must be 'mlp' or 'module:Class' (e.g. my_package.nets:ConvActorCritic), not {reference!r}"
            )
        return reference


class CheckpointSection(Section):
    every_updates: int = Field(
        50,
        ge=1,
        description="Write a checkpoint once this many updates have passed since the last one (looked at "
        "ten times a second).",
    )
    every_seconds: float = Field(
        60.0, gt=0, description="Also write one when this long has passed since the last checkpoint."
    )
    keep: int = Field(3, ge=1, description="Checkpoints kept; older ones are deleted.")


class WandbSection(Section):
    enabled: bool = Field(
        False,
        description="Mirror the trainer's TensorBoard events to Weights & Biases (needs the wandb extra); "
        "off: wandb is not even imported, so no network call is made.",
    )
    project: str = Field("tinker-atropos", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); null: the account's default.")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: written under RUN_DIR/wandb only, for `wandb sync` later."
    )


class EvaluationSection(Section):
    every_updates: int = Field(
        0,
        ge=0,
        description="Evaluate the policy every this many updates on the run's evaluation env service "
        "(one `up` starts; rollouts never use it), in a thread beside learning; 0: never.",
    )
    episodes: int = Field(10, ge=1, description="Whole episodes per evaluation, an equal share per instance.")
    instances: int = Field(
        4, ge=1, le=256, description="Instances of the evaluation env service `up` starts."
    )
    deterministic: bool = Field(
        True, description="Act with the policy's mode, as `tinker-atropos eval` does."
    )


class TrainerSection(Section):
    algorithm: str = Field(
        "ppo",
        description="Learning algorithm: a registered name (ppo, appo, sac), or 'module:name' for one the module registers "
        "when imported. Its hyper-parameters are the section of that name (trainer.ppo, trainer.appo, trainer.sac).",
    )
    device: Device = Field("cpu", description="Where learning runs: cpu, cuda, cuda:N or auto.")
    samples_per_update: int = Field(
        4096,
        ge=1,
        description="Env steps in one PPO batch, whatever the deployment: the trainer takes whole chunks until "
        "it holds at least this many.",
    )
    max_policy_lag: int = Field(
        2, ge=0, description="Chunks acted by a policy older than this many versions are rejected."
    )
    learners: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes that compute each update together (ppo, appo): each learns from its share of every "
        "batch, and each minibatch step's gradient is averaged over all of them; the trainer is one and starts the "
        "others beside it (each with torch_threads threads, on a GPU of its own where the machine has several).",
    )
    torch_threads: int | None = Field(
        1,
        ge=1,
        description="Intra-op threads of the trainer's torch; null: every core the trainer may use (a trainer "
        "alone on its machine, e.g. serving a language model, as against one beside a run's env services).",
    )
    max_nonfinite_updates: int = Field(
        5,
        ge=1,
        description="Updates in a row whose loss or parameters come out NaN or infinite (each one undone) "
        "before the trainer stops with an error.",
    )
    experience_loop: bool = Field(
        True,
        description="Learn from the experience stream with trainer.algorithm. False: the trainer only serves "
        "the Tinker API, and learning is what its clients do (they read the stream with tinker_atropos.experience_source).",
    )
    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files to RUN_DIR/tensorboard: `tensorboard --logdir runs`. A control "
        "run's episodic return and length, SPS, losses, policy version and lag, trainer busy; the Atropos loop's "
        "reward, answer length, sampler-learner KL, entropy, clip fraction, loss, gradient norm, tokens/s, "
        "weight-sync time and evaluations; each Tinker client's model's loss, tokens and gradient norm.",
    )
    wandb: WandbSection = Field(default_factory=WandbSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    tinker: TinkerSection = Field(default_factory=TinkerSection)
    atropos: AtroposTrainerSection = Field(default_factory=AtroposTrainerSection)
    model: ModelSection = Field(default_factory=ModelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    # The algorithm's own section, validated by the model it registered; written as ``trainer.<algorithm>``.
    hyperparameters: SerializeAsAny[BaseModel] | None = Field(default=None, exclude=True)

    def threads(self) -> int:
        """``torch_threads``, null resolved to the cores this process may use."""
        return self.torch_threads or len(os.sched_getaffinity(0))

    @model_validator(mode="wrap")
    @classmethod
    def _algorithm_section(
        cls, data: Any, handler: ModelWrapValidatorHandler[TrainerSection]
    ) -> TrainerSection:
        """Validate ``trainer.<algorithm>`` by the algorithm's model, refusing another algorithm's section by
        name; errors of both parts are reported together, at their full paths."""
        if not isinstance(data, dict) or isinstance(data.get("hyperparameters"), BaseModel):
            return handler(data)  # an instance, or a model_copy's fields
        from tinker_atropos.algorithms import base as algorithms

        data, errors = dict(data), []
        if "hyperparameters" in data:  # no field of a config file: the algorithm's section is trainer.<name>
            errors.append(line_error("extra_forbidden", "hyperparameters", "", data.pop("hyperparameters")))
        if "chunks_per_update" in data:
            data.pop("chunks_per_update")
            errors.append(line_error("renamed", "chunks_per_update", _RENAMED_CHUNKS, None))
        reference = data.get("algorithm", "ppo")
        try:
            algorithm = algorithms.algorithm(reference) if isinstance(reference, str) else None
        except ValueError as error:
            errors.append(line_error("unknown_algorithm", "algorithm", str(error), reference))
            algorithm = None
        hyperparameters = None
        for name in algorithms.names():
            if name in data and (algorithm is None or name != algorithm.name):
                section = data.pop(name)
                if algorithm is not None:
                    errors.append(
                        line_error(
                            "other_algorithm",
                            name,
                            f"the section of algorithm {name!r}, but trainer.algorithm is {reference!r}",
                            section,
                        )
                    )
        if algorithm is not None:
            try:
                hyperparameters = algorithm.hyperparameters.model_validate(data.pop(algorithm.name, {}))
            except ValidationError as error:
                errors += [nested_error(item, algorithm.name) for item in error.errors()]
        trainer = None
        try:
            trainer = handler({**data, "hyperparameters": hyperparameters})
        except ValidationError as error:
            errors += [nested_error(item) for item in error.errors()]
        if trainer is not None and trainer.atropos.enabled:
            errors += _unserved_base_model(trainer.atropos.base_model, trainer.tinker)
        if trainer is not None and trainer.learners > 1:
            errors += _unshared_update(trainer)
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return trainer

    @model_serializer(mode="wrap")
    def _with_algorithm_section(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        from tinker_atropos.algorithms import base as algorithms

        data[algorithms.algorithm(self.algorithm).name] = self.hyperparameters.model_dump(mode="json")
        return data


_RENAMED_CHUNKS = (
    "chunks_per_update was replaced by samples_per_update, the env steps of one batch (chunks x "
    "rollout.chunk_length x instances per session), so that it no longer changes with the instances of each env "
    "service"
)


def _unserved_base_model(name: str, tinker: TinkerSection) -> list[InitErrorDetails]:
    """The error of a ``trainer.atropos.base_model`` no model of the trainer's (none when it is served)."""
    served = [TINY_LM, SMOLLM2, *tinker.base_models]
    if name in served:
        return []
    message = (
        f"{name!r} is no model this trainer serves; one of {', '.join(served)} (a local model folder: name "
        "it in trainer.tinker.base_models)"
    )
    return [line_error("unserved_model", "", message, name) | {"loc": ("atropos", "base_model")}]


def _unshared_update(trainer: TrainerSection) -> list[InitErrorDetails]:
    """The error of ``trainer.learners`` > 1 for an algorithm whose update is not minibatches of the clipped
    objective (the only one the learners split)."""
    from tinker_atropos.algorithms.ppo.config import ClippedObjectiveConfig

    if isinstance(trainer.hyperparameters, ClippedObjectiveConfig):
        return []
    message = (
        f"{trainer.learners} learners split the minibatches of ppo or appo; trainer.algorithm "
        f"{trainer.algorithm!r} learns with 1"
    )
    return [line_error("one_learner", "learners", message, trainer.learners)]
