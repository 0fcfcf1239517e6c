"""The worker's side of the Tinker checkpoints (``tinker_api/store/files.py`` lays them out), what the save requests
(``save_requests.py``) write: a checkpoint saved with its record beside it and listed
under its name, the unnamed weights of sampling clients kept while used, expiry by ``ttl_seconds``, and each model's
latest snapshot (``state-<seq>.pt``), from which a restarted worker rebuilds it."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from tinker_atropos.state.checkpoint_files import save_torch, write_atomically
from tinker_atropos.state.run_dir import RunFolderOwner
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine import weights_out
from tinker_atropos.tinker_api.store.files import (
    EXTERNAL,
    CheckpointFiles,
    named,
    parts,
    tinker_path,
)
from tinker_atropos.training.served import ServedModel

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # between two looks for checkpoints past their ttl_seconds


class Checkpoints:
    """What the worker writes in the store's checkpoint folder (``files``) and records (``files.runs``)."""

    def __init__(self, files: CheckpointFiles, owner: RunFolderOwner | None = None) -> None:
        # ``owner``: the run folder checked to be still this run's before each write (RunFolderInUse otherwise)
        self.files, self.runs, self.owner = files, files.runs, owner
        self.snapshots: dict[str, str] = {}  # the snapshot file the store points at, per model
        self.next_sweep = 0.0

    def save(self, file: Path, payload: dict[str, Any]) -> None:
        """The checkpoint, and beside it its record (base model, LoRA) as JSON, written first: what a sampling
        session or a new model needs to know of a checkpoint is read without loading it."""
        self._check_owner()
        record = json.dumps(payload["record"]).encode()
        write_atomically(file.with_suffix(".json"), lambda out: out.write(record))
        save_torch(file, payload)

    def saved(self, model_id: str, kind: str, name: str, request: dict[str, Any]) -> str:
        """Record a checkpoint saved under a name, with its ``ttl_seconds`` and ``user_metadata``; its path."""
        ttl = request.get("ttl_seconds")
        now = time.time()
        self.runs.add_checkpoint(
            model_id,
            f"{kind}/{name}",
            {
                "created_at": now,
                "size_bytes": self.files.file(model_id, kind, name).stat().st_size,
                "public": False,
                "user_metadata": request.get("user_metadata"),
                "expires_at": None if ttl is None else now + ttl,
            },
        )
        return tinker_path(model_id, kind, name)

    def save_external(self, model_id: str, model: ServedModel, request: dict[str, Any]) -> tuple[str, int]:
        """``save_weights_external``: a LoRA model's adapter as a PEFT folder, a fully trained one as a Hugging Face
        model folder, under ``external_weights/<name>/`` (written aside, then renamed into place), recorded as a
        checkpoint; its path and size."""
        name = named(request)
        if name is None:
            raise wire.WireError("save_weights_external needs a name (path)")
        if request.get("age_encryption_recipients"):
            raise wire.WireError(
                "age_encryption_recipients: this server writes the files to its own disk "
                "unencrypted; encrypt them there if they leave it"
            )
        folder = self.files.file(model_id, EXTERNAL, name)
        if folder.exists():
            raise wire.WireError(
                f"external weights {name!r} exist; save under another name or delete them first"
            )
        self._check_owner()
        scratch = folder.with_name(f".{name}.partial")
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            weights_out.write(model, weights_out.natural_format(model), scratch)
            scratch.rename(folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        size = sum(file.stat().st_size for file in folder.iterdir())
        ttl, now = request.get("ttl_seconds"), time.time()
        self.runs.add_checkpoint(
            model_id,
            f"{EXTERNAL}/{name}",
            {
                "created_at": now,
                "size_bytes": size,
                "public": False,
                "user_metadata": None,
                "expires_at": None if ttl is None else now + ttl,
            },
        )
        return tinker_path(model_id, EXTERNAL, name), size

    def keep_ephemeral(self, path: str) -> None:
        """The unnamed weights behind ``path`` are deleted once no sample used them for
        ``trainer.tinker.ephemeral_weights_ttl_s``: an RL loop saves one per step, and none is listed."""
        model_id, kind, name = parts(path)
        self.runs.expire_at(model_id, f"{kind}/{name}", time.time() + self.files.ephemeral_ttl_s)

    def expire(self) -> None:
        """Delete the checkpoints whose ``ttl_seconds`` ran out, and the unnamed weights no sample used for
        ``ephemeral_weights_ttl_s`` (checked every ``SWEEP_S``)."""
        now = time.time()
        if now < self.next_sweep:
            return
        self.next_sweep = now + SWEEP_S
        for model_id, checkpoint_id in self.runs.expired_checkpoints(now):
            self.files.delete(model_id, checkpoint_id)
            log.info("Tinker checkpoint %s of %s expired: deleted", checkpoint_id, model_id)

    def write_snapshot(self, model_id: str, seq: int, state: dict[str, Any]) -> tuple[int, str]:
        """The model's state after its request ``seq``, to a file of its own: the store points at it only in the
        transaction that records the request as applied, so a crash in between leaves the previous snapshot."""
        self._check_owner()
        file = self.files.folder(model_id) / f"state-{seq:09d}.pt"
        # no JSON record beside it: a restart rebuilds the model from the store's record
        save_torch(file, state)
        return seq, str(file)

    def _check_owner(self) -> None:
        if self.owner is not None:
            self.owner.check()

    def snapshot_taken(self, model_id: str, path: str) -> None:
        """Once the store points at ``path``: the older snapshot goes."""
        previous = self.snapshots.get(model_id)
        if previous is not None and previous != path:
            Path(previous).unlink(missing_ok=True)
        self.snapshots[model_id] = path

    def unloaded(self, model_id: str) -> None:
        """A model unloaded: its snapshots go, and its folder with them unless it holds named checkpoints (they
        stay until their ``ttl_seconds`` or a delete)."""
        self.snapshots.pop(model_id, None)
        folder = self.files.folder(model_id)
        for snapshot in folder.glob("state-*.pt"):
            snapshot.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty, or never made
            folder.rmdir()

    def restored(self, model_id: str, path: str) -> None:
        """The snapshot a restarted worker rebuilt the model from; those written by a process that died before the
        store counted them go."""
        self.snapshots[model_id] = path
        for orphan in self.files.folder(model_id).glob("state-*.pt"):
            if orphan.stem != Path(path).stem:
                orphan.unlink()
        # beside each snapshot, before 2026-12-05
        for record in self.files.folder(model_id).glob("state-*.json"):
            record.unlink()
