"""The kustomize tree under deploy/k8s, rendered by `kubectl kustomize` and checked against the Kubernetes OpenAPI
schemas bundled in kubernetes-validate, without a cluster: every service container gets the run's token and mutual
TLS from mounted secrets, runs unprivileged on a read-only root filesystem, and NetworkPolicies admit exactly the
connections the run makes."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.support.deploy import (
    CA_KEY,
    CONFIGS,
    INSECURE,
    KUBERNETES_VERSIONS,
    KUSTOMIZATIONS,
    OUTSIDER,
    README,
    REFERENCE_INSTANCES,
    SECRET_FILE_OF,
    admitted,
    component,
    image_environment,
    kustomize,
    matches,
    objects_of,
    option_value,
    our_containers,
    package_version,
    pod_argv,
    pod_environment,
    pod_labels,
    pod_volumes,
    render,
    run_config,
    secret_files,
    security_environment,
    selects,
    service_port,
    the_object,
    workloads,
)
from tinker_atropos.launcher.secrets import FILES

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
        # each, so no probe may give up after the default second, and the startup probe allows 2 minutes. The
        # Compose stack on a loaded 2-core machine measured 5-6 s of wall time per check (make compose-check),
        # where a 5 s timeout failed: twice that.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["tinker-atropos", "health", f"localhost:{port}"], (
                f"{where}: {probe}"
            )
            assert container[probe]["timeoutSeconds"] >= 10, f"{where}: {probe}"
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
    expected = {
        key: value & present
        for key, value in ADMITTED.items()
        if key[0] in present and ADDED_BY.get(key, name) == name
    }
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
    rules = [
        rule
        for policy in objects_of(objects, "NetworkPolicy")
        for rule in policy["spec"].get("ingress", [])
        if any(entry.get("port") == "metrics" for entry in rule.get("ports", []))
    ]
    assert rules and all(
        rule["from"] == MONITORING and rule["ports"] == [{"port": "metrics"}] for rule in rules
    )
    assert not [
        rule
        for policy in objects_of(objects, "NetworkPolicy")
        for rule in policy["spec"].get("ingress", [])
        if "ports" not in rule
    ], "a rule that opens every port, metrics included"


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


def test_humanoid_16_overlay_serves_16_instances_from_4_env_pods():
    objects = render("humanoid-16")
    env = the_object(objects, "Deployment", "env")
    [container] = env["spec"]["template"]["spec"]["containers"]
    environment = pod_environment(objects, container)
    assert environment["TA_CONFIG"] == "/config/humanoid.yaml"
    instances_per_pod = int(environment["TA_INSTANCES"])
    assert env["spec"]["replicas"] == 4
    assert env["spec"]["replicas"] * instances_per_pod == REFERENCE_INSTANCES


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
