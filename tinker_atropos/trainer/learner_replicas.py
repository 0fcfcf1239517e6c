"""The other data-parallel learners (``trainer.learners`` > 1): started beside the trainer, each handed its share of
every batch the trainer learns from.

The trainer stays the one learner that reads the stream, checks and takes each chunk once, guards, checkpoints
and publishes (rank 0). It starts ``learners - 1`` replica processes on this machine and deals each batch out
(``deal``: whole runs of chunks that continue one another, so that advantages run over them as with one learner);
every learner computes the advantages of its share, and ``ppo_update`` makes each step the whole minibatch's
(``training/data_parallel.py``). Nothing is learned twice: only rank 0 takes experience, and each chunk goes to
one learner. A replica lost mid-run fails the trainer's next collective: the trainer stops with an error and
restarts from its last checkpoint, as after any trainer crash, with new replicas; a replica whose trainer is gone
exits at its next message.

Each replica is linked to rank 0 by a socket pair the trainer makes before starting it (``learner_channels.py``):
nothing listens, so no other local user can reach, flood or join the learners (torch.distributed's gloo
listened on 127.0.0.1 and paired the first connection that named a pair, and PyPI's torch has no gloo TLS). The
messages and, on the CPU, the all-reduces go through those pairs. CUDA learners with a GPU each all-reduce with NCCL
instead (GPU to GPU), meeting in torch.distributed's file store in a private folder of the run; that path is not
tested on this project's CPU machines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import Learner, LearnerSetup
from tinker_atropos.errors import FatalError
from tinker_atropos.protocol.trajectory import Trajectory, contiguous_runs
from tinker_atropos.trainer.learner_channels import TIMEOUT_S, Channel, LearnerLost, Star
from tinker_atropos.training.data_parallel import Group

log = logging.getLogger(__name__)

MODULE = "tinker_atropos.trainer.learner_replicas"  # a replica's process runs this module
READY = "ready"  # what a replica says once it has started, before it builds its learner
SHM = "/dev/shm"  # where Python's shared memory lives on Linux; 64 MB in a container unless it is given more
TIMEOUT = timedelta(seconds=TIMEOUT_S)  # NCCL's collectives wait as long as the channels do
NCCL_ENVIRONMENT = {"NCCL_SOCKET_IFNAME": "lo"}  # NCCL's bootstrap connections stay on this machine


def deal(trajectories: list[Trajectory], size: int) -> list[list[Trajectory]]:
    """``size`` shares of a batch, as even in env steps as whole runs allow (each run to the share with the fewest
    steps, longest runs first); single chunks when there are fewer runs than shares."""
    runs = contiguous_runs(trajectories)
    if len(runs) < size:
        runs = [[chunk] for chunk in trajectories]
    shares: list[list[Trajectory]] = [[] for _ in range(size)]
    steps = [0] * size
    for run in sorted(runs, key=lambda run: -sum(c.num_steps for c in run)):
        lightest = steps.index(min(steps))
        shares[lightest] += run
        steps[lightest] += sum(c.num_steps for c in run)
    return shares


class SharedShares:
    """Rank 0's shared-memory segments, one per replica, that each share of a batch is written into: the
    replicas run on this machine, so a share's arrays cross by one copy into memory they map, not pickled through
    a socket (12 MB a share of Humanoid's 16,384-sample update). Only a small pickle, with the places of the
    arrays in the segment, goes through the collective (pickle protocol 5's out-of-band buffers)."""

    def __init__(self) -> None:
        self.segments: dict[int, SharedMemory] = {}

    def put(self, rank: int, share: list[Trajectory]) -> tuple[str, bytes, list[tuple[int, int]]]:
        """``share`` written into rank ``rank``'s segment (a larger one when it does not fit): what the replica
        reads it back from (``take_share``)."""
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(share, protocol=5, buffer_callback=buffers.append)
        raws = [buffer.raw() for buffer in buffers]
        size = sum(raw.nbytes for raw in raws)
        segment = self.segments.get(rank)
        if segment is None or segment.size < size:
            if segment is not None:
                segment.close()
                segment.unlink()  # the replica drops its mapping when it attaches the new one
            wanted, free = max(1, size * 5 // 4), shutil.disk_usage(SHM).free
            if wanted > free:  # written past what it holds, a segment kills the process (SIGBUS)
                raise FatalError(
                    f"a share of trainer.learners's batch needs {wanted / 1e6:.0f} MB of {SHM}, which has "
                    f"{free / 1e6:.0f} MB free: give the trainer a larger {SHM} (docker --shm-size, Compose "
                    "shm_size, a Kubernetes emptyDir of medium Memory) or lower trainer.samples_per_update"
                )
            segment = self.segments[rank] = SharedMemory(create=True, size=wanted)
        spans, offset = [], 0
        for raw in raws:
            segment.buf[offset : offset + raw.nbytes] = raw
            spans.append((offset, raw.nbytes))
            offset += raw.nbytes
        return segment.name, data, spans

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
            segment.unlink()
        self.segments.clear()


def take_share(payload: tuple[str, bytes, list[tuple[int, int]]], attached: dict[str, SharedMemory]) -> list:
    """A replica's share, its arrays read in place from rank 0's segment (attached once, the one before let go)."""
    name, data, spans = payload
    if name not in attached:
        for old in attached.values():
            with contextlib.suppress(BufferError):  # views still held: the mapping goes with the process
                old.close()
        attached.clear()
        attached[name] = SharedMemory(name=name)
        # Python 3.11 registers an attached segment with this process's resource tracker, which would unlink
        # rank 0's segment when this process exits: rank 0 owns it
        resource_tracker.unregister(attached[name]._name, "shared_memory")  # type: ignore[attr-defined]
    segment = attached[name]
    return pickle.loads(data, buffers=[segment.buf[offset : offset + size] for offset, size in spans])


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where learner ``rank`` learns: the trainer's device, or a GPU of its own when the machine has several."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % torch.cuda.device_count())


def nccl_store(folder: Path) -> str:
    """Where CUDA learners meet for NCCL: torch.distributed's file store in ``folder``, made private (0700) to this
    user; the folder a crashed trainer left is removed first. Not a TCP store, which would listen."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True)
    return f"file://{folder}/store"


def join_nccl(address: str, rank: int, size: int, device: torch.device) -> None:
    """Learner ``rank`` joins the NCCL group at ``address`` (``nccl_store``), with ``NCCL_ENVIRONMENT`` set for the
    join only: not in the trainer's environment, where every process it starts and every library it loads would
    see it. NCCL reads those variables when it makes its first communicator, once per process, which a group
    bound to ``device`` (``device_id``) does here, in the join (eagerly; a lazy group would at its first
    all-reduce, after the variables are gone). ``device``: the learner's GPU, with its index (``rank_device``);
    every learner binds its own, as NCCL's eager join waits for all of them."""
    with _environment(NCCL_ENVIRONMENT):
        dist.init_process_group(
            "nccl", init_method=address, rank=rank, world_size=size, timeout=TIMEOUT, device_id=device
        )


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` in ``os.environ`` for the block only; what was there before (or its absence) put back."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Replicas:
    """Rank 0's side: the ``size - 1`` replica processes, started here, each with its channel (the socket pair),
    told what to do in turn. ``folder`` is the run's: the NCCL store's, when the learners use it."""

    def __init__(self, setup: LearnerSetup, size: int, threads: int, folder: Path) -> None:
        self.size, self.minibatches, self.folder = size, setup.hyperparameters.num_minibatches, folder
        # each learner on a GPU of its own (``rank_device``): NCCL, which refuses two ranks on one GPU
        self.nccl = setup.device.type == "cuda" and torch.cuda.device_count() >= size
        address = nccl_store(folder) if self.nccl else None
        self.processes: list[subprocess.Popen] = []
        self.channels: list[Channel] = []
        try:
            for rank in range(1, size):
                channel, end = Channel.pair(f"learner replica {rank}")
                self.channels.append(channel)
                with end:  # the child's now: this process keeps only its own end
                    argv = [sys.executable, "-m", MODULE, str(rank), str(end.fileno())]
                    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
                    self.processes.append(subprocess.Popen(argv, pass_fds=(end.fileno(),), env=environment))
            for rank, (process, channel) in enumerate(zip(self.processes, self.channels, strict=True), 1):
                started(rank, process, channel, (setup, size, threads, address))
            if address is not None:
                join_nccl(address, 0, size, rank_device(setup.device, 0))
        except BaseException:
            self._close()
            raise
        self.group = Group(0, size, dist.all_reduce if self.nccl else Star(self.channels, root=True))
        self.shelf = SharedShares()
        log.info("learning data-parallel with %d learners (%d replica processes)", size, size - 1)

    @classmethod
    def beside(cls, learner: Learner, setup: LearnerSetup, folder: Path) -> Replicas | None:
        """The replicas of ``learner`` (rank 0) for ``trainer.learners`` learners of ``trainer.threads()`` threads
        each, started from its state; None for one."""
        if setup.trainer.learners == 1:
            return None
        replicas = cls(setup, setup.trainer.learners, setup.trainer.threads(), folder)
        learner.core.group = replicas.group
        replicas.load(learner.state_dict())
        return replicas

    def _tell(self, messages: list[tuple[str, Any]]) -> None:
        """One message to each replica, in rank order."""
        for channel, message in zip(self.channels, messages, strict=True):
            channel.send(message)

    def load(self, state: dict[str, Any]) -> None:
        """Every replica takes the learner's state (at the start, and after a restore: an undone update)."""
        self._tell([("load", state)] * (self.size - 1))

    def learn(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Deal the batch out, every replica starting its share's update; rank 0's share, to learn from here.
        FatalError when a share is too small to make trainer.<algorithm>.num_minibatches minibatches."""
        shares = deal(trajectories, self.size)
        smallest = min(sum(c.num_steps for c in share) for share in shares)
        if smallest < self.minibatches:
            raise FatalError(
                f"a batch of {len(trajectories)} chunks ({sum(c.num_steps for c in trajectories)} env steps) gives "
                f"one of trainer.learners={self.size} {smallest} rows, fewer than its {self.minibatches} "
                "minibatches: raise trainer.samples_per_update or lower trainer.learners"
            )
        # rank 0's share stays here; episodes' ends (protobuf messages) stay: nothing learns from them
        self._tell(
            [
                ("learn", self.shelf.put(rank, [replace(c, episodes=()) for c in share]))
                for rank, share in enumerate(shares[1:], 1)
            ]
        )
        return shares[0]

    def close(self) -> None:
        """The replicas told to stop, and waited for; killed if they do not."""
        try:
            self._tell([("stop", None)] * (self.size - 1))
            for process in self.processes:
                process.wait(timeout=30)
        except Exception as error:  # a replica already gone or hung: the rest are killed
            log.warning("stopping the learner replicas: %s", error)
        finally:
            self._close()
            self.shelf.close()

    def _close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for channel in self.channels:
            channel.close()
        if self.nccl:
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(self.folder, ignore_errors=True)


def started(rank: int, process: subprocess.Popen, channel: Channel, setup: tuple[Any, ...]) -> None:
    """Replica ``rank`` handed its setup and started (it says READY); one that fails to start is an error at once,
    naming its exit code (its error is in the trainer's log above)."""
    try:
        channel.send(setup)
        channel.receive()
    except LearnerLost as error:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        if process.returncode is None:
            raise RuntimeError(f"learner replica {rank} did not start: {error}") from None
        raise RuntimeError(
            f"learner replica {rank} exited with code {process.returncode} before joining (its error above)"
        ) from None


def serve(rank: int, descriptor: int) -> None:
    """A replica: take its setup from rank 0 over the channel it inherited, then apply what rank 0 sends until
    told to stop (or rank 0 is gone)."""
    channel = Channel(socket.socket(fileno=descriptor), "rank 0")
    setup, size, threads, address = channel.receive()
    torch.set_num_threads(threads)
    channel.send(READY)
    setup = replace(setup, device=rank_device(setup.device, rank))
    if address is not None:
        torch.cuda.set_device(setup.device)
        join_nccl(address, rank, size, setup.device)
    learner = algorithms.algorithm(setup.trainer.algorithm).build(setup)
    learner.core.group = Group(rank, size, dist.all_reduce if address else Star([channel], root=False))
    attached: dict[str, SharedMemory] = {}
    try:
        while (message := channel.receive(timeout=None))[0] != "stop":
            kind, payload = message
            if kind == "load":
                learner.load_state_dict(payload)
            else:
                learner.learn(take_share(payload, attached))
    except LearnerLost as error:  # rank 0 is gone (its trainer crashed or was killed) or hung
        log.warning("learner replica %d: %s; exiting", rank, error)
        raise SystemExit(1) from None
    if address is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
