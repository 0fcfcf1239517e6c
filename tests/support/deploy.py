"""The shipped deployment files as the deploy tests read them: the kustomize tree rendered with `kubectl kustomize`,
compose.yaml interpolated as Compose does it, the Dockerfile parsed by BuildKit's own parser, and the CLI each
container runs."""

from __future__ import annotations

import ast
import base64
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
from pathlib import Path, PurePosixPath
from typing import Any

import dockerfile
import kubernetes_validate
import pytest
import yaml

from tinker_atropos.launcher.secrets import FILES, SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CONFIGS = ROOT / "configs"
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
VALKEY_DOCKERFILE = ROOT / "deploy" / "valkey.Dockerfile"
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


# ${NAME:-default} (the default where NAME is unset or empty) and ${NAME-default} (where unset), as Compose writes
# them; $$ is a literal $.
COMPOSE_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<how>:?-)(?P<default>[^}]*)\}")


def compose_interpolate(node: Any, environment: dict[str, str] | None = None) -> Any:
    """compose.yaml's parsed document with each variable in its strings replaced as Compose replaces them (after
    parsing: an empty value stays an empty string), from ``environment`` (none set: the defaults, what
    `docker compose up` in a clean shell runs)."""
    environment = environment or {}

    def value(match: re.Match[str]) -> str:
        given = environment.get(match["name"])
        unset = given is None or (match["how"] == ":-" and given == "")
        return match["default"] if unset else given

    if isinstance(node, dict):
        return {key: compose_interpolate(item, environment) for key, item in node.items()}
    if isinstance(node, list):
        return [compose_interpolate(item, environment) for item in node]
    return COMPOSE_VARIABLE.sub(value, node) if isinstance(node, str) else node


@functools.cache
def compose() -> dict[str, Any]:
    """compose.yaml as Compose reads it with no variable set."""
    return compose_interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


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
    """A value of compose() (its variables replaced) as the container gets it: $$ is a literal $, and a single $
    left would be a variable without a default (or an unescaped $ for the shell)."""
    assert "$" not in value.replace("$$", ""), (
        f"a Compose variable without a default (or an unescaped $ for the shell): {value!r}"
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


def dockerfile_arguments(path: Path = DOCKERFILE) -> dict[str, str]:
    """The build arguments declared before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            break
        if command.cmd == "ARG":
            name, _, default = command.value[0].partition("=")
            args[name] = default
    return args


@functools.cache
def dockerfile_stages() -> dict[str, Stage]:
    """Stages by name, in file order, with global ARG defaults substituted into FROM."""
    args = dockerfile_arguments()
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
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


def mounts(command: dockerfile.Command) -> list[dict[str, str]]:
    """The --mount options of a RUN, each as its key=value pairs."""
    return [
        dict(part.split("=", 1) for part in value.removeprefix("--mount=").split(","))
        for value in command.flags
        if value.startswith("--mount=")
    ]


def context_sources(name: str) -> set[str]:
    """What a stage takes from the build context, through the stages it is built FROM and copies from: COPY
    sources and bind mounts."""
    stages, taken = dockerfile_stages(), set()
    for stage in stage_chain(name):
        for command in stage.commands:
            if command.cmd in ("COPY", "ADD"):
                source = flag(command, "from")
                if source is None:
                    taken |= {path.rstrip("/") for path in command.value[:-1]}
                elif source in stages:
                    taken |= context_sources(source)
            elif command.cmd == "RUN":
                for mount in mounts(command):
                    if mount.get("type") == "bind" and "from" not in mount:
                        taken.add(mount["source"].rstrip("/"))
    return taken


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


# The seed's reference workload: 16 Humanoid instances over 4 nodes. configs/humanoid.yaml sizes its env services
# to the machine `up` runs on (`services: auto`), so on a cluster the instances are the overlay's to set.
REFERENCE_INSTANCES = 16


def compose_secret_keys(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> the file of `tinker-atropos secrets` behind it, for a service's secrets."""
    files = {}
    for path, file in compose_secret_files(service).items():
        assert PurePosixPath(file).parent == PurePosixPath("secrets"), f"{file}: not in ./secrets"
        files[path] = PurePosixPath(file).name
    return files
