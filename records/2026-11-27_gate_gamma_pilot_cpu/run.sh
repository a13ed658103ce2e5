#!/usr/bin/env bash
# The pilot's runs into OUT (default logs/gamma_pilot), one thread each (2 cores): bytes_core's
# gated_mu0.5 (sweep.py's BYTES_BASE, 1,200 steps of 8 x 256 bytes), a validation of 524,288
# bytes at the end. Seed 0 at three values of the controller's gamma, side by side (~6 min);
# then 3e-2 at seeds 1 to 4 and 1e-1 at seeds 0 to 4, two at a time (~22 min).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-logs/gamma_pilot}
base=$(python -c "import sweep; print(' '.join(a for a in sweep.BYTES_BASE if not a.startswith('--val_tokens')))")
pilot() {  # pilot GAMMA SEED FOLDER
    # shellcheck disable=SC2086  # base: one argument per setting
    OMP_NUM_THREADS=1 python train_gpt.py $base --train_tokens=2457600 --val_tokens=524288 \
        --router=skip_middle --n_layers=6 --mu_end=0.5 --gamma="$1" --seed="$2" --run_dir="$out/$3"
}
together() {  # together GAMMA:SEED...: those runs at once; fails if one of them failed
    local pids=() run pid
    for run in "$@"; do
        pilot "${run%:*}" "${run#*:}" "g${run%:*}_s${run#*:}" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
}
together 3e-3:0 1e-2:0 3e-2:0
together 3e-2:1 3e-2:2
together 3e-2:3 3e-2:4
together 1e-1:0 1e-1:1
together 1e-1:2 1e-1:3
together 1e-1:4
