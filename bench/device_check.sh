#!/usr/bin/env bash
# Proves bench/device_wheels.sh's list complete before a GPU machine is spent on it: the carried wheels, and numpy
# and torch alone besides (what the GPU image is sure to have), installed into an empty Python 3.12 as
# bench/device_run.sh installs them there; then both parts of the device run, on the CPU and cut short: the
# throughput phases (limit, collect, train, every service a process of its own) and the learning run (`up`). Any
# module they import that the wheels lack fails it. PYTHON= a Python 3.12 (default: python3.12, or pyenv's 3.12).
# About 5 minutes here; the first time, 5 more to install numpy and torch (4.7 GB: the CUDA build pip finds for
# Python 3.12 here), kept in WORK for the next check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.12 >/dev/null && python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || PYENV_VERSION=3.12.1 python3.12 -c 'import sys; print(sys.executable)')}
work=${WORK:-/tmp/ta-device-check}
rm -rf "$work/venv" "$work/site" "$work/out" && mkdir -p "$work"
bash bench/device_wheels.sh
"$PYTHON" -m venv --without-pip "$work/venv"  # empty: no site-packages of this machine
py=$work/venv/bin/python
numpy=$(grep -o '"numpy==[^"]*"' pyproject.toml | tr -d '"')
torch=$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
if [ ! -e "$work/image/.$numpy-$torch" ]; then  # the image's own, as pip brings them (kept for the next check)
    rm -rf "$work/image"
    "$PYTHON" -m pip install --quiet --target "$work/image" "$numpy" "$torch"
    touch "$work/image/.$numpy-$torch"
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl
export PYTHONPATH=$work/site:$work/image:$PWD PYTHONUNBUFFERED=1
"$py" - "$work/cpu.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/humanoid-16core.yaml"))
config["trainer"]["device"] = "cpu"  # no GPU here; the same services and imports
config["trainer"]["samples_per_update"] = 2048
config["env"]["services"], config["rollout"]["replicas"] = 2, 2  # what this machine's cores can hold
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
OUT=$work/out CONFIG=$work/cpu.yaml PY=$py WINDOW_S=2 ROUNDS=1 WARMUP_S=1 LEARN_S=60 bash bench/device_run.sh
"$py" -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["collect_env_steps_per_s"] > 0 and r["train_env_steps_per_s"] > 0, r' "$work/out/bench.json"
"$py" -c 'import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; assert rows[-1]["env_steps"] > 0, rows[-1]' "$work/out/metrics.jsonl"
echo "device run's imports complete with $(ls .whl | wc -l) wheels ($(du -sh .whl | cut -f1)), numpy and torch"
