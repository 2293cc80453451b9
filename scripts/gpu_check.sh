#!/usr/bin/env bash
# scripts/gpu_check.sh OUT [--rehearsal] [--section.field=value ...]
#
# The one command a GPU machine runs, from a bare machine with the carried wheels and WikiText-2
# (make gpu-carry), from the repository root, each part under its own time limit so that the
# whole stays under 560 s and what finished is kept when a limit is hit:
#   1. benchmarks/bench_gpu.py: each stage's rate next to this GPU's limits (BENCH_SECONDS, 60;
#      at the table's shapes on a GPU, small ones on a CPU; BENCH_SECONDS=0 skips it, as a
#      rehearsal before the table may);
#   2. the table, scripts/gpu_table.sh with configs/wikitext2/pipeline.yaml (TABLE_SECONDS, 480),
#      or with --rehearsal the slice-size rehearsal (configs/tests/gpu_rehearsal.yaml) instead;
#      further arguments overlay the pipeline config.
# It leaves six files in OUT: bench_gpu.json, results.json, results.md and stage_times.json (the
# table's, as far as it got), pipeline.log (everything the console showed) and records.tar.gz
# (every artifact's manifest, the plots, the per-token test scores, environment.txt).
set -uo pipefail
SECONDS=0
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
    echo "gpu_check.sh: usage: scripts/gpu_check.sh OUT [--rehearsal] [--section.field=value ...]" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
overlay=()
if [ "${1:-}" = "--rehearsal" ]; then
    overlay=(-c configs/tests/gpu_rehearsal.yaml)
    shift
fi
[ -f configs/wikitext2/pipeline.yaml ] || {
    echo "gpu_check.sh: configs/wikitext2/pipeline.yaml not found here: run from the repository root." >&2
    exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/carried.sh"
log=$out/pipeline.log
table=${GNNLM_CHECK_TABLE:-${TMPDIR:-/tmp}/gnnlm-gpu-check}

bench=${BENCH_SECONDS:-60}
if [ "$bench" = 0 ]; then  # (timeout 0 would mean no limit at all)
    echo "gpu_check.sh: bench_gpu.py skipped (BENCH_SECONDS=0)" | tee "$log"
else
    echo "gpu_check.sh: bench_gpu.py, at most $bench s" | tee "$log"
    timeout -s TERM -k 10 "$bench" "$python" "$repo/benchmarks/bench_gpu.py" \
        --json "$out/bench_gpu.json" 2>&1 | tee -a "$log"
    echo "gpu_check.sh: bench_gpu.py ended with status ${PIPESTATUS[0]} after $SECONDS s" \
        | tee -a "$log"
fi

echo "gpu_check.sh: the table${overlay[*]:+ (${overlay[*]})}, at most ${TABLE_SECONDS:-480} s" | tee -a "$log"
GNNLM_TABLE_SECONDS=${TABLE_SECONDS:-480} bash "$repo/scripts/gpu_table.sh" "$table" "${overlay[@]}" "$@" \
    2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "gpu_check.sh: the table ended with status $status after $SECONDS s in all" | tee -a "$log"

for name in results.json results.md stage_times.json; do
    [ -f "$table/$name" ] && cp "$table/$name" "$out/"
done
# the records: manifests of every artifact the run reached, plots, per-token scores
( find runs -name manifest.json 2>/dev/null
  find "$table" -maxdepth 1 \( -name '*.png' -o -name 'test_logprobs.npz' -o -name environment.txt \) ) \
    | tar czf "$out/records.tar.gz" -T - 2>/dev/null
ls -l "$out" | tee -a "$log"
exit "$status"
