# The start of the GPU benchmark scripts (sourced): the run's settings and files, and the
# step runner (each step under its own time limit, so a slow one cannot eat the whole run;
# a failed step is recorded and the next one runs).
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
DRY=${GPU_BENCH_DRY:-0}
DATE=$(date -u +%Y-%m-%d)
LOG="$OUT/log.txt"
mkdir -p "$OUT"
: >"$LOG"
: >"$OUT/steps.txt"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# step NAME LIMIT_S COMMAND...: run with a time limit, output to the terminal and the log,
# "NAME EXIT_CODE SECONDS" into $OUT/steps.txt; only the steps named in $STEPS run.
step() {
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) echo "=== $name: not selected" | tee -a "$LOG"; return ;; esac
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "$name $rc $((SECONDS - start))" >>"$OUT/steps.txt"
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
}
