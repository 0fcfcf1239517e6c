"""Process-level settings every service applies at start."""

import json
import subprocess
import sys

PROBE = """
import json
import numpy
from threadpoolctl import threadpool_info
from tinker_atropos.runtime import limit_blas_threads
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
