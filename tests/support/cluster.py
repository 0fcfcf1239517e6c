"""A multi-node run on one machine: a trainer node (Valkey, trainer, rollout), env nodes (one env service each) and
optionally more rollout nodes (one rollout each, sharing the env services with the trainer node's), every node a
network namespace with its own address (see ``netns``).

Each service binds and advertises its node's address on the default port of its kind, as on separate machines,
and is found through the registry. The links are secured as a deployment secures them, with the files of
``tinker-atropos secrets``: the token and mutual TLS on every gRPC call (certificates checked for the name
``tinker-atropos``, since services advertise bare node addresses), Valkey's password. ``make demo-cluster`` runs
this until Ctrl-C; ``tests/services/test_multinode.py`` cuts an env node's link and restores it, and kills a rollout node's
rollout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.netns import Network, Node, unavailable_reason
from tinker_atropos.launcher.secrets import SERVICE_NAME, write_secrets
from tinker_atropos.processes import stop_on_signals
from tinker_atropos.state.embedded import EmbeddedValkey

REDIS_PORT = 6379
STOP_TIMEOUT_S = 15.0


@dataclass
class Cluster:
    """The nodes, the Valkey server and the service processes of one multi-node run."""

    network: Network
    log_dir: Path
    secrets: Path
    valkey: EmbeddedValkey | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    env_node_count: int = 0  # the nodes after the trainer's: env nodes, then rollout nodes

    @property
    def trainer_node(self) -> Node:
        return self.network.nodes[0]

    @property
    def env_nodes(self) -> list[Node]:
        return self.network.nodes[1 : 1 + self.env_node_count]

    @property
    def rollout_nodes(self) -> list[Node]:
        return self.network.nodes[1 + self.env_node_count :]

    @property
    def redis_url(self) -> str:
        return f"redis://{self.trainer_node.address}:{REDIS_PORT}/0"

    @property
    def environment(self) -> dict[str, str]:
        """What every service of the cluster is given: where its secrets are."""
        files = {
            "TA_TOKEN_FILE": "token",
            "TA_TLS_CERT": "tls.crt",
            "TA_TLS_KEY": "tls.key",
            "TA_TLS_CA": "ca.crt",
            "TA_TLS_CLIENT_CA": "ca.crt",
            "TA_REDIS_PASSWORD_FILE": "redis-password",
        }
        return {name: str(self.secrets / file) for name, file in files.items()} | {
            "TA_TLS_SERVER_NAME": SERVICE_NAME
        }

    def start_service(self, node: Node, kind: str, config_path: Path, *extra: str) -> None:
        name = f"{kind}@{node.name}"
        args = [sys.executable, "-m", "tinker_atropos", kind, "--config", str(config_path)]
        args += ["--redis-url", self.redis_url, "--host", node.address, "--advertise-host", node.address]
        self.processes[name] = node.popen([*args, *extra], self.log_dir / f"{name}.log", self.environment)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def close(self) -> None:
        """Drain every service (SIGTERM), kill what does not stop in time, then remove the nodes."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.valkey is not None:
            self.valkey.stop()
        self.network.close()


def start_cluster(
    config_path: Path, work_dir: Path, env_nodes: int = 4, instances: int = 4, rollout_nodes: int = 0
) -> Cluster:
    """Create the nodes and start every service on its node; whatever was made is removed if a step fails."""
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(Network(), log_dir, work_dir / "secrets", env_node_count=env_nodes)
    write_secrets(cluster.secrets, force=True)
    try:
        trainer_node = cluster.network.add_node("trainer")
        for i in range(1, env_nodes + 1):
            cluster.network.add_node(f"env{i}")
        for i in range(1, rollout_nodes + 1):
            cluster.network.add_node(f"rollout{i}")
        with trainer_node.entered():
            password = (cluster.secrets / "redis-password").read_text().strip()
            cluster.valkey = EmbeddedValkey(
                work_dir / "valkey", REDIS_PORT, host=trainer_node.address, password=password
            )
        cluster.start_service(trainer_node, "trainer", config_path, "--run-dir", str(work_dir / "run"))
        cluster.start_service(trainer_node, "rollout", config_path)
        for node in cluster.env_nodes:
            cluster.start_service(node, "env", config_path, "--instances", str(instances))
        for node in cluster.rollout_nodes:
            cluster.start_service(node, "rollout", config_path)
    except BaseException:
        cluster.close()
        raise
    return cluster


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("configs/pendulum.yaml"), help="Run config.")
    parser.add_argument("--env-nodes", type=int, default=4, help="Env nodes, one env service each.")
    parser.add_argument("--instances", type=int, default=4, help="Env instances per env service.")
    parser.add_argument(
        "--rollout-nodes", type=int, default=0, help="Rollout nodes besides the trainer node's."
    )
    parser.add_argument("--work-dir", type=Path, default=Path("runs/demo-cluster"), help="Logs, checkpoints.")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"demo-cluster needs network namespaces ({reason}); run it as root", file=sys.stderr)
        return 2
    stop = stop_on_signals()  # set before the start, so that a Ctrl-C during it still tears everything down
    cluster = start_cluster(args.config, args.work_dir, args.env_nodes, args.instances, args.rollout_nodes)
    try:
        hub = cluster.network.hub
        print(f"nodes: {', '.join(f'{n.name} {n.address}' for n in cluster.network.nodes)}")
        print(f"logs:  {cluster.log_dir}/")
        print(
            f"watch: TA_REDIS_PASSWORD_FILE={cluster.secrets / 'redis-password'} "
            f"{Path(sys.executable).parent / 'tinker-atropos'} status --redis-url {cluster.redis_url}"
        )
        print(f"cut a node: ip -n {hub} link set env1 down   (restore: ... up)")
        print("Ctrl-C stops the services and removes the nodes.", flush=True)
        while not stop.wait(1.0):
            exited = [name for name, process in cluster.processes.items() if process.poll() is not None]
            if exited:
                print(f"{', '.join(exited)} exited; see its log. Stopping.", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
