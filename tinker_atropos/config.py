"""The run configuration: one YAML file per run, validated here, printed back resolved at start.

Every field has a default, so a config only says what differs. Swapping the env, the model or the algorithm's
hyper-parameters is a change of this file, never of code.
"""

from __future__ import annotations

import difflib
import os
import re
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from tinker_atropos.errors import EnvError
from tinker_atropos.sections import Section


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?|auto", value):
        raise ValueError("allowed devices: cpu, cuda, cuda:N, auto")
    return value


Device = Annotated[str, AfterValidator(_device)]
Transport = Literal["auto", "grpc"]  # how a rollout reaches an env service: see RolloutSection.transport
Auto = Literal["auto"]  # a size the launcher computes from the machine (launcher/sizing.py)


class RunSection(Section):
    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Namespaces Redis keys (ta:{name}:…) and names the run folder, runs/{name}.",
    )
    seed: int = Field(1, ge=0, description="Seeds env instances, policy sampling and network initialisation.")
    report_interval_s: float = Field(2.0, gt=0, description="Seconds between progress reports of `up`.")
    return_window: int = Field(
        10,
        ge=1,
        le=1000,
        description="Latest episodes the reported return (and --target-return) averages: 10 for a control task's "
        "long episodes; a language model's answers are short and their rewards noisy, 64 or more. Redis keeps the "
        "latest 1000.",
    )
    write_failure_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long writes into the run folder (checkpoints, metrics.jsonl, TensorBoard) may keep "
        "failing (a full or read-only disk) before `up` stops the run with that reason; learning goes on "
        "meanwhile and each write is retried every 10 s.",
    )
    hang_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A service of `up` whose process runs but whose heartbeat the registry has not shown for "
        "this long (hung, or stopped by a signal) is killed and restarted as a crashed one is. Above "
        "redis.heartbeat_ttl_s.",
    )
    log_max_bytes: int = Field(
        20 * 1024 * 1024, ge=4096, description="A service's log under RUN_DIR/logs is rotated at this size."
    )
    log_backups: int = Field(
        3, ge=1, description="Rotated logs kept per service (NAME.log.1 the newest ... NAME.log.N)."
    )

    @field_validator("name")
    @classmethod
    def _a_folder_of_its_own(cls, name: str) -> str:
        # runs/.. is the folder that holds runs/: the run's checkpoints, secrets and logs would land beside the code
        if name in (".", ".."):
            raise ValueError(f"{name!r} is no folder of its own under runs/")
        return name


class RedisSection(Section):
    url: str | None = Field(
        None, description="redis:// URL of a Redis-protocol server; null = `up` starts an embedded Valkey."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between registry heartbeats.")
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="A service missing heartbeats this long is gone.")
    append_only: bool = Field(
        False,
        description="The embedded Valkey keeps an append-only file in the run folder: registry, weights "
        "and version survive a Redis restart.",
    )
    unreachable_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a starting service, or `up` at any time, waits for an unreachable Redis before "
        "it stops with an error (running services wait for it for ever).",
    )

    @field_validator("url")
    @classmethod
    def _parsable(cls, url: str | None) -> str | None:
        """A URL the Redis client can connect with: refused here, by field, rather than by every service."""
        if url is not None:
            from tinker_atropos.state.connection import check_url

            try:
                check_url(url)
            except ValueError as error:  # the message leaves the URL out: it may hold a password
                raise PydanticCustomError("redis_url", str(error)) from None
        return url


class EnvSection(Section):
    id: str = Field(
        "Pendulum-v1",
        description="A registered Gymnasium env id, 'module:EnvClass' (a gymnasium.Env subclass) or "
        "'module:registered-id' (the module registers it when imported).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for gymnasium.make.")
    backend: str = Field(
        "gymnasium",
        description="'gymnasium' steps gymnasium.make instances; 'mujoco' is the batched MuJoCo one; "
        "'module:Class' a third party's (a class built from a BatchSetup, environment/backends/base.py).",
    )
    instances: Annotated[int, Field(ge=1, le=4096)] | Auto = Field(
        16,
        description="Environment instances hosted by each env service; 'auto': a batch step of about 4 ms of "
        "the env's measured CPU time, within 4 and 64 (docs: Scaling, Sizing a run to the machine).",
    )
    threads: int = Field(
        2,
        ge=1,
        le=256,
        description="Simulation threads per session ('mujoco' backend; MuJoCo releases the GIL).",
    )
    services: Annotated[int, Field(ge=0, le=256)] | Auto = Field(
        1,
        description="Environment services that `up` starts (0: none, as in an Atropos run); 'auto': one per core "
        "left to the env services by the sizing rule.",
    )
    max_sessions: int | None = Field(
        None,
        ge=1,
        description="Streams an env service serves at once (local and gRPC together); past it a new one is "
        "refused with RESOURCE_EXHAUSTED. Null: one per instance.",
    )
    open_timeout_s: float = Field(
        10.0, gt=0, description="A stream that has not opened its session after this long is ended."
    )
    session_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="An open session without a step request for this long is ended and its instances freed "
        "(a rollout paused by flow control for longer reconnects).",
    )

    @property
    def session_limit(self) -> int:
        return self.max_sessions or self.instances

    @property
    def total_instances(self) -> int:
        """The instances of all the env services `up` starts: what the benchmark's peers step in one place."""
        return self.instances * self.services

    @field_validator("backend")
    @classmethod
    def _backend_form(cls, backend: str) -> str:
        # a name is looked up in the backends' registry, a 'module:Class' imported, where a batch is built
        # (check_env, before anything starts): the backends register themselves, as algorithms do
        if not re.fullmatch(r"[a-z][a-z0-9_]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*", backend):
            raise ValueError(
                "neither a registered backend's name (such as 'gymnasium', 'mujoco') nor 'module:Class'"
            )
        return backend

    @field_validator("id")
    @classmethod
    def _registered(cls, env_id: str) -> str:
        # A 'module:…' form is imported where the env is served (check_env), not by every reader of the config
        if ":" not in env_id:
            check_registered(env_id)
        return env_id


def check_registered(env_id: str) -> None:
    """Raise EnvError, with the closest registered ids, unless ``env_id`` is a registered Gymnasium id."""
    import gymnasium as gym

    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EnvError(f"unknown Gymnasium env id {env_id!r}{hint}")


class RolloutSection(Section):
    replicas: Annotated[int, Field(ge=0, le=256)] | Auto = Field(
        1,
        description="Rollout services that `up` starts (0: none, as in an Atropos run); they share the env "
        "services' session slots. 'auto': enough for the acting the sizing rule expects.",
    )
    sessions_per_env: int = Field(
        1,
        ge=1,
        le=64,
        description="Session slots of each env service, its instances split among them: the units the rollouts "
        "share out, each to one rollout (with more rollouts than slots, the extra ones stand by).",
    )
    chunk_length: int = Field(64, ge=1, le=4096, description="Steps per trajectory chunk.")
    device: Device = Field("cpu", description="Where policy inference runs: cpu, cuda, cuda:N or auto.")
    max_queued_chunks: int = Field(
        64, ge=1, description="Bound of the experience stream in Redis; older chunks are dropped and counted."
    )
    flow_control: Literal["pause", "drop"] = Field(
        "pause",
        description="'pause': stop collecting while a full batch (trainer.samples_per_update env steps) waits "
        "in the stream, so no step goes stale; 'drop': collect flat out, the stream bound drops the excess.",
    )
    reconnect_backoff_s: float = Field(0.2, gt=0, description="First reconnect delay; doubles up to 5 s.")
    lease_ttl_s: float = Field(
        3.0,
        ge=0.5,
        le=60,
        description="Life of a rollout's membership and session-slot leases in Redis, refreshed 3 times per TTL: "
        "a rollout that dies has its share taken over by the others within about this long.",
    )
    transport: Transport = Field(
        "auto",
        description="'auto': an env service on the same host (and network namespace) is stepped over its local "
        "Unix socket, the others over gRPC; 'grpc': always gRPC.",
    )


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


# the language models the trainer builds itself (training/served.py's LANGUAGE_MODELS: the tiny byte-level LM, SmolLM2
# when installed); a config names them before models are imported
TINY_LM, SMOLLM2 = "tiny-byte-lm", "HuggingFaceTB/SmolLM2-135M-Instruct"
SDK_HEARTBEAT_S = 10.0  # the tinker SDK's session heartbeat period (SESSION_HEARTBEAT_PERIOD_SEC, 0.38.0)


class TinkerSection(Section):
    enabled: bool = Field(
        False, description="Serve the Tinker training API (HTTP) beside the trainer's gRPC port."
    )
    host: str = Field("127.0.0.1", description="Address the Tinker API binds.")
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the Tinker API; 0 picks a free one (the trainer's status and registry entry carry the URL, tinker_api).",
    )
    api_keys_file: str | None = Field(
        None,
        description="File of allowed API keys, one 'tml-…' key per line (e.g. a mounted Secret). Null: the "
        "trainer writes one fresh key to <run folder>/tinker_api_keys.",
    )
    checkpoint_dir: str | None = Field(
        None, description="Where tinker:// checkpoints are written; null: <run folder>/tinker."
    )
    max_models: int = Field(8, ge=1, description="Training models held at once; creating more is refused.")
    base_models: dict[str, str] = Field(
        {},
        description="Causal LMs served besides tiny-byte-lm and SmolLM2: a Tinker base-model name -> a local Hugging "
        "Face model folder (config.json, *.safetensors, tokenizer files) that transformers' AutoModelForCausalLM "
        "loads (Llama, Qwen2/Qwen3, Mistral, Gemma, ...). Listed by get_server_capabilities with its context length; "
        "checked at start (a folder missing, unreadable, of an architecture transformers cannot load, or bigger than "
        "max_models_mb fails it with one line naming the path); its weights are read at its first model; nothing is "
        "downloaded.",
    )
    base_model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The weights' type of the base_models (and the adapters' computation on them; LoRA adapters "
        "themselves stay float32). auto: bfloat16 on a GPU, float32 on a CPU.",
    )
    max_adapters_per_base: int = Field(
        64,
        ge=1,
        description="LoRA models of one base model held at once (they share the base's frozen weights, one copy per "
        "base and device, each holding its adapters, their Adam moments and its activations); creating more is refused.",
    )
    batch_models: bool = Field(
        True,
        description="Run the forward_backward (and forward) requests of LoRA models of one base and one adapter "
        "layout that are ready together as one batched pass (the base's matmuls shared; each adapter its own "
        "gradients and optimizer), rather than each model in its own lane. Off: every model runs alone.",
    )
    max_models_mb: float | None = Field(
        None,
        gt=0,
        description="Memory the training models may take (MB): the shared bases loaded plus, per model, its own "
        "parameters (a LoRA model's adapters, a fully trained one's whole copy) four times over (the weights, their "
        "gradients, Adam's two moments); a create_model that would go past it is refused. Null: no limit.",
    )
    max_request_mb: float = Field(
        64.0,
        gt=0,
        description="Largest request body accepted (MiB); a larger one is answered 413 unread. A request's arrays "
        "may take as much once densified (a sparse tensor of a huge shape is refused with 400). The SDK is told to "
        "split a forward_backward's data into requests of at most three quarters of it.",
    )
    max_request_tokens: int = Field(
        65_536,
        ge=1,
        description="Token budget of one request: a forward_backward's tokens (steps, for a control policy), a "
        "sample's num_samples x (prompt + max_tokens); a larger request is refused with 400.",
    )
    max_request_s: float = Field(
        300.0,
        gt=0,
        description="Time budget of one request once it runs: a sample (checked between tokens) or a forward_backward "
        "(checked before its backward pass) past it fails as the client's error, the model unchanged.",
    )
    max_samplers: int = Field(
        4,
        ge=1,
        description="Sampler models (saved weights) kept loaded in the sampling process, the latest used; a LoRA "
        "sampler keeps only its adapter, its base shared. Samples of every sampler of one base decode in one batch.",
    )
    sampling_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads of the sampling process; none: every core the trainer may use. A decode "
        "batch of many rows is compute-bound, so it scales with cores; training still goes first (the batch "
        "pauses between two tokens while a training request runs).",
    )
    max_running_samples: int = Field(
        64,
        ge=1,
        description="Sample requests decoding at once, of every client (each joins its model's running batch "
        "between two tokens); more wait in the queue.",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="Requests a client may have waiting: a session's samples queued or running, and a model's "
        "numbered requests (forward_backward, optim_step, saves) past the last one applied. Past it the API answers "
        "429 naming this setting (the SDK retries). Sessions take turns: a newcomer's sample starts beside "
        "another session's queue, whatever its length.",
    )
    kv_cache_tokens: int = Field(
        32_768,
        ge=1,
        description="Positions of keys and values one model's running batch may hold (every row counted at the "
        "batch's longest, prompt + max_tokens): a sample request waits until it fits, and one that never could is "
        "refused. SmolLM2-135M takes 46 KB per position in float32. The Atropos loop's inference endpoint batches "
        "within it too.",
    )
    prefill_chunk_tokens: int = Field(
        256,
        ge=1,
        description="Prompt tokens read between two decoding steps of the running batch (of the Tinker API's "
        "sampling and the Atropos loop's inference endpoint): a long prompt is read in chunks, so it delays the "
        "samples in progress by one chunk at a time.",
    )
    long_poll_s: float = Field(
        20.0, gt=0, le=40, description="How long retrieve_future waits for a result before answering 408."
    )
    future_ttl_s: float = Field(3600.0, gt=0, description="How long an unretrieved result is kept.")
    ephemeral_weights_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="How long the weights of save_weights_and_get_sampling_client (saved under no name, not listed) "
        "are kept once no sample used them; each sample from them starts this time again.",
    )
    session_timeout_s: float = Field(
        SDK_HEARTBEAT_S * 4,
        ge=SDK_HEARTBEAT_S * 1.5,
        description=f"A session whose client sent no heartbeat for this long (the tinker SDK sends one every "
        f"{SDK_HEARTBEAT_S:g} s while its script runs, and never closes its session when the script ends) is "
        "finished, its models unloaded and their snapshots deleted (named checkpoints stay); checked every quarter "
        f"of it. At least {SDK_HEARTBEAT_S * 1.5:g} s: a shorter one would end live sessions.",
    )

    @field_validator("base_models")
    @classmethod
    def _base_model_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or name == TINY_LM or name.split("/")[0] in ("mlp-gaussian", "mlp-categorical"):
                raise ValueError(f"{name!r} names a model this server builds itself; choose another name")
        return value


class AtroposTrainerSection(Section):
    enabled: bool = Field(
        False,
        description="Learn from an Atropos trajectory API's batches (ours or atroposlib's run-api) on base_model, "
        "and serve its weights to the environments for sampling; needs trainer.experience_loop: false.",
    )
    base_model: str = Field(
        TINY_LM,
        min_length=1,
        description=f"The language model it trains and serves: {TINY_LM}, {SMOLLM2} (when installed), or a name of "
        "trainer.tinker.base_models (a local Hugging Face model folder); the environments read its tokenizer "
        "(the atroposlib --config file `up` writes names it).",
    )
    api_url: str | None = Field(
        None,
        description="Base URL of the trajectory API; null: the run's own atropos-api, found in the registry.",
    )
    batch_size: int = Field(
        32, ge=1, description="Sequences per batch, registered with the API (environments read it)."
    )
    max_token_len: int = Field(256, ge=2, description="Longest sequence, registered with the API.")
    num_steps: int = Field(
        1000, ge=1, description="Training steps registered with the API (environments read it)."
    )
    loss: Literal["importance_sampling", "ppo"] = Field(
        "importance_sampling", description="Tinker loss over the group-relative advantages."
    )
    learning_rate: float = Field(3e-3, gt=0, description="AdamW step size.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank on base_model; 0 trains every parameter.")
    inference_host: str = Field(
        "127.0.0.1", description="Address of the inference endpoint the environments sample from."
    )
    inference_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="Its port (OpenAI /v1/completions, /v1/chat/completions, SGLang /generate); 0: a free one.",
    )
    inference_api_keys_file: str | None = Field(
        None,
        description="File of the keys the inference endpoint accepts (Authorization: Bearer, as OpenAI clients send "
        "it), one per line; null: the key derived from the run's token, which `up` hands its environments.",
    )
    inference_max_request_mb: float = Field(
        8.0,
        gt=0,
        description="Largest request body the inference endpoint accepts (MiB); a larger one is answered 413. A "
        "prompt holds 65,536 tokens at most, about 0.5 MiB of JSON.",
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
        description="Write TensorBoard event files to RUN_DIR/tensorboard (episodic return and length, SPS, "
        "losses, policy version and lag, trainer busy): `tensorboard --logdir runs`.",
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
            errors.append(_error("extra_forbidden", "hyperparameters", "", data.pop("hyperparameters")))
        if "chunks_per_update" in data:
            data.pop("chunks_per_update")
            errors.append(_error("renamed", "chunks_per_update", _RENAMED_CHUNKS, None))
        reference = data.get("algorithm", "ppo")
        try:
            algorithm = algorithms.algorithm(reference) if isinstance(reference, str) else None
        except ValueError as error:
            errors.append(_error("unknown_algorithm", "algorithm", str(error), reference))
            algorithm = None
        hyperparameters = None
        for name in algorithms.names():
            if name in data and (algorithm is None or name != algorithm.name):
                section = data.pop(name)
                if algorithm is not None:
                    errors.append(
                        _error(
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
                errors += [_nested(item, algorithm.name) for item in error.errors()]
        trainer = None
        try:
            trainer = handler({**data, "hyperparameters": hyperparameters})
        except ValidationError as error:
            errors += [_nested(item) for item in error.errors()]
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
    return [_error("unserved_model", "", message, name) | {"loc": ("atropos", "base_model")}]


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
    return [_error("one_learner", "learners", message, trainer.learners)]


# their messages name what was given, or must not show it (a Redis URL may hold a password)
_SELF_EXPLAINED = {
    "renamed",
    "unknown_algorithm",
    "other_algorithm",
    "redis_url",
    "unserved_model",
    "one_learner",
}


def _error(kind: str, field: str, message: str, value: Any) -> InitErrorDetails:
    message = message.replace("{", "{{").replace("}", "}}")  # a template to pydantic
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=(field,), input=value)


def _nested(item: Any, *prefix: str) -> InitErrorDetails:
    """A line error of a nested validation, as one of the trainer section's (at ``prefix`` + its path)."""
    message = item["msg"].removeprefix("Value error, ")
    return _error(item["type"], "", message, item["input"]) | {"loc": (*prefix, *item["loc"])}


class AtroposSection(Section):
    enabled: bool = Field(
        False, description="`up` starts the Atropos trajectory API service (`tinker-atropos atropos-api`)."
    )
    host: str = Field("127.0.0.1", description="Address the trajectory API binds (--http-host overrides it).")
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Its port (atroposlib's default URL is http://localhost:8000; --http-port overrides it); 0: a free one.",
    )
    max_queue_sequences: int = Field(
        65536,
        ge=1,
        description="Sequences queued or buffered at most; a group past it is refused with 503 and Retry-After "
        "(environments retry, then drop it), counted as groups_refused_full.",
    )
    dedup_window: int = Field(
        4096,
        ge=1,
        description="A post whose group is one of the latest this many is a retry: answered, not queued twice.",
    )
    api_keys_file: str | None = Field(
        None,
        description="File of allowed API keys, one per line (X-API-Key, Authorization: Bearer, or the password of a "
        "http://atropos:KEY@host URL, what atroposlib's environments send); null: the key derived from the run's "
        "token, which `up` hands its environments. Without either, the service refuses to start unless --insecure.",
    )
    max_request_mb: float = Field(
        64.0,
        gt=0,
        description="Largest request body (MiB, once inflated if gzip); a larger one is answered 413.",
    )
    environments: list[list[str]] = Field(
        default_factory=list,
        description="Atropos environment programs `up` starts and restarts, one argv each; {python}, {api_url}, "
        "{inference_url} and {atropos_config} are replaced by this Python, the trajectory API's URL, trainer.atropos's "
        "inference URL, and an atroposlib --config file (mode 0600) holding both URLs with the run's keys. The two bare "
        "URLs carry no key: `up` refuses them unless --insecure.",
    )

    @field_validator("environments")
    @classmethod
    def _known_placeholders(cls, commands: list[list[str]]) -> list[list[str]]:
        for argv in commands:
            if not argv:
                raise ValueError("an environment command is empty")
            for arg in argv:
                unknown = set(re.findall(r"{(\w*)}", arg)) - {
                    "python",
                    "api_url",
                    "inference_url",
                    "atropos_config",
                }
                if unknown:
                    raise ValueError(
                        f"unknown placeholder(s) {sorted(unknown)} in {arg!r}; allowed: {{python}}, "
                        "{api_url}, {inference_url}, {atropos_config}"
                    )
        return commands


class Config(Section):
    run: RunSection = Field(default_factory=RunSection)
    redis: RedisSection = Field(default_factory=RedisSection)
    env: EnvSection = Field(default_factory=EnvSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    atropos: AtroposSection = Field(default_factory=AtroposSection)
    # what the launcher chose for the 'auto' sizes, and why (launcher/sizing.py); None: nothing was 'auto'
    _sizing: str | None = PrivateAttr(None)

    @property
    def sizing(self) -> str | None:
        return self._sizing

    @model_validator(mode="after")
    def _something_to_learn_from(self) -> Config:
        tinker, atropos = self.trainer.tinker, self.atropos
        if (
            tinker.enabled
            and atropos.enabled
            and atropos.port
            and (tinker.host, tinker.port) == (atropos.host, atropos.port)
        ):
            raise ValueError(
                f"trainer.tinker and atropos both bind {atropos.host}:{atropos.port}: give one another port"
            )
        if not (self.trainer.experience_loop or self.trainer.tinker.enabled or self.trainer.atropos.enabled):
            raise ValueError(
                "trainer.experience_loop, trainer.tinker.enabled and trainer.atropos.enabled are all "
                "false: the trainer would learn from nothing; enable one of them"
            )
        if self.trainer.experience_loop and self.trainer.atropos.enabled:
            raise ValueError(
                "trainer.atropos.enabled learns a language model from an Atropos API, "
                "trainer.experience_loop a policy from the env services: set experience_loop false"
            )
        if self.trainer.wandb.enabled and not self.trainer.tensorboard:
            raise ValueError("trainer.wandb.enabled needs trainer.tensorboard: W&B mirrors its event files")
        return self

    def to_yaml(self) -> str:
        """The resolved config as YAML, as it is printed and written to the run folder: a password in
        ``redis.url`` is masked (services get the real URL from ``TA_REDIS_URL``)."""
        from tinker_atropos.state.connection import masked

        data = self.model_dump(mode="json")
        if data["redis"]["url"]:
            data["redis"]["url"] = masked(data["redis"]["url"])
        return yaml.safe_dump(data, sort_keys=False)


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and what it accepts."""


def _known_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section at ``loc`` (a path of field names from the top of the config)."""
    from tinker_atropos.algorithms import base as algorithms

    model: type[BaseModel] = Config
    for name in loc:
        if model is TrainerSection and str(name) in algorithms.names():
            model = algorithms.algorithm(str(name)).hyperparameters
            continue
        field = model.model_fields.get(str(name))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        model = field.annotation
    return [name for name, field in model.model_fields.items() if not field.exclude]


_GOT = reprlib.Repr()  # a given value, shown bounded: it may be huge (a YAML alias bomb)
_GOT.maxlevel, _GOT.maxstring, _GOT.maxother = 2, 100, 100
_GOT.maxlist = _GOT.maxtuple = _GOT.maxdict = _GOT.maxset = 4


def _union_tag(part: Any) -> bool:
    """Whether a location part names a branch of a union (``constrained-int``, ``literal['auto']``), not a field."""
    return isinstance(part, str) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part)


def _merged_unions(items: list[Any]) -> list[Any]:
    """One error per field of a union type (e.g. a size or 'auto'), its branches' wants joined by 'or'."""
    merged: dict[tuple[Any, ...], Any] = {}
    for item in items:
        loc = tuple(item["loc"])
        if item["type"] == "extra_forbidden" or len(loc) < 2 or not _union_tag(loc[-1]):
            merged[loc] = item
            continue
        want = item["msg"].removeprefix("Value error, ")
        if loc[:-1] in merged:
            first = merged[loc[:-1]]
            first["msg"] += ", or " + want.removeprefix("Input should be ")
        else:
            merged[loc[:-1]] = {**item, "loc": loc[:-1], "msg": want}
    return list(merged.values())


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:" if source else "invalid config:"]
    for item in _merged_unions(error.errors()):
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        got = "" if item["type"] in ("missing", *_SELF_EXPLAINED) else f" (got {_GOT.repr(item['input'])})"
        if item["type"] == "extra_forbidden":
            known = _known_fields(item["loc"][:-1])
            close = difflib.get_close_matches(str(item["loc"][-1]), known, n=1)
            message = f"unknown field; did you mean {close[0]!r}?" if close else "unknown field"
            message += f" (fields here: {', '.join(known)})" if known and not close else ""
            got = ""
        lines.append(f"  {field}: {message}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def apply_settings(data: dict[str, Any], settings: Sequence[str]) -> None:
    """Write ``KEY=VALUE`` settings (``up --set``) into a config's data, where the schema then validates them:
    KEY is a dotted path of fields (``trainer.ppo.learning_rate``), VALUE is read as YAML (``3e-4``, ``true``,
    ``[64, 64]``, ``null``; quote it to keep a number a string). ConfigError for a setting that is no
    KEY=VALUE, whose VALUE is no YAML, or whose path goes through a value that is not a section."""
    for setting in settings:
        key, equals, text = setting.partition("=")
        path = key.strip().split(".")
        if not equals or not all(path):
            raise ConfigError(
                f"--set {setting!r}: expected KEY=VALUE, KEY a dotted path such as trainer.ppo.learning_rate"
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {setting!r}: the value is not valid YAML: {error}") from None
        section = data
        for depth, name in enumerate(path[:-1]):
            if section.get(name) is None:  # absent, or an empty section in the YAML
                section[name] = {}
            section = section[name]
            if not isinstance(section, dict):
                raise ConfigError(
                    f"--set {setting!r}: {'.'.join(path[: depth + 1])} is a value, not a section "
                    f"(it holds {_GOT.repr(section)})"
                )
        section[path[-1]] = value


def load_config(path: str | Path, settings: Sequence[str] = ()) -> Config:
    """Read and validate a YAML run config, with ``settings`` (``KEY=VALUE``, see ``apply_settings``) over it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    except RecursionError:  # PyYAML's parser recurses once per level of nesting
        raise ConfigError(f"config {path} nests too deeply to be a run config") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"config {where} is not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(data).__name__}")
    apply_settings(data, settings)
    return parse_config(data, f"{path} with --set {' '.join(settings)}" if settings else str(path))
