#!/usr/bin/env bash
# scripts/gpu_table.sh OUTDIR [-c OVERLAY ...] [--section.field=value ...]
#
# The WikiText-2 table of configs/wikitext2/pipeline.yaml (the paper's settings, one GPU) from a
# bare machine without network, in one command, run from the repository root:
#   1. installs the wheels in $GNNLM_WHEELS (default .whl/) into a folder of their own, without
#      network or dependencies, and reads the project where it is (pure Python, no install);
#   2. reads WikiText-2 from $GNNLM_DATA (default .data/, when it holds wikitext-2/);
#   3. stops at once, naming them, when packages are missing;
#   4. runs every stage of `gnnlm pipeline` (the work directory is the config's: runs/wikitext2),
#      further arguments overlaying pipeline.yaml;
#   5. leaves in OUTDIR: results.json (every row, the device and versions, each stage's build
#      time), results.md, stage_times.json (this run's wall time of every stage), the plots,
#      test_logprobs.npz, environment.txt and pipeline.log (what the console showed).
# A run stopped part-way resumes where it stopped when run again (each stage's artifact is
# complete or is built again; a killed training run restarts from its last checkpoint).
#
# Preparing a machine without network: `make gpu-carry` (here, with network) fills .whl/ with
# the wheels a Python 3.12 CUDA image with torch, PyG, Lightning and transformers lacks (faiss,
# jsonargparse and its helpers) and copies WikiText-2 into .data/; take both folders along.
# The same script on a CPU, with the test overlay (what the tests run):
#   scripts/gpu_table.sh /tmp/table -c configs/wikitext2/pipeline_cpu.yaml \
#       -c configs/tests/pipeline.yaml
set -euo pipefail
SECONDS=0

die() { echo "gpu_table.sh: $*" >&2; exit 2; }
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
    die "usage: scripts/gpu_table.sh OUTDIR [-c OVERLAY ...] [--section.field=value ...]"
fi
out=$1
shift
[ -f configs/wikitext2/pipeline.yaml ] ||
    die "configs/wikitext2/pipeline.yaml not found here: run from the repository root."
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}

# 1. carried wheels in a folder of their own (never the image's site-packages), first on the path
wheels=${GNNLM_WHEELS:-$repo/.whl}
site=${GNNLM_SITE:-${TMPDIR:-/tmp}/gnnlm-site}
shopt -s nullglob
carried=("$wheels"/*.whl)
shopt -u nullglob
if [ ${#carried[@]} -gt 0 ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --upgrade --target "$site" "${carried[@]}"
    echo "gpu_table.sh: installed ${#carried[@]} wheels from $wheels into $site"
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"

# 2. the corpus, from disk: a machine without network cannot download it
if [ -z "${GNNLM_DATA:-}" ] && [ -d "$repo/.data/wikitext-2" ]; then
    export GNNLM_DATA=$repo/.data
fi
[ -n "${GNNLM_DATA:-}" ] && [ -f "$GNNLM_DATA/wikitext-2/train.txt" ] ||
    die "WikiText-2 not found: set GNNLM_DATA to the folder holding wikitext-2/train.txt (or copy it into $repo/.data/, as make gpu-carry does)."

# 3. what this machine has: every package a stage imports, checked before the first stage
mkdir -p "$out"
"$python" -m gnnlm.utils.environment \
    --require torch,torch_geometric,pytorch_lightning,faiss,jsonargparse,docstring_parser,typeshed_client,transformers,tokenizers,matplotlib,yaml \
    | tee "$out/environment.txt"

# 4. every stage, offline; the console's lines are kept in the log
export PYTHONUNBUFFERED=1 WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}  # faster large CPU allocations
"$python" -m gnnlm.cli pipeline -c configs/wikitext2/pipeline.yaml "$@" \
    --copy_report_to "$out" 2>&1 | tee "$out/pipeline.log"

echo "gpu_table.sh: the table and its records are in $out ($SECONDS s in all)"
