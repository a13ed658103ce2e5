#!/usr/bin/env bash
# The pilot's runs into OUT (default logs/gamma_pilot), one thread each (2 cores): bytes_core's
# gated model (sweep.py's BYTES_BASE, 6 layers, 1,200 steps of 8 x 256 bytes), a validation of
# 524,288 bytes at the end. At mu_end 0.5: seed 0 at three values of the controller's gamma,
# side by side (~6 min), then 3e-2 at seeds 1 to 4 and 1e-1 at seeds 0 to 4; at mu_end 0.25:
# 1e-1 at seeds 0 to 4; two at a time (~34 min).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-logs/gamma_pilot}
base=$(python -c "import sweep; print(' '.join(a for a in sweep.BYTES_BASE if not a.startswith('--val_tokens')))")
together() {  # together MU_END:GAMMA:SEED...: those runs at once; fails if one of them failed
    local pids=() run mu gamma seed pid
    for run in "$@"; do
        IFS=: read -r mu gamma seed <<< "$run"
        # shellcheck disable=SC2086  # base: one argument per setting
        OMP_NUM_THREADS=1 python train_gpt.py $base --train_tokens=2457600 --val_tokens=524288 \
            --router=skip_middle --n_layers=6 --mu_end="$mu" --gamma="$gamma" --seed="$seed" \
            --run_dir="$out/m${mu}_g${gamma}_s$seed" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
}
together 0.5:3e-3:0 0.5:1e-2:0 0.5:3e-2:0
together 0.5:3e-2:1 0.5:3e-2:2
together 0.5:3e-2:3 0.5:3e-2:4
together 0.5:1e-1:0 0.5:1e-1:1
together 0.5:1e-1:2 0.5:1e-1:3
together 0.5:1e-1:4 0.25:1e-1:0
together 0.25:1e-1:1 0.25:1e-1:2
together 0.25:1e-1:3 0.25:1e-1:4
