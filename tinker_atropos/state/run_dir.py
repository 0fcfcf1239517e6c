"""The two rules of a run folder for every process that writes in it: one owner at a time, and a write that a full
or read-only disk makes fail is paused and retried, never a crash.

The owner holds ``run.lock`` (an exclusive ``flock``, which the kernel releases when its holder dies, however it
dies) and writes into it who it is, since when and where its Redis is, so that a second ``up`` says in one line
who holds the folder and ``status RUN_DIR`` finds the run's Redis. The services ``up`` starts do not lock: they are
handed the lock's id (``TA_RUN_LOCK``) and check, before they write, that the folder still belongs to that ``up``;
a trainer started on its own (a container) locks the folder itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tinker_atropos.errors import FatalError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
OWNER_VARIABLE = "TA_RUN_LOCK"  # the id of the lock held by the `up` that started a service
RETRY_S = 10.0  # between two attempts of a kind of write that failed


class RunFolderInUse(FatalError):
    """Another live process owns the run folder."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder's lock, as written in it."""

    id: str
    command: str  # "up", "trainer"
    pid: int
    host: str
    since: str  # local time, ISO 8601
    run: str = ""
    redis_url: str = ""  # without its password: `status RUN_DIR` adds the run's password file

    def __str__(self) -> str:
        return f"`{self.command}` (pid {self.pid} on {self.host}) since {self.since}"


def read_holder(run_dir: Path) -> Holder | None:
    """What ``run.lock`` says of its holder, the latest one if none holds it now; None when it says nothing."""
    try:
        fields = json.loads((run_dir / LOCK_NAME).read_text())
        return Holder(**fields)
    except (OSError, ValueError, TypeError):
        return None


def is_locked(run_dir: Path) -> bool:
    """Whether a live process holds ``run_dir``'s lock."""
    try:
        descriptor = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # also releases the shared lock taken
    return False


class RunFolderLock:
    """The exclusive lock of a run folder, held from ``acquire`` until ``release`` or the holder's death."""

    def __init__(self, run_dir: Path, command: str, run: str) -> None:
        self.run_dir, self.path = run_dir, run_dir / LOCK_NAME
        self.holder = Holder(
            uuid.uuid4().hex,
            command,
            os.getpid(),
            socket.gethostname(),
            time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            run,
        )
        self._descriptor: int | None = None

    def acquire(self) -> Holder | None:
        """Take the lock; RunFolderInUse (one line: who, since when) when a live process holds it. Returns the
        holder whose stale lock was taken over (it died without releasing it), if any."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            holder = read_holder(self.run_dir)
            raise RunFolderInUse(
                f"run folder {self.run_dir} is in use by {holder or 'another process'}: stop it first, or "
                "pass another --run-dir"
            ) from None
        self._descriptor = descriptor
        stale = read_holder(self.run_dir)
        self._write(self.holder)
        return stale

    def update(self, redis_url: str) -> None:
        """Note where the run's Redis is (for ``status RUN_DIR``)."""
        self.holder = Holder(**{**asdict(self.holder), "redis_url": redis_url})
        self._write(self.holder)

    def _write(self, holder: Holder | None) -> None:
        """Who holds the lock, into the lock file (emptied for None). The lock itself is the ``flock``: a disk
        too full for these few bytes costs only the description, said in a warning."""
        assert self._descriptor is not None
        try:
            os.ftruncate(self._descriptor, 0)
            if holder is not None:
                os.pwrite(self._descriptor, json.dumps(asdict(holder)).encode(), 0)
        except OSError as error:
            log.warning(
                "cannot write who holds %s (%s); the lock holds all the same",
                self.path,
                describe_os_error(error),
            )

    def release(self) -> None:
        """Empty the lock file and let go (the file stays: unlinking it would let two processes lock two files)."""
        if self._descriptor is None:
            return
        self._write(None)
        os.close(self._descriptor)
        self._descriptor = None


class RunFolderOwner:
    """How a service that writes in a run folder makes sure it is the folder's: with ``TA_RUN_LOCK`` set (started
    by ``up``) it checks that the lock still has that id; without, it holds the lock itself."""

    def __init__(self, run_dir: Path, command: str, run: str) -> None:
        self.run_dir, self.command = run_dir, command
        self.expected = os.environ.get(OWNER_VARIABLE) or None
        self.lock = None if self.expected else RunFolderLock(run_dir, command, run)
        if self.lock is not None:
            try:
                stale = self.lock.acquire()
            except OSError as error:  # a read-only folder: nothing can be written there to mix up anyway
                log.warning(
                    "cannot lock %s (%s); going on without the lock", self.lock.path, describe_os_error(error)
                )
                self.lock, stale = None, None
            if stale is not None:
                log.info("took over the lock of %s, which is gone", stale)
        self.check()

    def check(self) -> None:
        """RunFolderInUse when the folder now belongs to another ``up`` than the one that started this service
        (it died, and a new one took the folder over): what this one would write would mix with the new run's."""
        if self.expected is None:
            return
        holder = read_holder(self.run_dir)
        if holder is None or holder.id != self.expected:
            raise RunFolderInUse(
                f"run folder {self.run_dir} belongs to {holder or 'no one'}, not to the `up` that started this "
                f"{self.command}: not writing there"
            )

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


def describe_os_error(error: OSError) -> str:
    """``No space left on device (ENOSPC)``: the words and the name to search for."""
    name = errno.errorcode.get(error.errno or 0, "")
    return f"{error.strerror or error}" + (f" ({name})" if name else "")


class FolderWrites:
    """One kind of write into the run folder (checkpoints, TensorBoard events, metrics rows) that a full or
    read-only disk makes fail: its first failure is one warning that names the path and the error (and another
    only when the error changes), its recovery one line; ``due`` says when to try again, so the caller goes on
    with its work meanwhile; ``failing_s`` lets the process's owner decide how long is too long."""

    def __init__(
        self,
        what: str,
        consequence: str,
        retry_s: float = RETRY_S,
        report: Callable[[str], None] = log.warning,
    ) -> None:
        self.what, self.consequence, self.retry_s, self.report = what, consequence, retry_s, report
        self.failed = 0  # attempts that failed, over the process's life
        self.error = ""  # "WHAT: PATH: the error" while failing
        self._failing_since: float | None = None
        self._next_try = 0.0
        self._unreported = 0

    def due(self) -> bool:
        """False while waiting to retry a write that failed."""
        return time.monotonic() >= self._next_try

    @property
    def failing_s(self) -> float:
        """How long the writes have been failing (0 while they succeed)."""
        return 0.0 if self._failing_since is None else time.monotonic() - self._failing_since

    def attempt(self, path: Path, write: Callable[[], object]) -> bool:
        """``write()``; an OSError is counted and reported (see the class), never raised. Whether it succeeded."""
        try:
            write()
        except OSError as error:
            self.failed += 1
            self._unreported += 1
            self._next_try = time.monotonic() + self.retry_s
            # the path the caller names, not the error's: a refused temporary file has a new random name at
            # each attempt (a read-only folder's line would repeat every retry), and some writers' are bytes
            message = f"{self.what}: {path}: {describe_os_error(error)}"
            if message != self.error:
                self.report(f"cannot write {message}; {self.consequence}, retrying every {self.retry_s:g} s")
            self.error = message
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            return False
        if self._failing_since is not None:
            self.report(f"{self.what}: written again to {path} after {self.failing_s:.0f} s of failures")
            self._failing_since, self.error = None, ""
        return True

    def take_unreported(self) -> int:
        """The failures since the last call, for the run's counters."""
        count, self._unreported = self._unreported, 0
        return count


def oldest_failure(writes: list[FolderWrites]) -> FolderWrites | None:
    """Of several kinds of writes, the one failing longest; None when all succeed."""
    failing = [w for w in writes if w.failing_s > 0]
    return max(failing, key=lambda w: w.failing_s, default=None)


@contextlib.contextmanager
def tolerated(what: str, path: Path) -> Iterator[None]:
    """Housekeeping of the run folder (deleting or trimming a file a resume no longer needs) that a read-only disk
    refuses: a warning, and the run starts all the same; the next start tries again."""
    try:
        yield
    except OSError as error:
        log.warning("cannot %s %s (%s); going on without", what, path, describe_os_error(error))
