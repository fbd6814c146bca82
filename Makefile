# Two commands: `make run` (set up + the main job on ShapesWorld) and `make test` (set up + tests).
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup run test lint smoke cuda-smoke cuda-smoke-multi clean
setup: $(VENV)/.installed

# torch first, from the CPU build on this machine's disk: a plain `torch` requirement would
# resolve a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# One Prefect server for the whole repro: without it every stage starts a temporary one.
run: setup
	PATH=$(abspath $(BIN)):$$PATH creditflow with-server dvc repro

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest -n 2 --dist loadfile --durations=10

# One tiny SD3 GRPO round on a CUDA GPU (bf16); prints a skip message and succeeds without CUDA.
cuda-smoke: setup
	$(BIN)/python scripts/cuda_smoke.py

cuda-smoke-multi: setup  # needs 2 GPUs; skips otherwise
	$(BIN)/python scripts/cuda_smoke.py --processes 2

clean:
	rm -rf .prefect mlflow.db mlruns
