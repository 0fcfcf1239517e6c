"""``tinker-atropos export --format peft|merged``: a language model's checkpoint, of the Tinker API (a file under the
run's ``tinker/`` folder, or its ``tinker://`` path) or of the Atropos loop (``RUN_DIR/atropos/checkpoint-*.pt``),
as a PEFT adapter folder or a merged Hugging Face model folder (``tinker_api/engine/weights_out.py``), over the base
the run served: the run's config names its model folders. Every refusal is one line (a ``FatalError``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tinker_atropos.config import TinkerSection
from tinker_atropos.errors import FatalError
from tinker_atropos.launcher.run_folder import latest_checkpoint
from tinker_atropos.tinker_api.store.files import KINDS, checkpoint_file, parts
from tinker_atropos.tinker_api.wire import WireError

if TYPE_CHECKING:
    from tinker_atropos.training.served import LanguageModel


@dataclass(frozen=True)
class Exported:
    checkpoint: Path
    base_model: str
    files: list[Path]


def tinker_root(run_dir: Path, checkpoint_dir: str | None) -> Path:
    """Where a run's ``tinker://`` checkpoints are (``trainer.tinker.checkpoint_dir``, else RUN_DIR/tinker)."""
    return Path(checkpoint_dir) if checkpoint_dir else run_dir / "tinker"


def checkpoint_of(run_dir: Path, root: Path, checkpoint: str | None) -> Path:
    """The file a ``--checkpoint`` names (a file, or a ``tinker://`` path under ``root``); None: the newest of the
    run's language-model checkpoints, the Atropos loop's (RUN_DIR/atropos) and the Tinker API's (under ``root``)."""
    if checkpoint is None:
        saved = [file for kind in KINDS[:2] for file in root.glob(f"*/{kind}/*.pt")]
        if (atropos := latest_checkpoint(run_dir, "atropos")) is not None:
            saved.append(atropos)
        if not saved:
            raise FatalError(
                f"no checkpoint of a language model under {run_dir / 'atropos'} (the Atropos loop's) nor {root} "
                "(the Tinker API's: save_state, save_weights_for_sampler): name one with --checkpoint"
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


def load_language_model(file: Path, tinker: TinkerSection, config: str) -> tuple[LanguageModel, int]:
    """The language model of the checkpoint ``file``, rebuilt on the CPU, and its policy version; ``tinker``: the
    run's ``trainer.tinker``, whose ``base_models`` its base may be of, read from ``config`` (named when it names
    none of the checkpoint's). FatalError, one line, for a file that holds none."""
    import torch

    from tinker_atropos.tinker_api.engine import weights_out

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a truncated file, a pickle of something else: one line either way
        raise FatalError(f"cannot read {file} as a checkpoint: {error}") from None
    try:
        model = weights_out.from_checkpoint(state, tinker, config)
    except WireError as error:
        raise FatalError(f"{file}: {error}") from None
    held = state.get("core", state)  # the Atropos loop's under "core", the Tinker API's at the top
    return model, int(held.get("version", 0))


def export_language_model(file: Path, fmt: str, out: Path, tinker: TinkerSection, config: str) -> Exported:
    """The language model of the checkpoint ``file`` (``load_language_model``) to the folder ``out`` (which must
    not hold files) in ``fmt`` (peft or merged)."""
    from tinker_atropos.tinker_api.engine import weights_out

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FatalError(f"{out} exists and is not an empty folder: name another --out")
    model, _ = load_language_model(file, tinker, config)
    try:
        files = weights_out.write(model, fmt, out)
    except WireError as error:
        raise FatalError(f"{file}: {error}") from None
    except OSError as error:
        raise FatalError(f"cannot write {out}: {error.strerror or error}") from None
    return Exported(file, model.base_model, files)
