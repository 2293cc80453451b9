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
TYPED := gnnlm/workdir/artifacts.py gnnlm/workdir/layout.py gnnlm/utils/progress.py gnnlm/utils/devices.py \
	gnnlm/utils/metrics.py gnnlm/workdir/checkpoints.py gnnlm/text/corpus.py gnnlm/text/tokens.py gnnlm/models/encode.py \
	gnnlm/retrieval/features.py gnnlm/retrieval/search.py gnnlm/retrieval/index.py gnnlm/retrieval/neighbors.py gnnlm/retrieval/knn.py \
	gnnlm/retrieval/knn_cache.py gnnlm/gnn/pq.py gnnlm/gnn/graph.py gnnlm/gnn/layer.py gnnlm/gnn/dense.py \
	gnnlm/gnn/window_states.py gnnlm/heads.py gnnlm/pipeline/config.py gnnlm/retrieval/tuning.py gnnlm/workdir/ranks.py \
	gnnlm/workdir/shards.py gnnlm/models/base.py gnnlm/models/hf.py gnnlm/models/protocols.py \
	gnnlm/retrieval/multi_gpu.py gnnlm/pipeline/data_checks.py gnnlm/workdir/lock.py gnnlm/workdir/verify.py

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
