# One command each: `make run` sets up and runs the default main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny_diloco.yaml

.PHONY: setup run run-multi test lint bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev,plots]"

setup: $(BIN)/activate

run: setup
	$(BIN)/accelerate launch --cpu --num_processes 1 scripts/pretrain.py --config $(CONFIG)

run-multi: setup
	$(BIN)/torchrun --nproc_per_node 2 scripts/pretrain.py --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest tests

lint: setup
	$(BIN)/ruff check hf_diloco scripts tests
	$(BIN)/ruff format --check hf_diloco scripts tests

clean:
	rm -rf $(VENV) outputs
