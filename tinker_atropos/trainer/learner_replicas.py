"""The other data-parallel learners (``trainer.learners`` > 1): started beside the trainer, each handed its share of
every batch the trainer learns from.

The trainer stays the one learner that reads the stream, checks and takes each chunk once, guards, checkpoints
and publishes (rank 0). It starts ``learners - 1`` replica processes on this machine and deals each batch out
(``deal``: whole runs of chunks that continue one another, so that advantages run over them as with one learner);
every learner computes the advantages of its share, and ``ppo_update`` makes each step the whole minibatch's
(``training/data_parallel.py``). Nothing is learned twice: only rank 0 takes experience, and each chunk goes to
one learner. A replica lost mid-run fails the trainer's next collective: the trainer stops with an error and
restarts from its last checkpoint, as after any trainer crash, with new replicas; a replica whose trainer is gone
exits at its next message. Gloo carries the collectives, on CPU tensors or CUDA ones (each learner on a GPU of
its own where the machine has several).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import Learner, LearnerSetup
from tinker_atropos.errors import FatalError
from tinker_atropos.protocol.trajectory import Trajectory, contiguous_runs
from tinker_atropos.training.data_parallel import Group

log = logging.getLogger(__name__)

GLOO_INTERFACE, LOOPBACK = "GLOO_SOCKET_IFNAME", "lo"
READY = b"ready\n"  # what a replica prints once it has started, before it joins the learners
SHM = "/dev/shm"  # where Python's shared memory lives on Linux; 64 MB in a container unless it is given more
# the longest a learner waits for the others; past it (a hung one) the trainer restarts
TIMEOUT = timedelta(seconds=60)


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


class Replicas:
    """Rank 0's side: the ``size - 1`` replica processes, started here, fed by scatter."""

    def __init__(self, setup: LearnerSetup, size: int, threads: int) -> None:
        self.size, self.minibatches = size, setup.hyperparameters.num_minibatches
        # The learners meet in a file of a private folder, not a TCP store (which would listen on every
        # interface), and gloo's connections stay on the loopback interface: nothing outside this machine, or
        # of another user, can join or speak to them.
        self.folder = tempfile.mkdtemp(prefix="learners-")
        address = f"file://{self.folder}/store"
        os.environ[GLOO_INTERFACE] = LOOPBACK
        blob = pickle.dumps((setup, address, size, threads))
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, size):
            process = subprocess.Popen(
                [sys.executable, "-m", "tinker_atropos.trainer.learner_replicas", str(rank)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": str(threads), GLOO_INTERFACE: LOOPBACK},
            )
            assert process.stdin is not None
            process.stdin.write(blob)
            process.stdin.close()
            self.processes.append(process)
        try:
            for rank, process in enumerate(self.processes, 1):  # one that fails to start is known at once,
                assert process.stdout is not None  # not after the rendezvous's timeout
                if process.stdout.readline() != READY:
                    raise RuntimeError(
                        f"learner replica {rank} exited with code {process.wait()} before joining (its error above)"
                    )
            dist.init_process_group("gloo", init_method=address, rank=0, world_size=size, timeout=TIMEOUT)
        except BaseException:
            self._kill()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.group = Group(0, size)
        self.shelf = SharedShares()
        log.info("learning data-parallel with %d learners (%d replica processes)", size, size - 1)

    @classmethod
    def beside(cls, learner: Learner, setup: LearnerSetup, size: int, threads: int) -> Replicas | None:
        """The replicas of ``learner`` (rank 0) for ``size`` learners, started from its state; None for one."""
        if size == 1:
            return None
        replicas = cls(setup, size, threads)
        learner.core.group = replicas.group
        replicas.load(learner.state_dict())
        return replicas

    def _send(self, messages: list[tuple[str, Any]]) -> Any:
        """One message to each learner, this one's first; what this one received back."""
        received: list[Any] = [None]
        dist.scatter_object_list(received, messages, src=0)
        return received[0][1]

    def load(self, state: dict[str, Any]) -> None:
        """Every replica takes the learner's state (at the start, and after a restore: an undone update)."""
        self._send([("load", state)] * self.size)

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
        messages = [("learn", self.shelf.put(rank, [replace(c, episodes=()) for c in share]))
                    for rank, share in enumerate(shares[1:], 1)]  # fmt: skip
        self._send([("learn", None), *messages])
        return shares[0]

    def close(self) -> None:
        """The replicas told to stop, and waited for; killed if they do not."""
        try:
            self._send([("stop", None)] * self.size)
            for process in self.processes:
                process.wait(timeout=30)
        except Exception as error:  # a replica already gone: the group is broken, the rest are killed
            log.warning("stopping the learner replicas: %s", error)
        finally:
            self._kill()
            self.shelf.close()
            dist.destroy_process_group()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def serve(rank: int) -> None:
    """A replica: join the group, then apply what rank 0 sends until told to stop (or rank 0 is gone)."""
    setup, address, size, threads = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(threads)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    os.dup2(2, 1)  # nobody reads the pipe from here on: what is printed goes to the trainer's log
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size, timeout=TIMEOUT)
    setup = replace(setup, device=rank_device(setup.device, rank))
    learner = algorithms.algorithm(setup.trainer.algorithm).build(setup)
    learner.core.group = Group(rank, size)
    attached: dict[str, SharedMemory] = {}
    while True:
        received: list[Any] = [None]
        try:
            dist.scatter_object_list(received, None, src=0)
        except RuntimeError as error:  # rank 0 is gone (its trainer crashed or was killed)
            log.warning("learner replica %d: rank 0 is gone (%s); exiting", rank, error)
            raise SystemExit(1) from None
        kind, payload = received[0]
        if kind == "stop":
            break
        if kind == "load":
            learner.load_state_dict(payload)
        else:
            learner.learn(take_share(payload, attached))
    dist.destroy_process_group()
    # torch's static destructors abort at exit here now and then (a joinable thread: "terminate called without
    # an active exception"): the work is done, nothing is left to flush
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
