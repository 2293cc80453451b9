#!/usr/bin/env bash
# scripts/gpu_check.sh OUT [--rehearsal] [--section.field=value ...]
#
# The one command a GPU machine runs, from a bare machine with the carried wheels and WikiText-2
# (make gpu-carry), from the repository root, each part under its own time limit and the whole
# under CHECK_SECONDS (590, the copies at the end left out), what finished kept when a limit is
# hit:
#   1. benchmarks/bench_gpu.py: each stage's rate next to this GPU's limits (BENCH_SECONDS, 60;
#      at the table's shapes on a GPU, small ones on a CPU; BENCH_SECONDS=0 skips it, as a
#      rehearsal before the table may);
#   2. the table, scripts/gpu_table.sh with configs/wikitext2/pipeline.yaml (TABLE_SECONDS, 480,
#      or what the whole's limit leaves after the benchmark and a stopped table's exit), or with
#      --rehearsal the slice-size rehearsal (configs/tests/gpu_rehearsal.yaml) instead; further
#      arguments overlay the pipeline config;
#   3. with --rehearsal, its work directory served as gnnlm.load serves it (on the CPU), against
#      its report: gnnlm reproduce (REPRODUCE_SECONDS, 120, or what the whole's limit leaves).
# It leaves seven files in OUT: bench_gpu.json, results.json, results.md and stage_times.json
# (the table's, as far as it got), pipeline.log (everything the console showed),
# test_logprobs.npz (the per-token test scores, when under 15 MiB) and
# records.tar.gz (every artifact's manifest, the plots, environment.txt); with --rehearsal an
# eighth, reproduce.json. It exits 3 when the table stopped at its limit, with what it reached.
set -uo pipefail
SECONDS=0
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
    echo "gpu_check.sh: usage: scripts/gpu_check.sh OUT [--rehearsal] [--section.field=value ...]" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
overlay=()
served=""  # the work directory served after the table (the rehearsal's)
if [ "${1:-}" = "--rehearsal" ]; then
    overlay=(-c configs/tests/gpu_rehearsal.yaml)
    served=runs/tests/gpu-rehearsal  # configs/tests/gpu_rehearsal.yaml's workdir
    shift
fi
[ -f configs/wikitext2/pipeline.yaml ] || {
    echo "gpu_check.sh: configs/wikitext2/pipeline.yaml not found here: run from the repository root." >&2
    exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/carried.sh"
log=$out/pipeline.log
table=${GNNLM_CHECK_TABLE:-${TMPDIR:-/tmp}/gnnlm-gpu-check}

# a part's limit: its own ($1), or what the whole's limit leaves once a part stopped at it has
# had its grace ($2 s after SIGTERM) to exit, whichever is less
part_seconds() {
    local left=$(( ${CHECK_SECONDS:-590} - SECONDS - $2 ))
    echo $(( left < $1 ? left : $1 ))
}

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

# the table (gpu_table.sh gives a stopped run 30 s to exit)
table_seconds=$(part_seconds "${TABLE_SECONDS:-480}" 30)
echo "gpu_check.sh: the table${overlay[*]:+ (${overlay[*]})}, at most $table_seconds s" | tee -a "$log"
GNNLM_TABLE_SECONDS=$table_seconds bash "$repo/scripts/gpu_table.sh" "$table" "${overlay[@]}" "$@" \
    2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "gpu_check.sh: the table stopped at its limit of $table_seconds s" | tee -a "$log"
    status=3  # its own limit, told from a stop from outside (timeout's 124)
fi
echo "gpu_check.sh: the table ended with status $status after $SECONDS s in all" | tee -a "$log"

for name in results.json results.md stage_times.json; do
    [ -f "$table/$name" ] && cp "$table/$name" "$out/"
done
scores=$table/test_logprobs.npz
if [ -f "$scores" ] && [ "$(stat -c %s "$scores")" -le $((15 << 20)) ]; then
    cp "$scores" "$out/"
elif [ -f "$scores" ]; then
    echo "gpu_check.sh: test_logprobs.npz left out: over 15 MiB" | tee -a "$log"
fi
# the rehearsal's work directory served through gnnlm.load, against its report
if [ -n "$served" ] && [ "$status" = 0 ]; then
    limit=$(part_seconds "${REPRODUCE_SECONDS:-120}" 10)
    if [ "$limit" -gt 0 ]; then
        echo "gpu_check.sh: $served served through gnnlm.load, at most $limit s" | tee -a "$log"
        timeout --foreground -s TERM -k 10 "$limit" "$python" -m gnnlm.cli reproduce "$served" \
            --decode transformer transformer_xl gnn+knn --json "$out/reproduce.json" 2>&1 \
            | tee -a "$log"
        echo "gpu_check.sh: reproduce ended with status ${PIPESTATUS[0]} after $SECONDS s" \
            | tee -a "$log"
    fi
fi

# the records: manifests of every artifact the run reached, plots, the environment
( find runs -name manifest.json 2>/dev/null
  find "$table" -maxdepth 1 \( -name '*.png' -o -name environment.txt \) ) \
    | tar czf "$out/records.tar.gz" -T - 2>/dev/null
ls -l "$out" | tee -a "$log"
exit "$status"
