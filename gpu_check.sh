#!/usr/bin/env bash
# Every GPU check, in stages, resumable: run the same command again until it says "all done".
# Each call runs the stages not done yet that fit in its time budget (default 450 s, so a call
# stays under 8 minutes), then stops; a stage whose output exists is skipped. Needs a CUDA
# machine with torch, numpy, tiktoken, huggingface_hub and pytest, and a C compiler and the
# Python headers (torch.compile builds kernels at run time); no network: the embedded sample, and
# the byte corpus carried for the grid.
#
#     bash gpu_check.sh [OUT]     # default OUT: records/<date>_gpu_check_<gpu name>
#
# Stages (seconds on one H100, measured 2026-11-25; summary.txt grows as they finish):
#   env      nvidia-smi, versions, and torch.compile of a tiny function (the compiler works)   40
#   paper_none, paper_skip_middle
#            first, as a compiled run that does not learn makes the rest moot: the paper
#            configuration (12 layers, dim 768, 32 x 1024 tokens, compiled, bf16), 40 steps,
#            failing unless the last validation loss is under 0.9 x the first training loss;
#            run folders outside the record (a 2.3 GB checkpoint), logs copied in          60 each
#   tests    the CUDA tests of test_train.py (compiled = eager at dim 256, Flex with ln g) 170
#   ddp      torchrun --nproc_per_node=1 (launcher, NCCL, compile; no DDP: one rank)       55
#   bench    bench.py --size=paper --compile=1: masked against compacted blocks, against
#            issue 48's targets (summary.txt: each target met or not, and the masked MFU)  145
#            (timed before issue 48's one-graph compact path)
#   grid     sweep.py --grid=bytes_core --seeds=GPU_CHECK_SEEDS (default 5) on the byte corpus,
#            which travels (28 MB: build data/debian_docs here, python data/debian_docs.py,
#            and carry it), its runs in GPU_CHECK_RUNS (default logs/gpu_check_grid_<gpu>); in
#            pieces: each call trains until its budget is spent, then SIGTERM makes the run
#            in flight save and the next call goes on (on an H200, 2026-11-26 record: about 43 s
#            a run, most of it start-up and validation, then 2 MB read twice; now 5 MB read once,
#            not yet timed there: at 43 s, about 30 min for 5 seeds)
# GPU_CHECK_DRY_RUN=1: all of it on CPU at a tiny size and on the embedded sample's grid
# (test_train.py runs it so).
set -uo pipefail
cd "$(dirname "$0")"
if ! python -c "import torch" 2>/dev/null; then
    echo "error: \`python\` cannot import torch: put the Python that holds it first on PATH" >&2
    exit 2
fi
tiny=()  # a dry run's sizes, after the checks' own (the last of a field wins)
bench=(--size=paper --device=cuda --compile=1)
grid=(--grid=bytes_core --seeds="${GPU_CHECK_SEEDS:-5}")
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    gpu=cpu_dry_run bench=(--size=smoke --device=cpu --repeats=1) grid=(--grid=cpu --seeds=1)
    export CUDA_VISIBLE_DEVICES=  # on CPU even where there is a GPU
    tiny=(--n_layers=2 --dim=32 --n_heads=2 --n_kv_heads=2 --max_seq_len=64 --seq_len=64
          --batch_size=8 --device_batch_size=8 --train_tokens=$((30 * 8 * 64)) --val_tokens=512
          --untimed_steps=1 --lr=3e-3)
elif ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no CUDA device visible to torch (GPU_CHECK_DRY_RUN=1: a dry run on CPU)" >&2
    exit 2
else
    gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
fi
out=${1:-records/$(date +%F)_gpu_check_$gpu}
budget=${GPU_CHECK_SECONDS:-450}
if ! mkdir -p "$out"; then
    echo "error: cannot create $out" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
ran=0

stage() {  # stage NAME ESTIMATE_S COMMAND...: run it unless done, if it fits in what is left
    local name=$1 estimate=$2 t0=$SECONDS
    shift 2
    [ -e "$out/$name.done" ] && return 0
    if (( ran && SECONDS + estimate > budget )); then  # (the first stage of a call always runs)
        echo "next: $name (~${estimate} s); run 'bash gpu_check.sh $out' again"
        exit 0
    fi
    echo "== $name (~${estimate} s estimated)"
    "$@" > "$out/$name.txt" 2>&1
    local status=$?
    echo "$name: exit $status, $((SECONDS - t0)) s$(summary_of "$name")" | tee -a "$out/summary.txt"
    touch "$out/$name.done"
    ran=1
}

summary_of() {  # one stage's figures for summary.txt
    local log=$out/$1/train.log
    case $1 in
        tests) echo "; $(tail -1 "$out/tests.txt")" ;;
        bench) echo "; $(grep -h ': met$\|: not met$\|MFU' "$out/bench.txt" | paste -sd ';' -)" ;;
        paper_*) echo "; $(grep -h '^step:.* train_loss' "$log" | tail -1 | grep -o 'step_avg.*')" \
                      "$(grep -h '^peak memory' "$log");" \
                      "$(grep -h '^step:1/.* train_loss' "$log" | grep -o 'train_loss:[0-9.]*')" \
                      "-> $(grep -h '^step:.* val_loss' "$log" | tail -1 | grep -o 'val_loss:[0-9.]*')" ;;
        *) ;;
    esac
}

env_check() {
    if [ -z "${tiny[*]}" ]; then nvidia-smi; fi
    python -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python -c "
import torch
f = torch.compile(lambda x: torch.sin(x) * 2)
x = torch.randn(1024, device='cuda' if torch.cuda.is_available() else 'cpu')
assert torch.allclose(f(x), torch.sin(x) * 2)
print('torch.compile: ok')"
}

sample=(--train_files='data/sample/sample_train_*.bin' --val_files='data/sample/sample_train_*.bin')

ddp_run() {  # a small gated, compacted model under torchrun: launcher, NCCL, compile. With one
            # rank train() wraps no DDP; DDP's graph split is tested on CPU (gloo, test_train.py)
    local run
    run=$(mktemp -d) || return 1
    torchrun --standalone --nproc_per_node=1 train_gpt.py --router=skip_middle --compact=true \
        "${sample[@]}" --n_layers=4 --dim=256 --n_heads=4 --n_kv_heads=4 --max_seq_len=256 --seq_len=256 --batch_size=16 \
        --device_batch_size=8 --train_tokens=$((30 * 16 * 256)) --val_every=10 \
        --val_tokens=8192 --save_every=10 --untimed_steps=5 --run_dir="$run/run" "${tiny[@]}"
    local status=$?
    mkdir -p "$out/ddp" && cp "$run"/run/{train.log,metrics.jsonl,config.json} "$out/ddp/"
    rm -rf "$run"  # made by mktemp above: only this stage's run folder
    return $status
}

paper_run() {  # paper_run ROUTER: the global batch is one device batch (the sample holds ~4);
    local run  # validation reads the training shard (the validation one is too small): timing
    run=$(mktemp -d) || return 1
    python train_gpt.py --router="$1" "${sample[@]}" --batch_size=32 --device_batch_size=32 \
        --train_tokens=$((40 * 32 * 1024)) --val_every=0 --val_tokens=32768 --save_every=0 \
        --untimed_steps=10 --run_dir="$run/run" "${tiny[@]}"
    local status=$?
    mkdir -p "$out/paper_$1" && cp "$run"/run/{train.log,metrics.jsonl,config.json} "$out/paper_$1/"
    rm -rf "$run"  # made by mktemp above: only this stage's run folder
    (( status )) && return $status
    python - "$out/paper_$1/metrics.jsonl" <<'EOF'  # it learns: the loss falls by 10% at least
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
first = next(r["train_loss"] for r in records if r["kind"] == "train")
last = [r["val_loss"] for r in records if r["kind"] == "val"][-1]
print(f"step 1 training loss {first:.4f}, last validation loss {last:.4f}")
sys.exit(0 if last < 0.9 * first else "error: the loss did not fall by 10%: not learning")
EOF
}

stage env 60 env_check
stage paper_none 120 paper_run none  # learning first: both losses must fall
stage paper_skip_middle 120 paper_run skip_middle
stage tests 240 python -m pytest -q test_train.py -k cuda -rs
stage ddp 120 ddp_run
stage bench 240 python bench.py "${bench[@]}" --out="$out/bench"

# the checks end here (about 10 min, 2 calls); the grid is a result, not a check: it trains
# until the budget is spent; SIGTERM lets the run in flight save, and sweep.py then stops with
# status 0; done once it has written its record
if [ ! -e "$out/checks.done" ]; then
    echo "checks: finished (exit status of each stage above)" | tee -a "$out/summary.txt"
    touch "$out/checks.done"
fi
if [ ! -e "$out/grid/runs.csv" ]; then
    left=$((budget - SECONDS))
    if (( left < 30 )); then
        echo "next: the grid; run 'bash gpu_check.sh $out' again"
        exit 0
    fi
    echo "== grid (${grid[*]}), for up to $left s"
    timeout --signal=TERM --kill-after=30 "$left" python sweep.py "${grid[@]}" \
        --runs="${GPU_CHECK_RUNS:-logs/gpu_check_grid_$gpu}" --out="$out/grid" \
        >> "$out/grid.txt" 2>&1
    status=$?  # 124, 137: cut by the budget (the run in flight saved, or was starting)
    if [ -e "$out/grid/runs.csv" ]; then
        echo "grid: done; $(tail -1 "$out/grid.txt")" | tee -a "$out/summary.txt"
    elif (( status != 124 && status != 137 )); then
        echo "grid: failed (exit $status): $(tail -1 "$out/grid.txt")" | tee -a "$out/summary.txt"
        exit 1
    else
        echo "grid: $(tail -1 "$out/grid.txt"); run 'bash gpu_check.sh $out' again"
        exit 0
    fi
fi
echo "all done: $out (commit it)"
