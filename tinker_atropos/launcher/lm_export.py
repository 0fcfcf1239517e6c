"""``tinker-atropos export --format peft|merged``: a Tinker checkpoint of a language model (a file under the run's
``tinker/`` folder, or its ``tinker://`` path) as a PEFT adapter folder or a merged Hugging Face model folder
(``tinker_api/engine/weights_out.py``). Every refusal is one line (a ``FatalError``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tinker_atropos.errors import FatalError
from tinker_atropos.tinker_api.store.files import KINDS, checkpoint_file, parts
from tinker_atropos.tinker_api.wire import WireError


@dataclass(frozen=True)
class Exported:
    checkpoint: Path
    base_model: str
    files: list[Path]


def tinker_root(run_dir: Path, checkpoint_dir: str | None) -> Path:
    """Where a run's ``tinker://`` checkpoints are (``trainer.tinker.checkpoint_dir``, else RUN_DIR/tinker)."""
    return Path(checkpoint_dir) if checkpoint_dir else run_dir / "tinker"


def checkpoint_of(root: Path, checkpoint: str | None) -> Path:
    """The file a ``--checkpoint`` names (a file, or a ``tinker://`` path under ``root``); None: the newest saved
    under ``root``."""
    if checkpoint is None:
        saved = [file for kind in KINDS[:2] for file in root.glob(f"*/{kind}/*.pt")]
        if not saved:
            raise FatalError(
                f"no Tinker checkpoint under {root}: save one (save_state, save_weights_for_sampler) "
                "or name it with --checkpoint"
            )
        return max(saved, key=lambda file: file.stat().st_mtime)
    if checkpoint.startswith("tinker://"):
        try:
            file = checkpoint_file(root, *parts(checkpoint))
        except WireError as error:
            raise FatalError(str(error)) from None
    else:
        file = Path(checkpoint)
    if not file.is_file():
        raise FatalError(f"checkpoint {checkpoint} does not exist ({file})")
    return file


def export_language_model(file: Path, fmt: str, out: Path) -> Exported:
    """The language model of the Tinker checkpoint ``file`` to the folder ``out`` (which must not hold files) in
    ``fmt`` (peft or merged)."""
    import torch

    from tinker_atropos.tinker_api.engine import weights_out

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FatalError(f"{out} exists and is not an empty folder: name another --out")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a truncated file, a pickle of something else: one line either way
        raise FatalError(f"cannot read {file} as a checkpoint: {error}") from None
    try:
        model = weights_out.from_checkpoint(state)
        files = weights_out.write(model, fmt, out)
    except WireError as error:
        raise FatalError(f"{file}: {error}") from None
    except OSError as error:
        raise FatalError(f"cannot write {out}: {error.strerror or error}") from None
    return Exported(file, model.base_model, files)
