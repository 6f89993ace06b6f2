# One command each: `make run` sets up and runs the default main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= tiny_diloco

.PHONY: setup run run-multi test test-fast test-bench test-all lint bench docs docs-build figures clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0

# Reinstalled whenever pyproject.toml or the tested releases change (new dependencies, the hf-diloco command).
$(VENV)/.installed: pyproject.toml constraints.txt $(BIN)/activate
	$(BIN)/pip install -e ".[dev,plots,trl,elastic,peft,store,docs]" -c constraints.txt
	touch $@

setup: $(VENV)/.installed

# Folders of their own under outputs/make_run/, named as `hf-diloco pretrain` names its default ones: either target
# can be re-run after the other, and the README's `hf-diloco pretrain` / `torchrun` commands after them train anew
# (in outputs/CONFIG and outputs/CONFIG_2proc) instead of finding these runs finished.
run: setup
	$(BIN)/accelerate launch --cpu --num_processes 1 scripts/pretrain.py --config $(CONFIG) \
		--output_dir outputs/make_run/$(notdir $(basename $(CONFIG)))

run-multi: setup
	$(BIN)/torchrun --nproc_per_node 2 scripts/pretrain.py --config $(CONFIG) --use_cpu \
		--output_dir outputs/make_run/$(notdir $(basename $(CONFIG)))_2proc

test: setup
	$(BIN)/python -m pytest tests -m "not bench and not long"

# The inner loop of a change: everything but the end-to-end (`slow`) and elastic tiers (tests/conftest.py).
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not elastic and not bench and not long"

# The benchmark scripts' quick runs (tests/conftest.py's `bench` tier): run them before stored results change.
test-bench: setup
	$(BIN)/python -m pytest tests -m bench

# Every tier: make test, the bench tier and the long end-to-end scenarios (tests/conftest.py), before a release.
test-all: setup
	$(BIN)/python -m pytest tests

lint: setup
	$(BIN)/ruff check hf_diloco scripts benchmarks tests docs/hooks.py
	$(BIN)/ruff format --check hf_diloco scripts benchmarks tests docs/hooks.py

# A quick smoke run of the benchmark harness (a few minutes on 2 cores; results under outputs/bench/, not the stored
# ones). BENCHMARKS.md has the command of every stored result; `python -m benchmarks.wan --quick` needs root.
BENCH_MODEL = '{"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64}'
bench: setup
	$(BIN)/python -m benchmarks.comm --steps 16 --warmup 2 --train_files 20 --vocab_size 256 --model $(BENCH_MODEL) \
		--methods ddp streaming_fp4:inner_steps=8 --out outputs/bench/comm
	$(BIN)/python -m benchmarks.fragment_sizes --num_fragments 4 --patterns strided balanced
	$(BIN)/python -m benchmarks.entropy_coding --numel 4000000 --repeats 1
	$(BIN)/python -m benchmarks.overhead --steps 14 --inner_steps 4 --repeats 1 --out outputs/bench/overhead.json

# The documentation site (mkdocs.yml): `docs` builds it and serves it at http://127.0.0.1:8000, rebuilding on every
# change; `docs-build` builds it into site/ with warnings as errors, as CI does (tests/test_docs_site.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The named figures the README and the site quote (docs/figures.json) and the site's figures (docs/img/), from the
# stored results: rerun after new results land in benchmarks/results/.
figures: setup
	$(BIN)/python -m benchmarks.figures
	$(BIN)/python scripts/docs_figures.py

clean:
	rm -rf $(VENV) outputs site
