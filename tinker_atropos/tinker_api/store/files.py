"""The Tinker checkpoints on disk as the API and the worker both see them: a model's folder under the run's
``tinker`` directory, its named checkpoints (``weights/<name>.pt`` with optimizer state, ``sampler_weights/<name>.pt``
without) each beside its JSON record, the unnamed weights of sampling clients (``ephemeral-<seq>``), and the
weights ``save_weights_external`` wrote (``external_weights/<name>/``: a PEFT adapter or a Hugging Face model
folder). The worker writes them (``tinker_api/engine/saving.py``); a route reads a checkpoint's record, or deletes
it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.store.runs import TrainingRuns

# a checkpoint's name and its model's id, each one segment of a path under the checkpoint folder: never "." or ".."
# (nor any name starting with "."), which would name the folder itself or the one above it
NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
MODEL_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.:-]{0,255}$")
EPHEMERAL = "ephemeral-"  # the name of the weights a sampling client was made with, saved under no name
EXTERNAL = "external_weights"  # a folder each, in the formats transformers and PEFT read
KINDS = ("weights", "sampler_weights", EXTERNAL)


def parts(path: str) -> tuple[str, str, str]:
    """The model, kind and name of a ``tinker://<model>/<weights|sampler_weights>/<name>`` path."""
    found = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(found) != 3 or not MODEL_ID.match(found[0]) or found[1] not in KINDS or not NAME.match(found[2]):
        raise wire.WireError(f"{path!r} is no tinker://<model>/weights/<name> path of this server")
    return found[0], found[1], found[2]


def named(request: dict[str, Any]) -> str | None:
    """The name a save request asks for (its ``path``; None: unnamed), checked with its ``ttl_seconds``; WireError
    naming the field otherwise. The route checks it (a 400) and the worker again (a request read from Redis)."""
    name = request.get("path")
    if name is not None and (not NAME.match(str(name)) or str(name).startswith(EPHEMERAL)):
        raise wire.WireError(
            f"path {name!r}: a checkpoint's name is letters, digits, '_', '.', '-' (at most 128), not starting "
            f"with '.' nor {EPHEMERAL!r} (the unnamed weights of sampling clients)"
        )
    ttl = request.get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise wire.WireError(f"ttl_seconds must be a whole number of seconds >= 1, or None; got {ttl!r}")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def model_folder(root: Path, model_id: str) -> Path:
    """A model's folder under the checkpoint root (``:`` is no character of a portable file name)."""
    return root / model_id.replace(":", "_")


def checkpoint_file(root: Path, model_id: str, kind: str, name: str) -> Path:
    """The file of a saved checkpoint (``weights``, ``sampler_weights``), or the folder of external weights."""
    return model_folder(root, model_id) / kind / (name if kind == EXTERNAL else f"{name}.pt")


class CheckpointFiles:
    """The files of every model served under ``root``, and their records in the store (``TrainingRuns``)."""

    def __init__(self, root: Path, runs: TrainingRuns, ephemeral_ttl_s: float) -> None:
        self.root, self.runs, self.ephemeral_ttl_s = root, runs, ephemeral_ttl_s
        # private to the run's user (0700, also when an older version made it 0755): its sub-folders are named
        # after the models, and a model's id is what a request needs to act on it
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)

    def folder(self, model_id: str) -> Path:
        return model_folder(self.root, model_id)

    def file(self, model_id: str, kind: str, name: str) -> Path:
        return checkpoint_file(self.root, model_id, kind, name)

    def file_of(self, path: str) -> Path:
        """The file behind a ``tinker://<model>/<weights|sampler_weights>/<name>`` path."""
        model_id, kind, name = parts(path)
        if kind == EXTERNAL:
            raise wire.WireError(
                f"{path} holds weights for transformers and PEFT, not a checkpoint to load here"
            )
        file = self.file(model_id, kind, name)
        if not file.exists():
            raise wire.WireError(
                f"no checkpoint {path!r} on this server (never saved, deleted, past its ttl_seconds, "
                "or, saved under no name by save_weights_and_get_sampling_client, unused for "
                f"{self.ephemeral_ttl_s:g} s)"
            )
        return file

    def record(self, path: str) -> dict[str, Any]:
        """The record of the checkpoint behind a ``tinker://`` path; WireError if there is none."""
        return json.loads(self.file_of(path).with_suffix(".json").read_text())

    def delete(self, model_id: str, checkpoint_id: str) -> bool:
        """Delete a checkpoint's files and its record; False when there was no such checkpoint."""
        kind, _, name = checkpoint_id.partition("/")
        known = self.runs.remove_checkpoint(model_id, checkpoint_id)
        if kind not in KINDS or not NAME.match(name) or not MODEL_ID.match(model_id):
            return known  # no file under the checkpoint folder (a record read back from Redis could name any)
        file = self.file(model_id, kind, name)
        existed = file.exists()
        if kind == EXTERNAL:
            shutil.rmtree(file, ignore_errors=True)
            return known or existed
        file.unlink(missing_ok=True)
        file.with_suffix(".json").unlink(missing_ok=True)
        return known or existed
