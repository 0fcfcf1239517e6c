"""The capacity benchmark's short version (``bench/capacity.py``, ``python -m bench capacity``): rollouts' and a
trainer's Redis traffic against a Valkey with the run's ACL and signed records, weights fetched by several rollouts,
the Atropos store flat out, the trainer's update learned by one learner and by two. It asserts that the load is the run's own (no ACL denial, every record verified and
decoded, flow control instead of drops, each fetch the version just published) and that every figure is written;
where each part saturates is the benchmark's to measure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.capacity import CapacityOptions, run_capacity, table

pytestmark = pytest.mark.integration


def test_rollouts_a_trainer_and_weights_fetches_load_the_acl_valkey_and_every_figure_is_written(
    tmp_path: Path,
) -> None:
    options = CapacityOptions(
        rollouts=(1, 2),
        fetchers=(1, 3),
        window_s=2.0,
        weights_mb=(0.2,),
        learners=((1, 1), (2, 1)),
        learning_shapes=("humanoid-16core",),
    )
    result = run_capacity(options, tmp_path)

    assert result["acl_denials"] == []
    steps = options.instances * options.steps
    assert result["conditions"]["steps_per_chunk"] == steps
    for point in result["experience"]:
        assert point["chunks_s"] > 0, point
        assert point["rejected"] == 0 and point["dropped"] == 0, point
        assert point["env_steps_s"] == pytest.approx(point["chunks_s"] * steps)
        assert point["mb_s"] == pytest.approx(point["chunks_s"] * result["conditions"]["chunk_bytes"] / 1e6)
        assert point["valkey_cpu_ms_per_chunk"] > 0 and point["trainer_decode_us_per_step"] > 0
        assert point["rollouts_cpu"] > 0 and point["trainer_cpu"] > 0
        assert "evalsha" in point["top_commands"]  # the append script: what a chunk costs Valkey
    assert [p["rollouts"] for p in result["experience"]] == [1, 2]
    assert [w["fetchers"] for w in result["weights"]] == [1, 3]
    assert all(w["fetched_current"] == 1.0 and w["all_fetched_ms"] > 0 for w in result["weights"])
    assert result["llm"]["groups_s"] > 0 and result["llm"]["valkey_cpu_ms_per_group"] > 0
    one, two = result["learning"]  # the trainer's update learned by one learner, then by two
    assert (one["learners"], two["learners"]) == (1, 2) and one["x_first"] == 1.0
    assert one["env_steps_s"] > 0 and two["env_steps_s"] > 0
    assert one["collectives_share"] == 0 and two["collectives_share"] > 0 and two["allreduce_ms_per_step"] > 0
    assert json.loads((tmp_path / "capacity.json").read_text()) == result
    lines = table(result).splitlines()
    figures = [line for line in lines if re.match(r"\| \d", line)]
    assert len(figures) == 2 + 2  # a row per rollout count and per fetcher count
    assert len([line for line in lines if line.startswith("| humanoid-16core |")]) == 2
