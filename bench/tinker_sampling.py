"""Sampling tokens per second of the Tinker API's sampler (``sampling.engine``: the prompt read once, then a KV
cache) against Hugging Face ``generate`` with its own cache, on the same model, prompt, sample count and length,
in the same process, alternating, the median of a few repeats each. The model is SmolLM2-135M (the served LM that
``generate`` can run); for the tiny byte-level LM, which ``generate`` cannot run, the peer is the sampler this
project had before its KV cache, which read the whole sequence again for every token.

Both sample with temperature 1 from the full distribution (no top-k, no top-p) and always run to the requested
length (``generate``: ``min_new_tokens``; ours: no stop token), float32, ``torch_threads`` threads (the trainer's
setting, 1 by default), on the CPU and, where there is one, on CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tinker_atropos.models import smollm2, tiny_lm
from tinker_atropos.sampling.engine import sample
from tinker_atropos.sampling.params import Params


@dataclass(frozen=True)
class Case:
    model: str  # "smollm2" or "tiny"
    prompt_tokens: int
    num_samples: int
    max_tokens: int

    @property
    def tokens(self) -> int:
        return self.num_samples * self.max_tokens


CASES = (
    Case("smollm2", 64, 8, 64),  # a group of 8 completions, as an RL environment asks for
    Case("smollm2", 64, 1, 64),  # one completion: nothing shared between samples
    Case("tiny", 38, 16, 200),  # the peer reads the whole sequence for every token: a shorter request
)


@torch.inference_mode()
def recompute_sample(
    model: tiny_lm.TinyCausalLM, prompt: list[int], num_samples: int, max_tokens: int
) -> int:
    """The sampler before the KV cache: the whole sequence through the model again for every token (kept here
    as the tiny LM's peer)."""
    tokens = torch.tensor(prompt).repeat(num_samples, 1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(max_tokens):
        probs = model(tokens)[:, -1].float().softmax(-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return num_samples * max_tokens


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(case: Case, model: Any, device: torch.device, repeats: int) -> dict[str, Any]:
    """Tokens per second, ours and the peer's, alternating ``repeats`` times (after one warm-up of each)."""
    prompt = [
        int(t)
        for t in torch.randint(0, 256, (case.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    ]

    def ours() -> None:
        sample(model, prompt, Params(case.max_tokens, case.num_samples, seed=0))

    if case.model == "smollm2":
        peer_name = "transformers generate (its KV cache)"

        def peer() -> None:
            with torch.inference_mode():
                model.hf.generate(
                    torch.tensor([prompt], device=device),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=case.max_tokens,
                    min_new_tokens=case.max_tokens,
                    num_return_sequences=case.num_samples,
                    pad_token_id=model.eos_id,
                )
    else:
        peer_name = "full recompute per token (before the KV cache)"

        def peer() -> None:
            recompute_sample(model, prompt, case.num_samples, case.max_tokens)

    ours(), peer()  # warm-up
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for _ in range(repeats):
        times["ours"].append(_timed(ours))
        times["peer"].append(_timed(peer))
    ours_rate, peer_rate = (case.tokens / statistics.median(times[k]) for k in ("ours", "peer"))
    return {
        "model": smollm2.NAME if case.model == "smollm2" else "tiny-byte-lm",
        "device": str(device),
        "prompt_tokens": case.prompt_tokens,
        "num_samples": case.num_samples,
        "max_tokens": case.max_tokens,
        "ours_tokens_per_s": ours_rate,
        "peer": peer_name,
        "peer_tokens_per_s": peer_rate,
        "ratio": ours_rate / peer_rate,
        "repeats": repeats,
    }


def smollm2_of_random_weights() -> smollm2.SmolLM2:
    """SmolLM2-135M's architecture (the GGUF file's config) with random weights: where the file is not installed
    (it is too large to carry to a GPU machine), the same work per token for both samplers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
    )
    return smollm2.SmolLM2(LlamaForCausalLM(config).eval(), eos_id=2)


def run(repeats: int = 3, cases: tuple[Case, ...] = CASES) -> list[dict[str, Any]]:
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    smol, weights = None, "pretrained"
    if any(c.model == "smollm2" for c in cases):
        smol, weights = (
            (smollm2.build(), "pretrained")
            if smollm2.available()
            else (smollm2_of_random_weights(), "random")
        )
    tiny = tiny_lm.TinyCausalLM()
    for device in devices:
        for case in cases:
            model = smol if case.model == "smollm2" else tiny
            if model is None:
                continue
            rows.append(
                measure(case, model.to(device).eval(), device, repeats)
                | {"weights": weights if case.model == "smollm2" else "its seed"}
            )
    return rows
