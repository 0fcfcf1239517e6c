"""CUDA learners' NCCL join (``trainer.learner_replicas``): ``NCCL_SOCKET_IFNAME`` reaches NCCL while the group is
made, eagerly (bound to the learner's GPU, so NCCL reads it then), and nothing else in the trainer sees it. No GPU
here: torch.distributed's join is replaced by one that records what it was given."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tinker_atropos.trainer import learner_replicas


@pytest.mark.parametrize("before", [None, "eth0"], ids=["unset", "set"])
def test_nccl_sees_the_loopback_interface_only_while_joining(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", before)
    joined: list[tuple[str | None, dict[str, Any]]] = []

    def join(backend: str, **options: Any) -> None:
        joined.append((os.environ.get("NCCL_SOCKET_IFNAME"), {"backend": backend, **options}))

    monkeypatch.setattr(learner_replicas.dist, "init_process_group", join)
    address = learner_replicas.nccl_store(tmp_path / "learners")
    assert os.environ.get("NCCL_SOCKET_IFNAME") == before  # the store alone sets nothing
    learner_replicas.join_nccl(address, 1, 2, torch.device("cuda", 1))

    [(seen, options)] = joined
    assert seen == "lo"
    assert options == {
        "backend": "nccl",
        "init_method": address,
        "rank": 1,
        "world_size": 2,
        "timeout": learner_replicas.TIMEOUT,
        "device_id": torch.device(
            "cuda", 1
        ),  # eager: NCCL makes its communicator, reading the variable, here
    }
    assert os.environ.get("NCCL_SOCKET_IFNAME") == before


def test_the_variable_is_put_back_when_the_join_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)

    def join(backend: str, **options: Any) -> None:
        raise RuntimeError("NCCL error")

    monkeypatch.setattr(learner_replicas.dist, "init_process_group", join)
    with pytest.raises(RuntimeError, match="NCCL error"):
        learner_replicas.join_nccl("file:///nowhere", 0, 2, torch.device("cuda", 0))
    assert "NCCL_SOCKET_IFNAME" not in os.environ
