#!/usr/bin/env bash
# The reference workload on one 16-core GPU machine, as prepared runs of the device tool (issues 20, 35):
# Humanoid-v5 in env services of 8 instances on the CPU cores, rollouts sharing them, as many of each as the cores
# call for (`auto`), the trainer learning with APPO on CUDA (configs/humanoid-16core.yaml). Here first
# `bash bench/device_wheels.sh` (and `bash bench/device_check.sh`, which runs this script on the carried wheels
# alone); then two runs of the device tool, each within one command's 10 minutes:
#     run  command: PART=throughput bash bench/device_run.sh   carry: [".whl"]   timeout_s: 480   (~4 min)
#     run  command: PART=learn bash bench/device_run.sh        carry: [".whl"]   timeout_s: 480   (~6 min)
# (PART=all does both, ~10 min: too close to one command's limit.) They write to $OUT: throughput.log and bench.json
# (the physics limit, collection and training in alternating rounds, the trainer's busy fraction, the GPU's
# utilisation read by NVML, each service's CPU time per env step and the rollouts' spread of it); up.log and the
# learning run's metrics.jsonl (5 minutes). Here afterwards: `python -m bench charts bench.json` and
# `tinker-atropos report` on a folder holding metrics.jsonl draw the charts and the curve.
# CONFIG=, WINDOW_S=, ROUNDS=, WARMUP_S=, LEARN_S=, PY= override; on a machine without CUDA give a config with
# trainer.device cpu (bench/device_check.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/device}
CONFIG=${CONFIG:-configs/humanoid-16core.yaml}
PART=${PART:-all}
WINDOW_S=${WINDOW_S:-30}
ROUNDS=${ROUNDS:-3}
WARMUP_S=${WARMUP_S:-15}
LEARN_S=${LEARN_S:-300}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${PYTHONPATH:-}" ]; then  # the image's Python lacks some of our packages: the carried wheels
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{ nproc; nvidia-smi -L 2>/dev/null || echo "no GPU"; $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'; } | tee "$OUT/machine.log"
if [ "$PART" = all ] || [ "$PART" = throughput ]; then
    $PY -m bench throughput --config "$CONFIG" --phases limit,collect,train --warmup-s "$WARMUP_S" \
        --window-s "$WINDOW_S" --rounds "$ROUNDS" --out "$OUT" 2>&1 | tee "$OUT/throughput.log"
fi
if [ "$PART" = all ] || [ "$PART" = learn ]; then
    run_dir=$(mktemp -d)/run
    status=0
    $PY -m tinker_atropos up "$CONFIG" --run-dir "$run_dir" --max-seconds "$LEARN_S" --fresh > "$OUT/up.log" 2>&1 || status=$?
    cp "$run_dir/metrics.jsonl" "$OUT/"
    tail -n 6 "$OUT/up.log"
    exit "$status"
fi
