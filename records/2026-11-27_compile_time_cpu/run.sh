#!/usr/bin/env bash
# The record's grid: before (94d6ca8, the whole model compiled) and after (the blocks), masked
# and compacted, each cold (a new Inductor cache) then warm (the same cache, a new process).
#     bash run.sh BEFORE_CHECKOUT AFTER_CHECKOUT > runs.jsonl
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for version in before after; do
    checkout=$([ $version = before ] && echo "$1" || echo "$2")
    for compact in 0 1; do
        cache=$(mktemp -d)
        for start in cold warm; do
            run=$(TORCHINDUCTOR_CACHE_DIR=$cache OMP_NUM_THREADS=2 \
                python "$here/compile_time.py" "$checkout" --compact=$compact)
            echo "{\"version\": \"$version\", \"start\": \"$start\", \"run\": $run}"
        done
        rm -rf "$cache"  # made by mktemp above: only this run's cache
    done
done
