"""The ``trainer.tinker`` section: the Tinker training API the trainer serves, its models and its limits; and the
names of the language models the trainer builds itself, which ``trainer.atropos`` names too."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tinker_atropos.sections import Section

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
        description="Causal LMs served besides tiny-byte-lm and SmolLM2: a Tinker base-model name (neither of "
        "theirs) -> a local Hugging Face model folder (config.json, *.safetensors, tokenizer files) that "
        "transformers' AutoModelForCausalLM loads (Llama, Qwen2/Qwen3, Mistral, Gemma, ...). Listed by "
        "get_server_capabilities with its context length; checked at start (a folder missing, unreadable, of an architecture transformers cannot load, or bigger than "
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
        """A folder under a built-in model's name would take that model's place: served instead of it, while the
        name still means the built-in model to whatever reads it without this config."""
        for name in value:
            if (
                not name
                or name in (TINY_LM, SMOLLM2)
                or name.split("/")[0] in ("mlp-gaussian", "mlp-categorical")
            ):
                raise ValueError(
                    f"{name!r} names a model this server builds itself (a folder under it would replace that "
                    "model); choose another name"
                )
        return value
