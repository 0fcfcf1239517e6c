"""GPU check of the trainer: PPO updates on CUDA against CPU (same seed, same data), and the rollout's inference.

Needs a CUDA machine; run from the repository root: ``python -m bench.gpu_check`` writes gpu_check.json to $OUT
(or here). No simulator is needed. Reference result: bench/results/gpu_check.json.
"""

import json
import os
import time

import gymnasium as gym
import numpy as np
import torch
import yaml

from tests.support.records import HUMANOID_ACT as ACT
from tests.support.records import HUMANOID_N as N
from tests.support.records import HUMANOID_OBS as OBS
from tests.support.records import HUMANOID_T as T
from tests.support.records import humanoid_chunks
from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import LearnerSetup
from tinker_atropos.config import TrainerSection
from tinker_atropos.models.acting import InferencePolicy
from tinker_atropos.models.mlp import ActorCritic


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def updates(trainer: TrainerSection, device: torch.device, chunks, repeats: int) -> dict:
    spaces = gym.spaces.Box(-np.inf, np.inf, (OBS,)), gym.spaces.Box(-0.4, 0.4, (ACT,))
    setup = LearnerSetup(*spaces, trainer, trainer.hyperparameters, device, seed=7)
    learner = algorithms.algorithm(trainer.algorithm).build(setup)
    first = learner.learn(chunks)  # also the warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        learner.learn(chunks)
    sync(device)
    seconds = (time.perf_counter() - start) / repeats
    samples = len(chunks) * T * N
    return {
        "update_s": seconds,
        "samples_per_s": samples * trainer.hyperparameters.update_epochs / seconds,
        "first": first,
        "spec": learner.core.spec,
    }


def act_latency(spec: dict, device: torch.device) -> float:
    network = InferencePolicy.of_model(ActorCritic(spec), device)
    obs = np.random.default_rng(0).normal(size=(N, OBS)).astype(np.float32)
    for _ in range(50):  # numpy in and out, as a rollout calls it (torch on the device in between)
        network.act(obs)
    start = time.perf_counter()
    for _ in range(500):
        network.act(obs)
    return (time.perf_counter() - start) / 500


def main() -> None:
    torch.set_num_threads(1)  # the trainer's default (trainer.torch_threads)
    with open("configs/humanoid.yaml") as f:  # the trainer section only: the env section needs gymnasium
        trainer = TrainerSection.model_validate(yaml.safe_load(f)["trainer"])
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpu_threads": 1,
        "cases": {},
    }
    cases = {
        "humanoid.yaml: 4 chunks = 4096 samples, 64x64, 10 epochs x 8 minibatches": ([64, 64], 4, 3),
        "wide: 64 chunks = 65536 samples, 256x256, 10 epochs x 8 minibatches": ([256, 256], 64, 1),
    }
    for name, (hidden, count, repeats) in cases.items():
        case = trainer.model_copy(deep=True)
        case.model.hidden_sizes = hidden
        chunks = humanoid_chunks(count, seed=1)
        cpu = updates(case, torch.device("cpu"), chunks, repeats)
        gpu = updates(case, torch.device("cuda"), chunks, repeats * 3)
        spec = cpu.pop("spec")
        gpu.pop("spec")
        gaps = {k: abs(cpu["first"][k] - gpu["first"][k]) for k in cpu["first"]}
        result["cases"][name] = {
            "cpu_update_s": round(cpu["update_s"], 4),
            "cuda_update_s": round(gpu["update_s"], 4),
            "speedup": round(cpu["update_s"] / gpu["update_s"], 2),
            "cuda_samples_per_s": round(gpu["samples_per_s"]),
            "first_update_stats_cpu": cpu["first"],
            "first_update_stats_cuda": gpu["first"],
            "max_abs_stat_gap": max(gaps.values()),
        }
        result["cases"][name]["act_16_instances_us"] = {
            "cpu": round(act_latency(spec, torch.device("cpu")) * 1e6, 1),
            "cuda": round(act_latency(spec, torch.device("cuda")) * 1e6, 1),
        }
        print(name, json.dumps(result["cases"][name]), flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))


if __name__ == "__main__":
    main()
