"""The Atropos sections: ``atropos`` (the trajectory API service `up` starts, and its environments) and
``trainer.atropos`` (the trainer learning from that API's batches and serving inference to the environments)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from tinker_atropos.config.tinker import SMOLLM2, TINY_LM
from tinker_atropos.sections import Section


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
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay.")
    adam_beta2: float = Field(
        0.95,
        ge=0,
        lt=1,
        description="AdamW's second-moment decay: 0.95 as the Tinker Cookbook's and TRL's LLM RL recipes run "
        "it (0.999 lets a rare large gradient shrink the steps for hundreds of updates).",
    )
    grad_clip_norm: float = Field(
        1.0,
        ge=0,
        description="Clip the global gradient norm to this before each step; 0: no clipping (Tinker's AdamParams "
        "reads it so).",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank on base_model; 0 trains every parameter.")
    lora_train_unembed: bool = Field(
        True,
        description="LoRA adapts the unembedding (the output layer) too, besides every attention and MLP projection, "
        "as Tinker's LoraConfig does by default; TRL's GRPOTrainer cannot (it reads the layer's weight directly).",
    )
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
    eval_every_steps: int = Field(
        0,
        ge=0,
        description="Each environment runs its own evaluation (its BaseEnv's evaluate: held-out accuracy of the "
        "served model) every this many trainer steps, atroposlib's steps_per_eval; `up` writes each result to "
        "metrics.jsonl (an eval row) from RUN_DIR/evals. 0: never, whatever the environment's own default.",
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
