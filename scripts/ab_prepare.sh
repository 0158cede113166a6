#!/usr/bin/env bash
# Extract the package as it was at each revision into .ab/<rev> (ignored by git), for
# gpu_bench.sh to run the same workloads on several revisions side by side in one run:
#
#   scripts/ab_prepare.sh 9618f24 08430e5
#   # on the GPU machine, carrying .ab:
#   GPU_BENCH_STEPS=ab GPU_BENCH_AB_REVS="9618f24 08430e5" PYTHONPATH=. bash scripts/gpu_bench.sh
#
# By hand, run a revision from its own directory: (cd .ab/<rev> && PYTHONPATH=. python -m
# pagedllm.benchmarks.latency ...). From the working tree, `python -m` imports the tree's
# package first, whatever PYTHONPATH says, and both sides of the A/B run the same code.
#
# Only pagedllm/ is extracted, its bundled demo files linked to the working tree's (the
# benchmark shapes use built-in configs and dummy weights), so each revision adds well
# under 1 MB to carry.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/ab_prepare.sh REV [REV ...]" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
for rev in "$@"; do
    git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "not a revision: $rev" >&2; exit 2; }
    dir=".ab/$rev"
    rm -rf "$dir"
    mkdir -p "$dir"
    git archive "$rev" -- pagedllm ':(exclude)pagedllm/model_files' | tar -x -C "$dir"
    ln -s ../../../pagedllm/model_files "$dir/pagedllm/model_files"  # today's demo files
    git rev-parse --short "$rev" >"$dir/REVISION"  # the commit its records name
    echo "$dir: pagedllm at $(git rev-parse --short "$rev")"
done
