"""The served model's tokenizer as the inference endpoint speaks it: a prompt's text to token ids (with the
beginning-of-sequence token the model expects), a conversation through the model's chat template, token ids back to
text, and the ids that end a completion. The tiny LM's byte tokenizer and a transformers tokenizer (SmolLM2, a local
model folder) behind one interface, so that the routes never ask which model they serve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tinker_atropos.models import tiny_lm
from tinker_atropos.training.served import LanguageModel, tokenizer


class Tokens(Protocol):
    vocab_size: int  # the ids the model reads: [0, vocab_size)
    eos_ids: list[int]  # a completion ends at any of them (included), as an OpenAI server's does

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``encode(text)``'s length, known without encoding: a text that cannot fit the context
        is refused before it is tokenized."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt of a conversation, ending where the assistant's reply starts; ValueError for one the chat
        template refuses."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (what a client reads)."""
        ...

    def token_bytes(self, token: int) -> list[int]:
        """The UTF-8 bytes of one token (OpenAI's chat ``logprobs.content[].bytes``)."""
        ...


class ByteTokens:
    """The tiny LM's: a byte per token after a BOS, conversations as ``tiny_lm.CHAT_TEMPLATE`` renders them."""

    def __init__(self) -> None:
        self._bytes = tiny_lm.ByteTokenizer()
        self.vocab_size, self.eos_ids = self._bytes.vocab_size, [self._bytes.eos_id]

    def fewest_tokens(self, text: str) -> int:
        return len(text) + 1  # a token per byte, so per character at least, and the BOS

    def encode(self, text: str) -> list[int]:
        return self._bytes.encode(text, add_bos=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(tiny_lm.chat_prompt([(m["role"], m["content"]) for m in messages]))

    def decode(self, ids: Sequence[int]) -> str:
        return self._bytes.decode(ids)

    def token_bytes(self, token: int) -> list[int]:
        return [token] if token < 256 else []


class HFTokens:
    """A transformers tokenizer: its own special tokens on a prompt, its own chat template (the tiny LM's plain
    one where it has none), and every end-of-sequence id the model names (its config's, its generation config's,
    the tokenizer's: a chat model ends its turn with a token of its own, such as ``<|im_end|>``)."""

    def __init__(self, hf: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.hf, self.vocab_size = hf, vocab_size
        self.eos_ids = sorted({*eos_ids, *([hf.eos_token_id] if hf.eos_token_id is not None else [])})

    def fewest_tokens(self, text: str) -> int:
        return 0  # a token may stand for many characters: the sampler checks the encoded prompt

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        from jinja2 import TemplateError

        template = None if self.hf.chat_template else tiny_lm.CHAT_TEMPLATE
        try:
            text = self.hf.apply_chat_template(
                list(messages), chat_template=template, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as error:  # a template's own refusal (Gemma's of a system turn)
            raise ValueError(f"the model's chat template refuses the conversation: {error}") from None
        return list(self.hf.encode(text, add_special_tokens=False))  # the template wrote the special tokens

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> list[int]:
        return list(self.hf.decode([token]).encode("utf-8"))


def served_tokens(model: LanguageModel) -> Tokens:
    """The tokens of ``model``'s base: the byte tokenizer's for the tiny LM, else its transformers tokenizer's."""
    found = tokenizer(model.base_model)
    if isinstance(found, tiny_lm.ByteTokenizer):
        return ByteTokens()
    network = model.core.model
    generation = getattr(network.hf, "generation_config", None)
    named = getattr(generation, "eos_token_id", None)
    named = named if isinstance(named, list) else [named] if named is not None else []
    return HFTokens(found, network.config.vocab_size, [i for i in [network.eos_id, *named] if i >= 0])
