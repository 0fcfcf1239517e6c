#!/usr/bin/env bash
# The seed's reference workload on one 16-core GPU machine, as one prepared run of the device tool (issue 20):
# Humanoid-v5 in 12 env services of 4 instances on the CPU cores, 3 rollout services, the trainer on CUDA
# (configs/humanoid-16core.yaml). Here first `bash bench/device_wheels.sh`; then, with the device tool,
#     run  command: bash bench/device_run.sh   carry: [".whl"]   timeout_s: 600
# It writes to $OUT: bench.json and bench.png (the physics limit, collection and training in alternating rounds,
# the trainer's busy fraction and each service's CPU time per env step, which names the bottleneck), the
# learning run's metrics.jsonl and its report (curve.png), and the two logs. About 8 minutes.
# CONFIG=, WINDOW_S=, ROUNDS=, LEARN_S= override; on a machine without CUDA give a config with trainer.device cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/device}
CONFIG=${CONFIG:-configs/humanoid-16core.yaml}
WINDOW_S=${WINDOW_S:-45}
ROUNDS=${ROUNDS:-3}
LEARN_S=${LEARN_S:-180}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the image's Python lacks some of our packages: the carried wheels
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{ nproc; nvidia-smi -L 2>/dev/null || echo "no GPU"; $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'; } | tee "$OUT/throughput.log"
$PY -m bench throughput --config "$CONFIG" --phases limit,collect,train --warmup-s 15 --window-s "$WINDOW_S" \
    --rounds "$ROUNDS" --out "$OUT" 2>&1 | tee -a "$OUT/throughput.log"
run_dir=$(mktemp -d)/run
$PY -m tinker_atropos up "$CONFIG" --run-dir "$run_dir" --max-seconds "$LEARN_S" --fresh > "$OUT/up.log" 2>&1
cp "$run_dir/metrics.jsonl" "$OUT/"
$PY -m tinker_atropos report "$run_dir" --out "$OUT/curve.png"
tail -n 3 "$OUT/up.log"
