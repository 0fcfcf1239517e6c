"""The replay buffer's journal: each checkpoint writes only the transitions added since the previous one, and a
resume refills the buffer exactly as the checkpoint left it, whatever was written after it or lost before it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from tests.support.records import ACT, OBS, trajectory_chunk
from tinker_atropos.state.replay_journal import ReplayJournal
from tinker_atropos.training.replay import COLUMNS, ReplayBuffer

CAPACITY = 50


def assert_same_columns(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys() == set(COLUMNS)
    for name in COLUMNS:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def run_with_checkpoints(
    journal: ReplayJournal, checkpoints: int
) -> tuple[ReplayBuffer, dict[str, np.ndarray]]:
    """A buffer taking in 24 transitions between checkpoints, journaled as the trainer does it; the buffer, and
    every transition it took in, in order (the journal's numbering)."""
    rng = np.random.default_rng(11)
    buffer, journaled, history = ReplayBuffer(CAPACITY, (OBS,), (ACT,)), 0, []
    for _ in range(checkpoints):
        for _ in range(2):
            buffer.add(trajectory_chunk(rng, truncated=rng.random((6, 2)) < 0.1))
        new = buffer.since(journaled)
        journal.append(journaled, new)
        assert journal.segments()[-1][:2] == (journaled, buffer.added)  # only what is new: 24 transitions
        journaled = buffer.added
        journal.prune(buffer.added, CAPACITY)
        history.append(new)
    return buffer, {name: np.concatenate([part[name] for part in history]) for name in COLUMNS}


def span(history: dict[str, np.ndarray], start: int, end: int) -> dict[str, np.ndarray]:
    return {name: rows[start:end] for name, rows in history.items()}


def test_each_checkpoint_writes_what_is_new_and_a_resume_refills_the_same_buffer(tmp_path: Path) -> None:
    journal = ReplayJournal(tmp_path)
    buffer, history = run_with_checkpoints(journal, checkpoints=8)  # 192 transitions through 50 places
    # pruned: what is on disk is the buffer's span and less than one segment more
    on_disk = sum(stop - start for start, stop, _ in journal.segments())
    assert CAPACITY <= on_disk < CAPACITY + 24 and journal.segments()[-1][1] == buffer.added == 192

    resumed = ReplayBuffer(CAPACITY, (OBS,), (ACT,))
    resumed.refill(journal.restore(buffer.added, CAPACITY), buffer.added)
    assert resumed.added == buffer.added and len(resumed) == len(buffer) == CAPACITY
    assert_same_columns(resumed.since(0), buffer.since(0))
    assert_same_columns(resumed.since(0), span(history, 142, 192))
    # and both go on alike: the same transitions in, the same held and the same numbering
    more = trajectory_chunk(np.random.default_rng(3), truncated=np.zeros((5, 2), bool))
    buffer.add(more), resumed.add(more)
    assert_same_columns(resumed.since(buffer.added - 30), buffer.since(buffer.added - 30))


def test_a_resume_from_an_older_checkpoint_drops_the_later_segments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = ReplayJournal(tmp_path)
    _, history = run_with_checkpoints(journal, checkpoints=6)  # 144 transitions
    with caplog.at_level(logging.WARNING):
        restored = journal.restore(96, CAPACITY)  # the fourth checkpoint's: the two newer ones did not load
    # its buffer held 46-95; the sixth checkpoint pruned what ended at 94 or before: 72-95 are left
    assert_same_columns(restored, span(history, 72, 96))
    assert "26 of the latest 50 transitions are no longer on disk; restoring 24" in caplog.text
    assert journal.segments()[-1][1] == 96  # what was written after it is gone: the run goes on from there


def test_a_segment_past_the_checkpoint_is_cut_to_it(tmp_path: Path) -> None:
    journal = ReplayJournal(tmp_path)
    _, history = run_with_checkpoints(journal, checkpoints=3)  # 72 transitions
    restored = journal.restore(62, CAPACITY)  # a checkpoint within the last segment
    assert_same_columns(restored, span(history, 12, 62))
    assert journal.segments()[-1][:2] == (48, 62)
    assert_same_columns(journal.restore(62, CAPACITY), restored)


def test_a_lost_or_unreadable_segment_costs_only_its_own_transitions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = ReplayJournal(tmp_path)
    _, history = run_with_checkpoints(journal, checkpoints=4)  # 96 transitions
    middle = journal.segments()[-2][2]
    middle.write_bytes(b"not a zip")
    (tmp_path / "notes.txt").write_text("not a segment")  # other files are left alone
    with caplog.at_level(logging.WARNING):
        restored = journal.restore(96, CAPACITY)
    # it costs its own 24 transitions: the older segment fills in (the first was pruned: 48 of 50)
    both = {
        name: np.concatenate([span(history, 24, 48)[name], span(history, 72, 96)[name]]) for name in COLUMNS
    }
    assert_same_columns(restored, both)
    assert (
        "is unreadable" in caplog.text
        and "2 of the latest 50 transitions are no longer on disk" in caplog.text
    )

    middle.unlink()
    assert_same_columns(journal.restore(96, CAPACITY), restored)
    assert (tmp_path / "notes.txt").exists()

    # a segment whose columns disagree with its name is unreadable too
    journal.append(72, span(history, 72, 77))  # a shorter one...
    # ...under the full name
    (tmp_path / f"segment-{72:015d}-{77:015d}.npz").rename(journal.segments()[-1][2])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert_same_columns(journal.restore(96, CAPACITY), span(history, 24, 48))
    assert "do not hold the 24 transitions" in caplog.text and "26 of the latest 50" in caplog.text
    # and with nothing readable, nothing: the buffer starts empty
    for *_, path in journal.segments():
        path.write_bytes(b"")
    assert journal.restore(96, CAPACITY) is None
