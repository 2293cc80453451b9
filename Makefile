# make test       — set up .venv (torch first, pinned) and run the whole test suite (what CI runs)
# make test-unit  — the fast edit loop: every test but the WikiText-2 pipeline integration
# make lint       — ruff (style, import order, docstrings) and mypy on the library's pure modules
# make demo       — set up .venv and run the WikiText-2 pipeline on the CPU config, printing the table
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
GNNLM_DATA ?= $(abspath ../shared/data)
export GNNLM_DATA
export WANDB_MODE ?= offline
# Each step frees and re-allocates [tokens, vocab] logits buffers: with transparent huge pages
# glibc's large allocations fault in far fewer pages (training steps about 1.5x faster on CPU)
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
BIN := $(VENV)/bin
# the modules of pure maths and artifacts, type-checked by mypy (the Lightning glue is not)
TYPED := gnnlm/artifacts.py gnnlm/workdir.py gnnlm/progress.py gnnlm/devices.py \
	gnnlm/metrics.py gnnlm/checkpoints.py gnnlm/corpus.py gnnlm/tokens.py gnnlm/encode.py \
	gnnlm/datastore.py gnnlm/search.py gnnlm/index.py gnnlm/neighbors.py gnnlm/knn.py \
	gnnlm/knn_cache.py gnnlm/pq.py gnnlm/graph.py gnnlm/gnn_layer.py gnnlm/gnn_dense.py \
	gnnlm/window_states.py gnnlm/heads.py gnnlm/config.py gnnlm/tuning.py gnnlm/ranks.py \
	gnnlm/shards.py gnnlm/models/base.py gnnlm/models/hf.py gnnlm/protocols.py \
	gnnlm/multi_gpu.py gnnlm/data_checks.py gnnlm/lock.py gnnlm/verify.py

.PHONY: setup test test-unit lint demo clean

$(BIN)/gnnlm: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(BIN)/gnnlm

setup: $(BIN)/gnnlm

test: setup
	$(BIN)/python -m pytest -q tests

test-unit: setup
	$(BIN)/python -m pytest -q -m "not integration" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy $(TYPED)

demo: setup
	$(BIN)/gnnlm pipeline -c configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml

clean:
	rm -rf $(VENV) runs lightning_logs
