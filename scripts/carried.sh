# Sourced by scripts/gpu_table.sh and scripts/gpu_check.sh, from the repository root: a bare
# machine without network made ready to run the project in place.
#   1. the wheels in $GNNLM_WHEELS (default .whl/) installed into a folder of their own
#      ($GNNLM_SITE), without network or dependencies, first on PYTHONPATH with the project;
#   2. WikiText-2 read from $GNNLM_DATA, else from .data/ when it holds wikitext-2/.
# Sets: repo, python. Stops (die, exit 2) when WikiText-2 is missing.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
die() { echo "$(basename "$0"): $*" >&2; exit 2; }

wheels=${GNNLM_WHEELS:-$repo/.whl}
site=${GNNLM_SITE:-${TMPDIR:-/tmp}/gnnlm-site}
if [ -z "${GNNLM_CARRIED:-}" ]; then  # once per command (gpu_check.sh runs gpu_table.sh)
    shopt -s nullglob
    carried=("$wheels"/*.whl)
    shopt -u nullglob
    if [ ${#carried[@]} -gt 0 ]; then
        "$python" -m pip install -q --no-index --no-deps --no-compile \
            --disable-pip-version-check --upgrade --target "$site" "${carried[@]}"
        echo "$(basename "$0"): installed ${#carried[@]} wheels from $wheels into $site"
    fi
    export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" GNNLM_CARRIED=1
fi

if [ -z "${GNNLM_DATA:-}" ] && [ -d "$repo/.data/wikitext-2" ]; then
    export GNNLM_DATA=$repo/.data
fi
[ -n "${GNNLM_DATA:-}" ] && [ -f "$GNNLM_DATA/wikitext-2/train.txt" ] ||
    die "WikiText-2 not found: set GNNLM_DATA to the folder holding wikitext-2/train.txt (or copy it into $repo/.data/, as make gpu-carry does)."
export PYTHONUNBUFFERED=1 WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}  # faster large CPU allocations
