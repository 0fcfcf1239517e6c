"""A tiny byte-level causal language model, built locally from a seed: nothing is ever downloaded.

It gives the Tinker-compatible training API (forward_backward / optim_step / sample) a real token path that
runs in milliseconds on a CPU: a byte tokenizer, a pre-LayerNorm GPT, LoRA adapters, and the token-level
functions the API needs (log-probs of targets, of a prompt, and sampling with a KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinker_atropos.models import lora


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; two special tokens follow. No vocabulary file, nothing to download."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens are skipped; bytes that are not valid UTF-8 (a sample cut mid-character) become U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> Path:
        """The same tokenizer as a Hugging Face tokenizer folder, for programs that load one by path with
        ``AutoTokenizer.from_pretrained`` (atroposlib's environments do): byte b is token b, ``<bos>`` 256,
        ``<eos>`` 257, and a plain chat template. Built here, so nothing is downloaded."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        # GPT-2's printable stand-ins for bytes, which the ByteLevel pre-tokenizer maps each byte to
        printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
        stand_ins, shifted = {}, 0
        for byte in range(256):
            if byte in printable:
                stand_ins[byte] = chr(byte)
            else:
                stand_ins[byte], shifted = chr(256 + shifted), shifted + 1
        vocab = {stand_ins[b]: b for b in range(256)} | {"<bos>": self.bos_id, "<eos>": self.eos_id}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(["<bos>", "<eos>"])
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(directory))
        return Path(directory)


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """A conversation as the tiny LM's prompt: what ``CHAT_TEMPLATE`` renders with ``add_generation_prompt``."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant: "


# role: content lines, then "assistant: " to prompt a reply
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = ByteTokenizer.vocab_size
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 512
    mlp_ratio: int = 4
    seed: int = 0  # the initial weights are a function of the config alone


class KVCache:
    """The keys and values of every layer at the positions seen so far, in buffers sized for the whole sequence
    (prompt and every token to sample), so a decoding step appends in place."""

    def __init__(self, config: TinyLMConfig, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        shape = (config.n_layers, batch, config.n_heads, length, config.d_model // config.n_heads)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled

    def repeat(self, n: int) -> KVCache:
        """The cache of a batch of one, for ``n`` sequences that go on from it."""
        copy = KVCache.__new__(KVCache)
        copy.keys = self.keys.expand(-1, n, -1, -1, -1).clone()
        copy.values = self.values.expand(-1, n, -1, -1, -1).clone()
        copy.length = self.length
        return copy


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model {config.d_model} is not a multiple of n_heads {config.n_heads}")
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        causal = True
        # a prompt from position 0 (causal), or one new token that sees every earlier one
        if cache is not None:
            start = cache.length
            if start and T > 1:
                raise ValueError("the KV cache takes one token at a time after the prompt")
            cache.keys[layer, :, :, start : start + T] = k
            cache.values[layer, :, :, start : start + T] = v
            k, v = cache.keys[layer, :, :, : start + T], cache.values[layer, :, :, : start + T]
            causal = start == 0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # [B, heads, T, head_dim]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A GPT: token + learned position embeddings, pre-LayerNorm blocks, a final LayerNorm and an untied
    ``lm_head`` (untied so that LoRA can adapt the unembedding on its own)."""

    eos_id = ByteTokenizer.eos_id

    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TinyLMConfig()
        # every module is built and initialised under the config's seed, leaving the caller's RNG untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size)
            self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2's init: N(0, 0.02), zero biases, and the residual projections scaled by 1/sqrt(2 n_layers) so
        the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                proj.weight.mul_(1 / math.sqrt(2 * self.config.n_layers))

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of the next token at every position of ``tokens`` [B, T]; with ``cache``, the
        tokens follow the positions it holds, and it takes theirs."""
        start = 0 if cache is None else cache.length
        seq_len = tokens.shape[1]
        if start + seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + seq_len} tokens is longer than max_seq_len {self.config.max_seq_len}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(start, start + seq_len, device=tokens.device))
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.length += seq_len
        return self.lm_head(self.ln_f(x))

    def decode(
        self, tokens: torch.Tensor, cache: KVCache | None, length: int = 0
    ) -> tuple[torch.Tensor, KVCache]:
        """``Decoder.decode``: a new cache of ``length`` positions when ``cache`` is None."""
        if cache is None:
            weight = self.tok_emb.weight  # never wrapped in LoRA
            cache = KVCache(self.config, tokens.shape[0], length or self.config.max_seq_len, weight.device,
                            weight.dtype)  # fmt: skip
        return self(tokens, cache)[:, -1], cache

    @staticmethod
    def repeat_cache(cache: KVCache, n: int) -> KVCache:
        return cache.repeat(n)


# ---- LoRA ---------------------------------------------------------------------------------------------------


def add_lora(
    model: TinyCausalLM,
    rank: int,
    *,
    alpha: float | None = None,
    seed: int | None = None,
    train_attn: bool = True,
    train_mlp: bool = True,
    train_unembed: bool = True,
) -> list[nn.Parameter]:
    """``lora.wrap`` of the tiny LM's layers that Tinker's ``LoraConfig`` selects; the adapters' parameters."""
    if not (train_attn or train_mlp or train_unembed):
        raise ValueError("LoRA needs at least one target: attention, MLP or unembedding")
    return lora.wrap(
        model, lora_targets(model, train_attn, train_mlp, train_unembed), rank, alpha=alpha, seed=seed
    )


def lora_targets(model: TinyCausalLM, attn: bool, mlp: bool, unembed: bool) -> list[tuple[nn.Module, str]]:
    """The Linear layers LoRA adapts, as Tinker's ``LoraConfig`` selects them."""
    targets: list[tuple[nn.Module, str]] = []
    for block in model.blocks:
        if attn:
            targets += [(block.attn, "qkv"), (block.attn, "proj")]
        if mlp:
            targets += [(block.mlp, "fc"), (block.mlp, "proj")]
    if unembed:
        targets.append((model, "lm_head"))
    return targets


# ---- token-level functions of the training API ----------------------------------------------------------------


def target_logprobs(model: TinyCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t] | inputs[:t+1]) for each t, Tinker's convention (``model_input`` and next-token
    ``target_tokens`` of the same length). Differentiable: the training losses are built on it."""
    return batch_target_logprobs(model, [inputs], [targets])[0]


def batch_target_logprobs(
    model: TinyCausalLM, inputs: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``target_logprobs`` of several sequences in one forward: right-padded, then sliced back. Causal attention
    means the padding after a sequence cannot change its log-probs, so no mask is needed."""
    if len(inputs) != len(targets) or not inputs:
        raise ValueError(
            f"need as many targets as inputs, at least one: got {len(inputs)} and {len(targets)}"
        )
    lengths = [len(x) for x in inputs]
    if any(len(x) != len(y) for x, y in zip(inputs, targets, strict=True)) or min(lengths) == 0:
        raise ValueError("each sequence needs at least one token and as many targets as inputs")
    padded_inputs = nn.utils.rnn.pad_sequence(inputs, batch_first=True)  # pads with token 0: it is never read
    padded_targets = nn.utils.rnn.pad_sequence(targets, batch_first=True)
    logprobs = model(padded_inputs).float().log_softmax(-1)
    picked = logprobs.gather(-1, padded_targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return [row[:n] for row, n in zip(picked, lengths, strict=True)]


@torch.no_grad()
def prompt_logprobs(model: TinyCausalLM, prompt: Sequence[int]) -> list[float | None]:
    """log p(prompt[t] | prompt[:t]) for each t; None first, as nothing predicts the first token."""
    if not prompt:
        raise ValueError("prompt is empty")
    if len(prompt) == 1:
        return [None]
    tokens = torch.tensor(prompt, device=_device(model))
    return [None, *target_logprobs(model, tokens[:-1], tokens[1:]).tolist()]


@dataclass(frozen=True)
class SampledTokens:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["length", "stop"]


class Decoder(Protocol):
    """What ``sample`` decodes with: a causal LM that keeps its keys and values (the tiny LM, SmolLM2)."""

    config: Any  # max_seq_len, vocab_size
    eos_id: int

    def decode(self, tokens: torch.Tensor, cache: Any | None, length: int = 0) -> tuple[torch.Tensor, Any]:
        """Logits [B, vocab] of the token after ``tokens`` [B, T] and the cache to decode the next one with:
        ``tokens`` are a prompt when ``cache`` is None (``length``: the positions the cache will hold at most),
        else one new token per sequence."""
        ...

    def repeat_cache(self, cache: Any, n: int) -> Any:
        """The cache of one sequence for ``n`` that go on from it."""
        ...


@torch.inference_mode()
def sample(
    model: Decoder,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] | None = None,
    stop_text: Callable[[Sequence[int]], bool] | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    check: Callable[[], None] | None = None,
) -> list[SampledTokens]:
    """``num_samples`` continuations of ``prompt``, sampled together in one batch.

        Each ends after ``max_tokens`` tokens ("length"), or at the first token in ``stop_tokens`` ("stop"; that
        token is included); ``None`` stops at the model's ``eos_id``, ``()`` never stops early. ``stop_text`` ends a
    sample too, at the first token after which it holds for the sample's tokens (a stop string in their decoded
    text; that token included, as a stop token is). ``logprobs`` are those
        of the distribution actually sampled from: the model's logits divided by ``temperature``, cut to ``top_k`` /
        ``top_p`` and renormalised (what an importance ratio needs). ``temperature == 0`` is greedy, its logprobs those
        of temperature 1. ``top_k <= 0`` and ``top_p == 1`` keep every token. A given ``seed`` reproduces the samples
        exactly. ``check`` is called before each token: what it raises ends the sampling (a time budget).

        The prompt is read once, its keys and values then shared by every sample: each new token costs one position.
    """
    limit = model.config.max_seq_len
    if not prompt:
        raise ValueError("prompt is empty")
    if max_tokens < 1 or num_samples < 1:
        raise ValueError(f"max_tokens and num_samples must be >= 1, got {max_tokens} and {num_samples}")
    if len(prompt) + max_tokens > limit:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds max_seq_len {limit}"
        )
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    device = _device(model)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    stop_set = {model.eos_id} if stop_tokens is None else set(stop_tokens)
    stops = torch.tensor(sorted(stop_set), dtype=torch.long, device=device)

    logits, cache = model.decode(torch.tensor([prompt], device=device), None, len(prompt) + max_tokens)
    if num_samples > 1:
        logits, cache = logits.expand(num_samples, -1), model.repeat_cache(cache, num_samples)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    ends: list[int | None] = [None] * num_samples  # the length of each sample that stopped
    rows: list[list[int]] = [[] for _ in range(num_samples)]  # the tokens so far, for stop_text
    new_tokens, new_logprobs = [], []
    for step in range(max_tokens):
        if check is not None:
            check()
        logprobs = _sampling_logprobs(logits.float(), temperature, top_k, top_p)
        if temperature == 0:
            token = logprobs.argmax(-1, keepdim=True)
        else:
            token = torch.multinomial(logprobs.exp(), 1, generator=generator)
        new_tokens.append(token.squeeze(1))
        new_logprobs.append(logprobs.gather(-1, token).squeeze(1))
        hit = torch.isin(token.squeeze(1), stops)
        if stop_text is not None:
            for row, value in enumerate(token.squeeze(1).tolist()):
                rows[row].append(value)
                if ends[row] is None and stop_text(rows[row]):
                    hit[row] = True
        for row in (hit & ~done).nonzero().flatten().tolist():
            ends[row] = step + 1
        done |= hit
        if done.all() or step == max_tokens - 1:
            break
        logits, cache = model.decode(token, cache)

    results = []
    for row_tokens, row_logprobs, end in zip(
        torch.stack(new_tokens, 1).tolist(), torch.stack(new_logprobs, 1).tolist(), ends, strict=True
    ):
        if end is None:
            results.append(SampledTokens(row_tokens, row_logprobs, "length"))
        else:
            results.append(SampledTokens(row_tokens[:end], row_logprobs[:end], "stop"))
    return results


def stop_strings(
    strings: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> Callable[[Sequence[int]], bool] | None:
    """``sample``'s ``stop_text`` for stop strings: whether one of them is in the text ``decode`` makes of the
    tokens sampled so far (None without strings)."""
    if not strings:
        return None

    def reached(tokens: Sequence[int]) -> bool:
        text = decode(tokens)
        return any(s in text for s in strings)

    return reached


def _sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities [N, vocab] of the distribution that ``sample`` draws from."""
    if temperature == 0:
        return logits.log_softmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p < 1:
        # keep the smallest set of most likely tokens whose mass reaches top_p: drop a token once the mass
        # of those before it already does (the most likely token always stays)
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits.log_softmax(-1)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
