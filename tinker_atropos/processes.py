"""Process plumbing every service and the launcher share: free ports, children that die with their parent and are
reaped, SIGTERM/SIGINT as a drain, one BLAS thread, and the host identity behind the local fast path."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
from typing import Any

from threadpoolctl import threadpool_limits

log = logging.getLogger(__name__)


def limit_blas_threads() -> None:
    """One thread for numpy's BLAS in every service process.

    Each service sizes its own parallelism (``env.threads``, ``trainer.torch_threads``). OpenBLAS would add a
    thread per core that spins after each matmul, and on a host where the physics fills the cores those spins
    take one from it: collection of Humanoid on 2 cores went from 1,945 to 3,480 steps/s without them.
    """
    threadpool_limits(limits=1, user_api="blas")


_PR_SET_PDEATHSIG = 1


def local_host_id() -> str:
    """Who can take this process's local fast path: the host (name and boot id) and the network namespace, whose
    abstract Unix sockets are shared by its processes and no others. Written to the registry, so that a rollout
    prefers env services it reaches without gRPC; empty where it cannot be read (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()[:8]
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot_id}/{namespace}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_preexec(death_signal: int = signal.SIGTERM) -> None:
    """Run in a forked child: its own session (Ctrl-C reaches only the launcher, which drains it) and
    ``death_signal`` when the launcher dies, so that no child outlives it even after a SIGKILL. A child that may
    be paused (SIGSTOP) needs SIGKILL there: a stopped process leaves a SIGTERM pending for ever."""
    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout_s``; reaped either way (no zombie)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: service loops finish their step and return."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s, draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
