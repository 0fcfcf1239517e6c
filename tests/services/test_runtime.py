"""Process-level settings every service applies at start."""

import json
import subprocess
import sys
import time

from tests.support.processes import process_state

PROBE = """
import json
import numpy
from threadpoolctl import threadpool_info
from tinker_atropos.processes import limit_blas_threads
before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
limit_blas_threads()
after = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print(json.dumps({"before": before, "after": after}))
"""


def test_limit_blas_threads_leaves_numpy_one_blas_thread() -> None:
    """Run in a fresh interpreter with two BLAS threads allowed, as a service starts on a 2-core host."""
    env = {"OPENBLAS_NUM_THREADS": "2", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    threads = json.loads(out.stdout)
    assert threads["before"] and max(threads["before"]) == 2  # numpy's OpenBLAS is there and threaded
    assert threads["after"] == [1] * len(threads["before"])


PARENT = """
import functools, signal, subprocess, sys
from tinker_atropos.processes import child_preexec
child = subprocess.Popen(["sleep", "60"], preexec_fn=functools.partial(child_preexec, signal.SIGKILL))
child.send_signal(signal.SIGSTOP)
print(child.pid, flush=True)
signal.pause()
"""


def test_a_paused_child_does_not_outlive_its_killed_parent_when_its_death_signal_is_sigkill() -> None:
    """The benchmark pauses service processes between its slices; a SIGTERM would stay pending in them."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while process_state(child) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process_state(child) == "T", "the child was not paused"

    parent.kill()
    parent.wait()

    while process_state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process_state(child) in (None, "Z"), f"the paused child {child} outlived its parent"
