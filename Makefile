# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export DAGSTER_DISABLE_TELEMETRY ?= 1

# `make test`: two pytest workers, one test file each at a time. A training test keeps one core
# busy while the other runs a `dagster dev` or `tessera demo` that is mostly importing and waiting.
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: install demo test test-fast ui bench-loader bench-train clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# pip, not uv: torch 2.13.0 (CPU) comes from the local wheel; uv would fetch ~3 GB of CUDA torch.
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera demo

test: $(STAMP)
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS) -m "not integration and not e2e"

ui: $(STAMP)
	@echo "Dagster UI on http://127.0.0.1:3000, MLflow UI on http://127.0.0.1:5000 (Ctrl-C stops both)"
	TESSERA_HOME="$$($(PY) -m pipelines.instance)" || exit 2; mkdir -p "$$TESSERA_HOME/mlartifacts"; \
	DAGSTER_HOME="$$TESSERA_HOME/dagster"; export TESSERA_HOME DAGSTER_HOME; \
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri "sqlite:///$$TESSERA_HOME/mlflow.db" \
	  --default-artifact-root "$$TESSERA_HOME/mlartifacts" & \
	trap 'kill %1' EXIT INT TERM; $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

bench-loader: $(STAMP)
	$(VENV)/bin/tessera bench loader

bench-train: $(STAMP)
	$(VENV)/bin/tessera bench train

clean:  # the default state folder only: a $TESSERA_HOME elsewhere is the user's to remove
	rm -rf .tessera
