"""compose.yaml, checked against the Compose specification schema bundled in check-jsonschema, without a Docker
engine: its variables, health checks, volumes and secrets, and containers that run unprivileged and read-only."""

from __future__ import annotations

import re
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.support.deploy import (
    BIN,
    CA_KEY,
    COMPOSE_FILE,
    COMPOSE_VARIABLE,
    CONFIGS,
    IMAGE,
    REFERENCE_INSTANCES,
    ROOT,
    compose,
    compose_argv,
    compose_health_argv,
    compose_interpolate,
    compose_interpolated,
    compose_secret_keys,
    compose_services_of_our_image,
    dockerfile_arguments,
    image_environment,
    is_our_image,
    option_value,
    our_containers,
    package_version,
    pod_argv,
    render,
    security_environment,
    service_port,
)

# --- Compose -------------------------------------------------------------------------------------------------


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_matches_the_compose_specification():
    result = check_compose_schema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_a_misspelt_key(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("replicas:", "replica:"))
    result = check_compose_schema(broken)
    assert result.returncode != 0
    assert "'replica'" in result.stdout


def test_compose_runs_humanoid_on_4_env_containers_of_4_instances():
    services = compose_services_of_our_image()
    assert set(services) == {"env", "rollout", "trainer", "atropos-api"}
    # the trajectory API only with `--profile atropos`: a plain `up` runs the Humanoid workload alone
    assert [name for name, s in services.items() if "profiles" in s] == ["atropos-api"]
    assert services["atropos-api"]["profiles"] == ["atropos"]
    env = services["env"]
    instances = int(option_value(compose_argv(env), "--instances"))
    assert env["environment"]["TA_CONFIG"] == "/config/humanoid.yaml"
    assert env["deploy"]["replicas"] * instances == REFERENCE_INSTANCES


def test_compose_variables_have_defaults_and_pick_the_config_the_instances_and_the_images():
    text = COMPOSE_FILE.read_text()
    defaults = {match["name"]: match["default"] for match in COMPOSE_VARIABLE.finditer(text)}

    # Each has a default: `docker compose up` in a clean shell runs the reference workload on the public images.
    def strings(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for value in node.values():
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)
        elif isinstance(node, str):
            yield node

    for value in strings(compose()):
        compose_interpolated(value)
    assert set(defaults) == {
        "TA_COMPOSE_CONFIG",
        "TA_COMPOSE_ENV_INSTANCES",
        "VALKEY_IMAGE",
        "PYTHON_IMAGE",
        "TORCH_INDEX",
    }
    # The build arguments, as a mapping with the Dockerfile's own defaults: a bare `- NAME` is passed by Compose
    # v1 as an empty value where NAME is unset (`FROM ` would then fail).
    args = compose()["services"]["trainer"]["build"]["args"]
    assert args == {name: dockerfile_arguments()[name] for name in ("PYTHON_IMAGE", "TORCH_INDEX")}
    # What make compose-check brings up: Pendulum in every container of the image, 4 instances per env container,
    # a Valkey image made locally, and an empty TORCH_INDEX kept empty (no index) where an empty image is not.
    given = {
        "TA_COMPOSE_CONFIG": "pendulum.yaml",
        "TA_COMPOSE_ENV_INSTANCES": "4",
        "VALKEY_IMAGE": "local/valkey:8",
        "TORCH_INDEX": "",
        "PYTHON_IMAGE": "",
    }
    check = compose_interpolate(yaml.safe_load(text), given)
    for name, service in check["services"].items():
        if is_our_image(service["image"]):
            assert service["environment"]["TA_CONFIG"] == "/config/pendulum.yaml", name
            assert (CONFIGS / "pendulum.yaml").is_file()
    assert option_value(compose_argv(check["services"]["env"]), "--instances") == "4"
    assert check["services"]["redis"]["image"] == "local/valkey:8"
    assert check["services"]["trainer"]["build"]["args"] == {
        "PYTHON_IMAGE": "python:3.11-slim",
        "TORCH_INDEX": "",
    }


def test_compose_file_uses_nothing_compose_v1_or_engines_before_25_lack():
    """The first real start: Debian 12's docker-compose 1.29 refused the file for its top-level `name` and the
    health checks' `start_interval` (which Docker Engine has from 25 on; Debian 12's is 20.10)."""
    document = compose()
    assert "name" not in document
    for name, service in document["services"].items():
        assert "start_interval" not in service.get("healthcheck", {}), name


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|s|m|h)", duration))


def test_compose_health_checks_allow_a_loaded_machine_the_time_kubernetes_probes_allow():
    """The first real start on the 2-core machine: `tinker-atropos health` took 5-6 s of wall time (0.8-0.9 s of
    CPU, its imports) with the machine loaded, so the 5 s timeout failed the trainer's checks for a minute; at one
    check every 10 s, five containers' checks took a quarter of a core. The checks of the image's services allow
    the Kubernetes probes' timeout and run as often as their liveness probes."""
    [env] = [c for _, c in our_containers(render("base")) if pod_argv(c)[0] == "env"]
    probe_timeout, liveness_period = (
        env["livenessProbe"]["timeoutSeconds"],
        env["livenessProbe"]["periodSeconds"],
    )
    for name, service in compose_services_of_our_image().items():
        check = service["healthcheck"]
        assert seconds(check["timeout"]) >= probe_timeout, name
        assert seconds(check["interval"]) >= liveness_period, name


def test_compose_services_share_configs_and_redis_and_wait_for_it():
    services = compose()["services"]
    declared_volumes = set(compose()["volumes"])
    redis_service = services["redis"]
    [data] = [volume for volume in redis_service["volumes"] if volume.endswith(":/data")]
    assert data.split(":")[0] in declared_volumes
    for name, service in compose_services_of_our_image().items():
        assert service["image"] == f"{IMAGE}:{package_version()}", name
        assert "./configs:/config:ro" in service["volumes"], name
        config = Path(service["environment"]["TA_CONFIG"])
        assert config.parent == Path("/config") and (CONFIGS / config.name).is_file(), name
        assert urlsplit(service["environment"]["TA_REDIS_URL"]).hostname == "redis", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        # A published host port would stop `--scale` from starting a second container of the service.
        assert "ports" not in service, name
        health = compose_health_argv(service)
        assert health[0] == "health" and health[1] == f"localhost:{service_port(compose_argv(service))}", name
    # One service builds the image the others run; building it once per service would repeat the torch layer.
    assert len([service for service in services.values() if "build" in service]) == 1


def test_compose_trainer_keeps_checkpoints_on_a_named_volume():
    trainer = compose()["services"]["trainer"]
    run_dir = option_value(compose_argv(trainer), "--run-dir")
    [volume] = [v for v in trainer["volumes"] if v.split(":")[1] == run_dir]
    assert volume.split(":")[0] in compose()["volumes"]


def test_compose_services_get_the_token_and_mutual_tls_from_secrets():
    problems = []
    for name, service in compose_services_of_our_image().items():
        environment = {**image_environment(), **service["environment"]}
        files = compose_secret_keys(service)
        problems += security_environment(f"compose {name}", environment, compose_argv(service), files)
    assert not problems, "\n".join(problems)
    # Valkey gets the password, and nothing else of the secrets.
    assert set(compose_secret_keys(compose()["services"]["redis"]).values()) == {"redis-password"}


def test_compose_secrets_are_what_its_documented_command_writes_readable_by_the_containers(tmp_path):
    [command] = re.findall(r"^#\s+(tinker-atropos secrets .*)$", COMPOSE_FILE.read_text(), re.MULTILINE)
    argv = shlex.split(command)
    result = subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    declared = compose()["secrets"]
    assert declared
    for name, secret in declared.items():
        made = tmp_path / secret["file"]
        assert made.is_file() and made.read_bytes().strip(), f"{name}: {command} writes no {secret['file']}"
        # Bind-mounted with its host owner, read by uid 10001 or 999 in the container.
        assert made.stat().st_mode & stat.S_IROTH, (
            f"{name}: {secret['file']} is not readable by the containers"
        )
        assert PurePosixPath(secret["file"]).name != CA_KEY
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    # Kept out of git and out of the image's build context.
    ignored = subprocess.run(["git", "check-ignore", "-q", "secrets/token"], cwd=ROOT)
    assert ignored.returncode == 0, "secrets/ is not in .gitignore"
    admitted_to_context = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert not any(line.startswith("!secrets") for line in admitted_to_context)


def test_every_compose_container_is_unprivileged_read_only_and_without_capabilities():
    for name, service in compose()["services"].items():
        assert service["read_only"] is True, name
        assert "/tmp" in service["tmpfs"], name
        assert service["cap_drop"] == ["ALL"] and "cap_add" not in service, name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged"), name
        # The image of the services runs as 10001 (Dockerfile); Valkey's would start as root and switch, which
        # needs capabilities: it must start as its user.
        user = service.get("user")
        if is_our_image(service["image"]):
            assert user is None, name
        else:
            assert user is not None and int(str(user).split(":")[0]) > 0, name
        # Writable only: named volumes (no bind mount the container could write to the host through).
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            assert mode == ["ro"] or source in compose()["volumes"], f"{name}: {volume}"
