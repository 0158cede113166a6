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

# The GPU machine sends back at most 8 files from $OUT. When the run ends (or is stopped
# by a signal), every file under $OUT but log.txt is packed into $OUT/results.tgz
# (tar xzf results.tgz to read them). GPU_BENCH_PACK=0 keeps them loose, as dry runs do
# unless GPU_BENCH_PACK=1.
PACK=${GPU_BENCH_PACK:-$([ "$DRY" = "1" ] && echo 0 || echo 1)}
pack_results() {
    [ "$PACK" = "1" ] || return 0
    local files
    mapfile -t files < <(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name log.txt \
        ! -name results.tgz -printf '%P\n')
    [ ${#files[@]} -gt 0 ] || return 0
    (cd "$OUT" && tar czf results.tgz -- "${files[@]}" && rm -rf -- "${files[@]}")
}
trap pack_results EXIT
trap 'exit 143' TERM INT

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
