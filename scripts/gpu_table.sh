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
# GNNLM_TABLE_SECONDS=N stops the run N seconds after this script started (SIGTERM, then
# SIGKILL 30 s later): what finished is kept, and stage_times.json says where it stopped
# (scripts/gpu_check.sh sets it).
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

if [ $# -lt 1 ] || [[ $1 == -* ]]; then
    echo "gpu_table.sh: usage: scripts/gpu_table.sh OUTDIR [-c OVERLAY ...] [--section.field=value ...]" >&2
    exit 2
fi
out=$1
shift
[ -f configs/wikitext2/pipeline.yaml ] || {
    echo "gpu_table.sh: configs/wikitext2/pipeline.yaml not found here: run from the repository root." >&2
    exit 2; }
# 1-2. carried wheels in a folder of their own, first on the path; the corpus from disk
source "$(dirname "${BASH_SOURCE[0]}")/carried.sh"

# an earlier run's copies in OUTDIR (the rehearsal before the table) must not pass for this
# run's when it stops before its report: the work directory, not OUTDIR, is what resumes
rm -f "$out"/results.json "$out"/results.md "$out"/stage_times.json "$out"/test_logprobs.npz \
    "$out"/*.png

# 3. what this machine has: every package a stage imports, checked before the first stage
mkdir -p "$out"
"$python" -m gnnlm.utils.environment \
    --require torch,torch_geometric,pytorch_lightning,faiss,jsonargparse,docstring_parser,typeshed_client,transformers,tokenizers,matplotlib,yaml \
    | tee "$out/environment.txt"

# 4. every stage, offline; the console's lines are kept in the log. With GNNLM_TABLE_SECONDS
# the run is told to stop (SIGTERM) after that many seconds: it stops at once, keeps every
# finished artifact and chunk, and still leaves stage_times.json (what it reached) in OUTDIR.
# The limit counts from this script's start (the install and the check above included). The
# signal goes to the run alone (--foreground), once: it finishes its training step, saves the
# checkpoint to resume from, and shuts its DataLoader workers down itself.
limit=()
[ -n "${GNNLM_TABLE_SECONDS:-}" ] &&  # (timeout 0 would mean no limit at all)
    limit=(timeout --foreground -s TERM -k 30
           "$(( GNNLM_TABLE_SECONDS > SECONDS ? GNNLM_TABLE_SECONDS - SECONDS : 1 ))")
"${limit[@]}" "$python" -m gnnlm.cli pipeline -c configs/wikitext2/pipeline.yaml "$@" \
    --copy_report_to "$out" 2>&1 | tee "$out/pipeline.log"

echo "gpu_table.sh: the table and its records are in $out ($SECONDS s in all)"
