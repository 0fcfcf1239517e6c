"""The files ``up`` writes for the run's clients, each of mode 0600 where it holds a secret: the run's secrets
themselves (``run_secret``), ``client.env`` (what a client process sources: the Redis URL, the secrets' files, the
Tinker API's URL and key) and the atroposlib ``--config`` file of the run's Atropos environments."""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path

import yaml

from tinker_atropos.config import TINY_LM, Config
from tinker_atropos.frontends.http import run_key
from tinker_atropos.security import read_keys, write_secret

ATROPOS_CONFIG = "atropos_env.yaml"
EVALS = "evals"  # RUN_DIR/evals: the environments' periodic evaluations (data_dir_to_save_evals)


def write_atropos_config(config: Config, run_dir: Path, token: str | None) -> Path:
    """The atroposlib ``--config`` file of the run's environments (``{atropos_config}``), mode 0600: the trajectory
    API's URL with the run's key as its password (atroposlib's environments send no header; aiohttp sends a URL's
    password as Basic auth), the inference endpoint's URL and key, and the trained model's name and tokenizer
    (``tokenizer_folder``); with ``atropos.eval_every_steps``, atroposlib's ``steps_per_eval`` and where its
    ``evaluate_log`` writes (RUN_DIR/evals, which ``up`` reads back). Without keys (``--insecure``), plain URLs."""
    trainer = config.trainer.atropos
    api_key = inference_key = None
    if token is not None:
        api_key = (
            read_keys(Path(config.atropos.api_keys_file), "atropos.api_keys_file")[0]
            if config.atropos.api_keys_file
            else run_key("atropos-api", token)
        )
        inference_key = (
            read_keys(Path(trainer.inference_api_keys_file), "trainer.atropos.inference_api_keys_file")[0]
            if trainer.inference_api_keys_file
            else run_key("inference", token)
        )
    credentials = f"atropos:{api_key}@" if api_key else ""
    env = {"rollout_server_url": f"http://{credentials}{config.atropos.host}:{config.atropos.port}"}
    every = config.atropos.eval_every_steps  # 0: off, whatever the environment's own default
    env["steps_per_eval"] = every
    if every:
        env["data_dir_to_save_evals"] = str((run_dir / EVALS).resolve())
    openai = {
        "base_url": f"http://{trainer.inference_host}:{trainer.inference_port}/v1",
        "api_key": inference_key or "none",
        "model_name": trainer.base_model,
    }
    return write_environment_config(
        run_dir / ATROPOS_CONFIG, env, openai, tokenizer_folder(config, run_dir), "up"
    )


def write_environment_config(
    path: Path, env: dict[str, object], openai: dict[str, object], tokenizer: str, command: str
) -> Path:
    """An atroposlib ``--config`` file at ``path`` (mode 0600): its ``env`` and ``openai`` (the inference
    endpoint: base_url, api_key, model_name) sections, each naming ``tokenizer``."""
    fields = {"env": {**env, "tokenizer_name": tokenizer}, "openai": {**openai, "tokenizer_name": tokenizer}}
    path.unlink(missing_ok=True)
    header = f"# written by `tinker-atropos {command}` for Atropos environments (--config): it holds keys\n"
    write_secret(path, header + yaml.safe_dump(fields))
    return path


def tokenizer_folder(config: Config, run_dir: Path, name: str | None = None) -> str:
    """Where the environments load the tokenizer of ``name`` (default: the trained model) from (atroposlib's
    ``tokenizer_name``), offline: a model folder of ``trainer.tinker.base_models`` itself; the tiny LM's
    (``ByteTokenizer.save_pretrained``) and SmolLM2's (from its package: 40 s once without the trainer's conversion)
    written once into the run folder."""
    name = name or config.trainer.atropos.base_model
    folders = config.trainer.tinker.base_models
    if name in folders:
        return str(Path(folders[name]).expanduser().resolve())
    from tinker_atropos.models import smollm2, tiny_lm

    if name != TINY_LM and not smollm2.available():
        return name  # the trainer refuses it at its start, in one line
    folder = run_dir / "tokenizers" / name.replace("/", "--")
    if not (folder / "tokenizer.json").exists():
        (tiny_lm.ByteTokenizer() if name == TINY_LM else smollm2.tokenizer()).save_pretrained(folder)
    return str(folder.resolve())


CLIENT_ENV = "client.env"


def write_client_env(run_dir: Path, variables: dict[str, str], tinker_keys: Path | None) -> Path:
    """``<run folder>/client.env`` (mode 0600), what a client process of the run needs, to ``source``: the Redis
    URL (no password in it), the files of the run's secrets, the Tinker API's URL and key. Rewritten once the
    Tinker API's URL is known (its port may be a free one)."""
    lines = ["# written by `tinker-atropos up`: what a client process of this run needs (source it)"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in variables.items()]
    if tinker_keys is not None:  # read when sourced: the trainer writes a fresh key when it starts
        lines.append(f'export TINKER_API_KEY="$(head -1 {shlex.quote(str(tinker_keys))} 2>/dev/null)"')
    path = run_dir / CLIENT_ENV
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    write_secret(partial, "\n".join(lines) + "\n")
    partial.replace(path)
    return path


def client_variables(
    config: Config, run_dir: Path, url: str, password_file: Path | None, insecure: bool
) -> tuple[dict[str, str], Path | None]:
    """What ``client.env`` exports (the run's token file only when up made it: else the shell has it already),
    and the Tinker API's keys file, when it has one."""
    variables = {"TA_REDIS_URL": url}
    if password_file is not None:
        variables["TA_REDIS_PASSWORD_FILE"] = str(password_file.resolve())
    if os.environ.get("TA_TOKEN_FILE"):
        variables["TA_TOKEN_FILE"] = os.environ["TA_TOKEN_FILE"]
    elif not os.environ.get("TA_TOKEN"):
        variables["TA_TOKEN_FILE"] = str(run_secret(run_dir, "token").resolve())
    tinker = config.trainer.tinker
    if not tinker.enabled or insecure:
        return variables, None
    return variables, Path(
        tinker.api_keys_file
    ) if tinker.api_keys_file else run_dir.resolve() / "tinker_api_keys"


def run_secret(run_dir: Path, name: str) -> Path:
    """A secret of the run, ``<run folder>/<name>`` (mode 0600), made on first use and kept for a resume: the
    ``token`` every gRPC call between the run's services carries and that signs its records (``security``),
    the ``redis-password`` of its embedded Valkey."""
    path = run_dir / name
    if not path.exists():
        write_secret(path, secrets.token_urlsafe(32) + "\n")
    return path
