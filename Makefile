# make test       — set up .venv (torch first, pinned) and run the whole test suite (what CI runs)
# make test-unit  — the fast edit loop (about 2 min): every test but the WikiText-2 pipeline
#                   integration and the builds on several processes
# make lint       — ruff (style, import order, docstrings) and mypy (pyproject.toml says which
#                   modules: all but the Lightning glue)
# make demo       — set up .venv and run the WikiText-2 pipeline on the CPU config, printing the table
# make gpu-carry  — what scripts/gpu_table.sh needs on a GPU machine without network: .whl/ (the
#                   wheels a Python 3.12 image with torch, PyG, Lightning, transformers lacks) and
#                   .data/wikitext-2 (a copy of the corpus); both are git-ignored
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
.PHONY: setup test test-unit lint demo gpu-carry clean

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
	$(BIN)/python -m pytest -q -m "not integration and not multiprocess" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

demo: setup
	$(BIN)/gnnlm pipeline -c configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml

# faiss-cpu (faiss-gpu's wheel is 135 MB: the exact torch search runs on the GPU instead),
# jsonargparse and the two packages its signatures extra reads, at the versions tested here
CARRY_PYTHON ?= 3.12
CARRY_WHEELS ?= faiss-cpu==1.15.1 jsonargparse==4.53.0 docstring-parser==0.18.0 \
                typeshed-client==2.14.0
gpu-carry: setup
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl \
	    --python-version $(CARRY_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 $(CARRY_WHEELS)
	mkdir -p .data && cp -r "$(GNNLM_DATA)/wikitext-2" .data/ && chmod -R u+w .data
	du -sh .whl .data

clean:
	rm -rf $(VENV) runs lightning_logs
