"""``up``'s console lines on the trainer's failing writes: one when each kind starts failing, one when it writes
again, whichever kind failed first (a full disk fails TensorBoard's events or a checkpoint first by chance)."""

from rich.console import Console

from tinker_atropos.launcher.progress import TrainerWrites

CHECKPOINT = "checkpoint: /run/checkpoints: No space left on device (ENOSPC)"
EVENTS = "TensorBoard events: /run/tensorboard: No space left on device (ENOSPC)"


def trainer(failures: dict[str, str], failing_s: float = 0.0) -> dict:
    longest = next(iter(failures.values()), "")
    return {"write_failures": failures, "write_failure": longest, "write_failing_s": failing_s}


def test_each_kind_of_failing_trainer_write_gets_its_own_line_and_its_recovery() -> None:
    console = Console(record=True, width=300)
    writes = TrainerWrites(console)
    writes.note(trainer({"TensorBoard events": EVENTS}, 1.0))
    writes.note(trainer({"TensorBoard events": EVENTS, "checkpoint": CHECKPOINT}, 3.0))
    writes.note(trainer({"TensorBoard events": EVENTS, "checkpoint": CHECKPOINT}, 5.0))
    writes.note({})  # restarting: no word, nothing said
    assert writes.longest == (EVENTS, 5.0)
    writes.note(trainer({"checkpoint": CHECKPOINT}, 1.0))
    writes.note(trainer({}))
    lines = console.export_text().splitlines()
    assert lines == [
        f"the trainer cannot write {EVENTS}; learning goes on, the run stops if it lasts "
        "run.write_failure_timeout_s",
        f"the trainer cannot write {CHECKPOINT}; learning goes on, the run stops if it lasts "
        "run.write_failure_timeout_s",
        f"the trainer writes again (it could not write {EVENTS})",
        f"the trainer writes again (it could not write {CHECKPOINT})",
    ]
    assert writes.longest == ("", 0.0)
