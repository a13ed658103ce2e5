#!/usr/bin/env bash
# The three pilot runs, side by side (one thread each, 2 cores), into OUT (default logs/gamma_pilot).
# bytes_core's gated_mu0.5 (sweep.py's BYTES_BASE, 1,200 steps of 8 x 256 bytes), seed 0, a
# validation of 524,288 bytes at the end, at three values of the controller's gamma.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-logs/gamma_pilot}
base=$(python -c "import sweep; print(' '.join(a for a in sweep.BYTES_BASE if not a.startswith('--val_tokens')))")
for g in 3e-3 1e-2 3e-2; do
    # shellcheck disable=SC2086  # base: one argument per setting
    OMP_NUM_THREADS=1 python train_gpt.py $base --train_tokens=2457600 --val_tokens=524288 \
        --router=skip_middle --n_layers=6 --mu_end=0.5 --gamma=$g --seed=0 --run_dir="$out/g$g" &
done
wait
