"""Sampling for environments: the trainer's latest language-model weights behind the HTTP forms Atropos
environments call (OpenAI completions and chat completions, SGLang's ``/generate`` with token ids)."""
