"""Writes ``deploy/k8s/run-configs/kustomization.yaml`` from ``configs/*.yaml``: ``make deploy-configs``.

The Kubernetes pods mount every run config at /config, as Compose mounts ``configs/``. kustomize reads generator
files only inside a kustomization's own folder, so the run configs are inlined here as literals of a
configMapGenerator (which also names the ConfigMap after its content, so pods roll when a config changes).
``tests/deploy/test_kubernetes.py`` fails when the written file is behind ``configs/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "deploy" / "k8s" / "run-configs" / "kustomization.yaml"
HEADER = """\
# Written by `make deploy-configs` (deploy/k8s/run_configs.py) from configs/*.yaml: edit those, not this.
# ConfigMap "run-configs": every run config, mounted read-only at /config in the pods.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
configMapGenerator:
  - name: run-configs
    literals:
"""


def render(configs: Path = ROOT / "configs") -> str:
    literals = []
    for path in sorted(configs.glob("*.yaml")):
        lines = f"{path.name}={path.read_text()}".splitlines()
        literals.append("      - |\n" + "".join(f"        {line}\n" if line else "\n" for line in lines))
    return HEADER + "".join(literals)


if __name__ == "__main__":
    TARGET.write_text(render())
    sys.exit(print(TARGET.relative_to(ROOT)))
