#!/usr/bin/env bash
# Every GPU check in one command, on a fresh CUDA machine that has torch, numpy, tiktoken,
# huggingface_hub and pytest (no network needed: it runs on the embedded sample, cycled). About 10
# minutes on one H100. Writes everything to one record folder:
#
#     bash gpu_check.sh [OUT]        # default: records/<date>_gpu_check_<gpu name>
#
#   cuda_tests.txt          the CUDA tests of test_train.py (Flex score_mod vs SDPA with gate
#                           gradients, compiled vs eager, bf16 vs fp32, compact under compile)
#   paper_none/, paper_skip_middle/
#                           the paper configuration (12 layers, dim 768, seq 1024, compiled,
#                           bf16), 40 steps of one 32 x 1024 device batch each: train.log has
#                           tok/s and mfu per step and the peak memory
#   bench/                  bench.py at paper size: masked vs compacted blocks at forced sparsity
#   summary.txt             the figures above in a few lines
set -uo pipefail
cd "$(dirname "$0")"
if ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no CUDA device visible to torch" >&2
    exit 2
fi
gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
out=${1:-records/$(date +%F)_gpu_check_$gpu}
if ! mkdir -p "$out" || [ -n "$(ls -A "$out")" ]; then
    echo "error: $out cannot be created or is not empty" >&2
    exit 2
fi
export OMP_NUM_THREADS=8
nvidia-smi > "$out/nvidia-smi.txt" 2>&1

python -m pytest -q test_train.py -k cuda -rs > "$out/cuda_tests.txt" 2>&1
echo "cuda tests: $(tail -1 "$out/cuda_tests.txt")" | tee "$out/summary.txt"

sample=(--train_files='data/sample/sample_train_*.bin' --val_files='data/sample/sample_train_*.bin')
for router in none skip_middle; do
    # the global batch is one device batch (the sample holds ~4 of them); validation reads the
    # training shard because the validation one holds less than a batch: timing only
    python train_gpt.py --router=$router "${sample[@]}" --batch_size=32 --device_batch_size=32 \
        --train_tokens=$((40 * 32 * 1024)) --val_every=0 --val_tokens=32768 --save_every=0 \
        --untimed_steps=10 --run_dir="$out/paper_$router" > "$out/paper_$router.txt" 2>&1
    echo "paper router=$router: exit $? $(grep -h '^step:40/40 train' "$out/paper_$router/train.log" \
        | grep -o 'step_avg.*') $(grep -h 'peak memory' "$out/paper_$router/train.log")" \
        | tee -a "$out/summary.txt"
done

python bench.py --size=paper --device=cuda --compile=1 --out="$out/bench" > "$out/bench.txt" 2>&1
echo "bench.py --size=paper: exit $?; table in $out/bench/" | tee -a "$out/summary.txt"
