"""A tiny byte-level causal language model, built locally from a seed: nothing is ever downloaded.

It gives the Tinker-compatible training API (forward_backward / optim_step / sample) a real token path that
runs in milliseconds on a CPU: a byte tokenizer, a pre-LayerNorm GPT, LoRA adapters, and the token-level
functions the API needs (log-probs of targets, of a prompt; ``step`` for the sampling engine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tinker_atropos.models import logprobs, lora


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


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [B, heads, positions, head_dim]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model {config.d_model} is not a multiple of n_heads {config.n_heads}")
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(
        self,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention over ``past``'s positions and ``x``'s, causal within ``x``; ``mask`` [B, T, P + T]: which
        keys each query may see (left padding in a batch of several lengths), None for all of them."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if mask is None:  # a prompt from position 0, or one token that sees every earlier one
            y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None and T > 1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, heads, T, head_dim]
        return self.proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)


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

    def forward(
        self,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attended, kv = self.attn(self.ln1(x), past, mask)
        x = x + attended
        return x + self.mlp(self.ln2(x)), kv


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the next token at every position of ``tokens`` [B, T]."""
        self._check(tokens, tokens.shape[1])
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x, _ = block(x)
        return self.lm_head(self.ln_f(x))

    def step(
        self, tokens: torch.Tensor, past: KV | None, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """``sampling.Decoder.step``: the last position's logits [B, vocab] of ``tokens`` [B, T] at ``positions``
        [B, T] after the ``past`` keys and values, and the keys and values with theirs."""
        x, kv = self._blocks(tokens, past, mask, positions)
        return self.lm_head(self.ln_f(x[:, -1])), kv

    def extend(
        self, tokens: torch.Tensor, past: KV | None, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """``step`` with every position's logits [B, T, vocab]: a continuation of shared keys and values, as
        ``logprobs.target_logprobs`` forwards a group's answers after their prompt."""
        x, kv = self._blocks(tokens, past, mask, positions)
        return self.lm_head(self.ln_f(x)), kv

    def _blocks(
        self, tokens: torch.Tensor, past: KV | None, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        self._check(tokens, int(positions.max()) + 1)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        attend = None
        if mask is not None or (past is not None and tokens.shape[1] > 1):
            attend = attention_mask(mask, past[0][0].shape[2] if past else 0, tokens.shape[1], tokens.device)
        kv = []
        for layer, block in enumerate(self.blocks):
            x, layer_kv = block(x, past[layer] if past else None, attend)
            kv.append(layer_kv)
        return x, kv

    def _check(self, tokens: torch.Tensor, length: int) -> None:
        if length > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {length} tokens is longer than max_seq_len {self.config.max_seq_len}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")


def attention_mask(keys: torch.Tensor | None, past: int, new: int, device: torch.device) -> torch.Tensor:
    """[B, new, past + new]: which keys each of ``new`` queries sees: the earlier ones that ``keys`` [B, past + new]
    marks real (all when None), causally."""
    causal = torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past)
    return causal[None] if keys is None else causal[None] & keys[:, None, :]


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
    return logprobs.target_logprobs(model, [inputs], [targets])[0]


@torch.no_grad()
def next_token_logprobs(model: TinyCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    """log p(v | prompt[:t]) for t = 1 .. len(prompt) - 1, [len(prompt) - 1, vocab] at temperature 1 (row t - 1
    scores prompt[t]): a prompt's log-probs and their top-k, read from one forward."""
    if not prompt:
        raise ValueError("prompt is empty")
    if len(prompt) == 1:
        return torch.zeros(0, model.config.vocab_size, device=_device(model))
    return model(torch.tensor([prompt[:-1]], device=_device(model)))[0].float().log_softmax(-1)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
