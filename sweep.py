"""The paper's Figure 2 in one command: dense baselines and gated models, cross-entropy against
estimated forward FLOPs per token, with the verdict as a number.

    python sweep.py --grid=cpu                      # 2 CPU cores, embedded sample, ~9 min
    python sweep.py --grid=gpu1                     # one H100, ~29 min, FineWeb
    python sweep.py --grid=paper --nproc_per_node=8 # Table 2 settings, 8 GPUs, ~19 h
    python sweep.py --grid=bytes_core --seeds=5 --jobs=3
                                      # byte-level study, 2 cores, ~3 h (data/debian_docs.py first)
    python sweep.py --report=RECORD/runs.csv        # a record's table and figure again

Each configuration of the grid trains through train_gpt.py in its own run directory under
--runs, --jobs of them at once; running the command again after a crash or a Ctrl-C skips the
finished runs, resumes the interrupted ones and starts the rest. What is measured, the verdict
(paired over seeds, Holm-corrected) and the record: README.md, Results.

Add a configuration with one line in a grid's runs (figure2_runs builds them; bytes keeps them
all, bytes_core BYTES_CORE's names): (name, [train_gpt.py overrides]). Names starting with
"dense_" make the frontier. A run that starts from another (DLO) has a third element,
expand.py's arguments, with "{runs}" and "{seed}" filled in: it is expanded from a dense run of
the same grid and seed, listed before it, then trained with --resume.
"""

import contextlib
import csv
import functools
import io
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, fields, replace

import fileio
import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402

import bench  # noqa: E402
import expand  # noqa: E402
import launch  # noqa: E402
import routers  # noqa: E402
import runlog  # noqa: E402
import runs  # noqa: E402
import sources  # noqa: E402
import train_gpt as tg  # noqa: E402
from data import debian_docs, tokenize_corpus  # noqa: E402
from data.shards import check_fingerprints, find_shards, first_tokens  # noqa: E402
from stats import detectable, holm, paired  # noqa: E402

# ---------------------------------------------------------------------------- grids


def dense(L):
    return (f"dense_{L}", ["--router=none", f"--n_layers={L}"])


def gated(name, *extra):
    return (name, ["--router=skip_middle", *extra])


def dlo(rho, source, groups, anneal, tokens=None):
    """A third element: the run starts as expand.py's identity expansion of `source`, then
    trains `tokens` more (default: the grid's train_tokens)."""
    return (
        f"dlo_rho{rho}",
        ["--router=dlo", f"--dlo_rho={rho}", f"--dlo_anneal_steps={anneal}"]
        + ([f"--train_tokens={tokens}"] if tokens else []),
        ["{runs}/" + source + "_s{seed}", f"--groups={groups}", "--per_group=1", "--init=identity"],
    )


def dlo_control(source, groups, tokens=None):
    """DLO's control: the same expansion of the same source, trained through the same two phases
    (a fresh optimiser and warm-up) as a dense model that skips nothing."""
    return (
        "dlo_control",
        ["--router=none"] + ([f"--train_tokens={tokens}"] if tokens else []),
        dlo(0, source, groups, 0)[2],
    )


def mod(capacity, L):
    return (f"mod_c{capacity}", ["--router=mod", f"--n_layers={L}", f"--mod_capacity={capacity}"])


def mor(L, routed=True):
    """Mixture-of-Recursions at the deepest applied depth n <= L that its sharing allows (N_r = 3,
    or 2 below 5 layers), or its recursive baseline (the same sharing, every token every time)."""
    r = 3 if L >= 5 else 2
    return (
        f"{'mor' if routed else 'recursive'}_r{r}",
        ["--router=mor", f"--n_layers={L - (L - 2) % r}", f"--mor_recursions={r}"]
        + ([] if routed else ["--mor_routed=false"]),
    )


def figure2_runs(L, dlo_anneal_steps, tokens):
    """The paper's points for an L-layer gated model, plus our extra points: the authors' gate
    axis, the zero gate init, DLO at two skip rates, Mixture-of-Depths, and Mixture-of-Recursions
    with its recursive baseline. tokens: the grid's train_tokens. DLO trains from the same total
    budget as every other point: an L/2-layer dense source trains tokens / 2 (dlo_source_L/2, a
    point off the frontier), its expansion to L layers the other half."""
    half = tokens // 2
    return (
        [dense(n) for n in range(2, L + 1, 2)]
        + [gated("gated_nocontrol", f"--n_layers={L}", "--controller=none")]
        + [
            gated(f"gated_mu{m}", f"--n_layers={L}", f"--mu_end={m}")
            for m in (0.75, 0.5, 0.25, 0.0)
        ]
        + [
            gated("gated_query_mu0.5", f"--n_layers={L}", "--mu_end=0.5", "--gate_axis=query"),
            gated("gated_zeroinit_mu0.5", f"--n_layers={L}", "--mu_end=0.5", "--gate_init=zero"),
        ]
        + [
            (
                f"dlo_source_{L // 2}",
                ["--router=none", f"--n_layers={L // 2}", f"--train_tokens={half}"],
            )
        ]
        + [dlo(rho, f"dlo_source_{L // 2}", L // 2, dlo_anneal_steps, half) for rho in (0.25, 0.5)]
        + [dlo_control(f"dlo_source_{L // 2}", L // 2, half)]
        + [mod(0.125, L), mor(L), mor(L, routed=False)]
    )


BYTES_BASE = [
    "--train_files=data/debian_docs/docs_train_*.bin",
    "--val_files=data/debian_docs/docs_val_*.bin",
    "--encoding=bytes",
    "--vocab_size=256",
    "--dim=64",
    "--n_heads=4",
    "--n_kv_heads=4",
    "--max_seq_len=256",
    "--seq_len=256",
    "--batch_size=8",
    "--device_batch_size=8",
    "--val_every=0",
    "--val_tokens=5046272",
    "--save_every=200",
    "--lr=3e-3",
    "--compile=false",
]
GRIDS = {
    # Table 2 for every run (dense 2..12 layers, 10B tokens each). Estimated wall time on
    # 8 H100s: the 12-layer model costs 3 x 0.32 GFLOPs per token; at ~40% of 8 x 989 TFLOPs
    # that is ~3 M tokens/s, ~1 h per 10B-token run, ~19 h for the 20 runs (smaller ones faster).
    "paper": dict(base=[], runs=figure2_runs(12, 500, 10_000_000_000)),
    # One H100 in ~29 min: 18 runs of ~95 s each, ~30 s of it compilation. An
    # 8-layer dim-512 model at seq 512 costs ~0.35 GFLOPs per training token; at ~150 TFLOPs
    # achieved that is ~400k tokens/s, so 24M tokens (730 steps of 32k tokens) per run.
    "gpu1": dict(
        base=[
            "--dim=512",
            "--n_heads=8",
            "--n_kv_heads=8",
            "--max_seq_len=512",
            "--seq_len=512",
            "--batch_size=64",
            "--device_batch_size=64",
            "--train_tokens=24000000",
            "--val_every=0",
            "--val_tokens=1048576",
            "--save_every=200",
        ],
        runs=figure2_runs(8, 100, 24_000_000),
    ),
    # The mechanics on the embedded sample, 2 CPU cores, ~9 min (16 runs): a demonstration only
    # (tiny models, 120 steps, the output head dominates the FLOPs).
    "cpu": dict(
        base=[
            "--preset=smoke",
            "--dim=64",
            "--n_heads=4",
            "--n_kv_heads=2",
            "--max_seq_len=64",
            "--seq_len=64",
            "--batch_size=8",
            "--device_batch_size=8",
            "--train_tokens=61440",
            "--val_every=0",
            "--val_tokens=4096",
            "--save_every=40",
            "--lr=3e-3",
        ],
        runs=figure2_runs(4, 40, 61440),
    ),
    # The byte-level study (README: Results): blocks, not the 256-row head, are the compute.
    # 6 layers of width 64 on data/debian_docs.py's corpus, 1,200 steps of 8 x 256 bytes (600,
    # records/2026-11-25_figure2_bytes_cpu, left the deeper dense models undertrained); the
    # validation: the corpus's held-out excerpts of 768 characters, one per page, 6,729 of its
    # 6,730 (the last cut short), for a standard error over documents below 0.005 (docs/data.md).
    "bytes": dict(
        base=BYTES_BASE + ["--train_tokens=2457600"],
        corpus_sha256=tokenize_corpus.corpus_sha256(debian_docs.SHA256),
        runs=figure2_runs(6, 100, 2457600),
    ),
}
# bytes' grid reduced to what answers the question (the paper's gate at its mu_end 0.5, DLO and its
# dense control, MoD): five seeds take about 3 h on 2 cores as three one-thread runs at once
# (--jobs=3); the records give each study's time.
BYTES_CORE = (
    "dense_2",
    "dense_4",
    "dense_6",
    "gated_mu0.5",
    "dlo_source_3",
    "dlo_rho0.5",
    "dlo_control",
    "mod_c0.125",
)
GRIDS["bytes_core"] = dict(
    GRIDS["bytes"], runs=[r for r in GRIDS["bytes"]["runs"] if r[0] in BYTES_CORE]
)


# The byte study where the blocks are the compute and a GPU is busy (issue 57): width 384 (six
# heads of 64), 32 x 256 bytes a step, 1,200 steps, compiled, Table 2's learning rate; the core
# configurations plus the paper's gate at mu_end 0.25 and Mixture-of-Recursions with its
# recursive baseline. The controller's gamma is raised from Table 2's 1e-3, at which the gates
# missed their targets in 1,200 steps, to where five pilot seeds' gates ended within 0.05 of
# them (a deviation; README: Results). For one GPU call:
# python sweep.py --grid=bytes_gpu --seeds=5 --jobs=8. Its size is an estimate that no GPU has
# checked: about 35 PFLOPs of training for 5 seeds (3 x flops_per_token x train_tokens, summed,
# at inference's routing: DLO and MoD train more), 87 s at 400 TFLOP/s and 174 s at 200, plus
# for each of 55 runs its start, its compile (the Inductor cache shared) and a validation of
# 5 MB, 8 at a time.
BYTES_GATE_GAMMA = "1e-1"  # records/2026-11-27_gate_gamma_pilot_cpu: gaps at most 0.046, 5 seeds
GRIDS["bytes_gpu"] = dict(
    GRIDS["bytes"],
    base=BYTES_BASE
    + [
        "--dim=384",
        "--n_heads=6",
        "--n_kv_heads=6",
        "--batch_size=32",
        "--device_batch_size=32",
        "--train_tokens=9830400",
        "--lr=1e-3",
        "--compile=true",
    ],
    runs=[
        (name, args + [f"--gamma={BYTES_GATE_GAMMA}"] if name.startswith("gated") else args, *rest)
        for name, args, *rest in figure2_runs(6, 100, 9830400)
        if name in BYTES_CORE + ("gated_mu0.25", "mor_r3", "recursive_r3")
    ],
)


# ---------------------------------------------------------------------------- running


def run_state(run_dir: str) -> str:
    """done: validated at its last step (runlog.complete) and its checkpoint of that step (a
    job killed between the two left an earlier one, which the trainer goes on from); resume (a
    checkpoint); or fresh. A validated run without a checkpoint of its own that loads, whose
    weights measure reads, is a UserError (before any run starts, not after the grid trained)."""
    path = os.path.join(run_dir, runs.CHECKPOINT)
    if runlog.complete(run_dir):
        run_id = runs.logged(run_dir)
        step = runs.saved_step(path, run_id) if isinstance(run_id, str) else None
        if step is None:
            raise support.UserError(
                f"{run_dir}: a finished run without a {runs.CHECKPOINT} of its own that loads "
                f"(gone, damaged, a link, or another run's), whose weights are measured: put "
                f"its own back, or move the run away to train it again"
            )
        last = runlog.json_object(os.path.join(run_dir, "config.json")).get("num_steps")
        if step == last:
            return "done"
    return "resume" if os.path.exists(path) else "fresh"


EXPANSION = ("groups", "per_group", "init", "tau")  # expand.py's own settings (expand.json)


HOW = ("device_batch_size", "loss_rows", "attn_impl", "compact")  # how a step is computed, not
#                                  what: a resume may change them; compared where the grid sets them


def check_settings(run_dir: str, plan: list):
    """A run begun before the grid was edited is not taken as this grid's: a UserError naming each
    setting the plan's first command gives that the run's files hold otherwise. Every field of
    Hyperparameters that config.json holds is compared, so an override removed counts as much as
    one changed (HOW's only where the grid sets them), and a DLO run's expansion settings too
    (expand.json; its settings are those expand.py derives from its source's)."""
    script, argv = plan[0]
    there = runlog.json_object(os.path.join(run_dir, "config.json"))
    argv = [a for a in argv if not a.startswith("--run_dir=")]
    if script == "expand.py":
        args, rest = expand.parser().parse_known_args(argv)
        source = os.path.join(args.run_dir, "config.json")
        if not (base := runlog.json_object(source)):
            raise support.UserError(f"{source}: not a run's settings (the source of {run_dir})")
        explicit = expand.parse_settings(rest)
        hp = expand.expanded_settings(
            sources.saved_settings(base), explicit, args.groups, args.per_group, args.init, args.tau
        )
        there.update(
            (k, v)
            for k, v in runlog.json_object(os.path.join(run_dir, "expand.json")).items()
            if k in EXPANSION
        )
        given = {k: getattr(args, k) for k in EXPANSION}
    else:
        given, explicit = {}, tg.parse_overrides(argv)
        hp = tg.resolve(explicit)
    given.update(
        (k, v)
        for k, v in asdict(hp).items()
        if k not in ("train_files", "val_files") and (k in explicit or k not in HOW)
    )
    changed = [
        f"{k}={there[k]} there, {v} here" for k, v in given.items() if k in there and there[k] != v
    ]
    if changed:
        raise support.UserError(
            f"{run_dir} was trained with other settings ({'; '.join(changed)}):"
            f" the grid changed since; give another --runs"
        )


def run_grid(grid: dict, runs_dir: str, seeds: range, nproc: int, jobs: int = 1) -> list:
    """Train every (configuration, seed) not finished yet, up to `jobs` at once (launch.run_plans; a
    DLO run after its source), the settings of each run begun checked before any starts. ->
    [(name, seed, run_dir, the commands that train it alone)]."""
    plans, done = [], []
    for seed in seeds:
        for name, overrides, *expansion in grid["runs"]:
            run_dir = os.path.join(runs_dir, f"{name}_s{seed}")
            state = run_state(run_dir)
            args = [a.format(runs=runs_dir, seed=seed) for a in overrides]
            # the job's settings (the preset's, then those given), kept on resume, which takes
            # no preset (--preset=smoke's compile=False: a resumed run on a GPU would compile)
            settings = tg.job_settings(tg.parse_overrides(grid["base"] + args))
            job = [
                f"--{f.name}={getattr(settings, f.name)}"
                for f in fields(settings)
                if f.name not in ("run_dir", "resume", "preset")
                and getattr(settings, f.name) != f.default
            ]
            resume = ("train_gpt.py", [f"--resume={run_dir}", *job])
            source = ""
            if expansion:  # a step-0 checkpoint, then trained as a resume
                source, *how = [a.format(runs=runs_dir, seed=seed) for a in expansion[0]]
                plan = [("expand.py", [source, run_dir, *how, *args]), resume]
            else:
                plan = [
                    (
                        "train_gpt.py",
                        grid["base"] + args + [f"--seed={seed}", f"--run_dir={run_dir}"],
                    )
                ]
            if state != "fresh":
                check_settings(run_dir, plan)
                if state == "done":
                    final_validation(run_dir)  # (what measure reads of it)
            else:  # its first command's checks, before any run starts (under torchrun a rank's
                # line came after other runs began): where it writes (a file there, say), and
                # the trainer's (an expansion's: at its start) of what its folder holds and of
                # its settings (validate: not of its data or device) with the world size
                fileio.writable_dir(run_dir)
                if not expansion:
                    runs.check_new_run_dir(run_dir)
                    try:
                        tg.validate(tg.resolve(tg.parse_overrides(plan[0][1])), nproc)
                    except support.UserError as e:
                        raise support.UserError(f"{run_dir}: {e}") from None
            steps = {"fresh": plan, "resume": [resume], "done": []}[state]
            said = f"{name} seed {seed}: {state if state == 'done' else 'trained'}"
            plans.append(launch.Plan(run_dir, steps, after=source, said=said))
            # as run from the repository
            command = " && ".join(
                f"python {script} {shlex.join(argv)}" for script, argv in plan
            ).replace(support.HERE + os.sep, "")
            done.append((name, seed, run_dir, command))
    launch.run_plans(plans, nproc, jobs)
    return done


# ---------------------------------------------------------------------------- measuring


@torch.no_grad()
def eval_ms_per_token(models: dict, idx) -> dict:
    """{name: model} -> {name: the median wall time of its evaluation forward pass over idx, per
    token, in ms}: after a warm-up, three calls each, side by side (bench.timed)."""
    calls = {name: functools.partial(model, idx) for name, model in models.items()}
    sync = functools.partial(torch.cuda.synchronize, idx.device) if idx.is_cuda else lambda: None
    with tg.mixed_precision(idx.device.type):
        for call in calls.values():
            call()  # (compiling, where compiled)
        times = bench.timed(calls, 3, sync)
    return {name: 1000 * times[name] / idx.numel() for name in models}


@functools.lru_cache(maxsize=None)  # once per corpus, not per run (FineWeb's shards are ~20 GB)
def corpus_sha256(train_files: str, val_files: str) -> str:
    return tokenize_corpus.corpus_sha256(
        {
            os.path.basename(p): tokenize_corpus.sha256_of(p)
            for p in find_shards(train_files) + find_shards(val_files)
        }
    )


def check_corpus(run_dir: str):
    """The training shards the run read are those there (its checkpoint's fingerprints: names,
    sizes, first and last tokens; not the middles, nor the shards it did not read, nor the
    validation shards), as its row's corpus_sha256 hashes the shards there when measured."""
    ckpt = sources.load_checkpoint(run_dir)
    files = find_shards(tg.resolve({}, sources.saved_settings(ckpt["hp"])).train_files)
    try:
        check_fingerprints(files, ckpt["loader"], "measure it on the shards it trained on")
    except support.UserError as e:
        raise support.UserError(f"{run_dir}: {e}") from None


# runs.csv's columns that a run's final validation record gives (measure), and its keys for them
RECORDED = {k: k for k in ("val_loss", "val_se", "val_docs", "sparsity")}
RECORDED["flops_per_token"] = "fwd_flops_per_token"


def final_validation(run_dir: str) -> dict:
    """A finished run's final validation record (runlog.complete), what measure reads of it
    checked as read_runs checks runs.csv (column_problem), and block_active a share per layer
    (every router's record has it). A UserError naming what is not (run_grid: before the grid
    trains, not a traceback once it has)."""
    val = runlog.run_records(run_dir, "val")[-1]
    n_layers = runlog.json_object(os.path.join(run_dir, "config.json")).get("n_layers")
    shares = val.get("block_active")
    problems = [column_problem(c, val.get(key), key) for c, key in RECORDED.items()]
    if not (
        isinstance(shares, list)
        and len(shares) == n_layers
        and all(type(a) in (int, float) and 0 <= a <= 1 for a in shares)
    ):
        problems.append(f"block_active={shares!r} is not a share for each of its {n_layers} layers")
    if problem := next(filter(None, problems), ""):
        raise support.UserError(
            f"{os.path.join(run_dir, runlog.LOGS[1])}: in its final validation record, {problem}"
            f" (edited, or an older version's?): mend the line, or move the run away to train it "
            f"again"
        )
    return val


def measure(run_dir: str, device: str) -> dict:
    """One row of runs.csv: the run's final validation record, its settings and commit, the
    sparsity each block reached against its target, and evaluation time per token on its final
    weights (masked, and compacted where the router allows it)."""
    val = final_validation(run_dir)
    config = runlog.json_object(os.path.join(run_dir, "config.json"))
    hp, weights = sources.read_source(run_dir)  # (the checkpoint read once, for both models)
    model = tg.built(hp, weights, device).eval()
    can_compact = not tg.ROUTERS[hp.router].check(replace(hp, compact=True))
    compact = tg.built(replace(hp, compact=True), weights, device).eval() if can_compact else model
    tokens = first_tokens(hp.val_files, hp.vocab_size, hp.device_batch_size * hp.seq_len)
    idx = torch.from_numpy(tokens.astype("int64")).view(-1, hp.seq_len).to(device)
    if can_compact:  # packed lengths known on the host: no read per block
        routers.fit_lengths(compact, idx)

    def ready(m):  # compiled on CUDA, the same way on both paths measured
        return tg.compile_model(m) if device.startswith("cuda") else m

    row = dict(
        # (val_se and val_docs None: validated before train_gpt.py counted documents)
        **{column: val.get(key) for column, key in RECORDED.items()},
        encoding=hp.encoding,
        steps=val["step"],
        tokens=val["step"] * hp.batch_size * hp.seq_len,
        commit=(config.get("git_commit") or "none") + ("+dirty" if config.get("git_dirty") else ""),
        corpus_sha256=corpus_sha256(hp.train_files, hp.val_files),
        router=hp.router,
        n_layers=hp.n_layers,
        # unique parameters, outside the embedding and head
        params=sum(
            p.numel() for n, p in model.named_parameters() if not n.startswith(("embed.", "head."))
        ),
    )
    timed = {"masked": ready(model)}
    if can_compact:
        timed["compact"] = ready(compact)
    ms = eval_ms_per_token(timed, idx)
    row["ms_per_token_masked"] = ms["masked"]
    row["ms_per_token_compact"] = ms.get("compact", ms["masked"])  # (where it cannot compact)
    targets = model.router.zero_targets()
    row["gate_zero"] = " ".join(f"{1 - a:.4f}" for a in val["block_active"]) if targets else ""
    row["target_zero"] = " ".join("none" if z is None else f"{z:.4f}" for z in targets or ())
    return row


# ---------------------------------------------------------------------------- the verdict

SLACK = 0.01  # a run up to 1% beyond the end dense point (a gated model with few zero
# gates costs its gate linears more than the dense model) takes that point's value


def frontier(points: list, envelope: bool = True):
    """points: (flops, value) of one seed's dense runs -> f(flops): their lower envelope (a dense
    point no better than a cheaper one is dropped; beyond the best point the best value holds;
    envelope=False: every point), linear in log FLOPs between the points kept, from the cheapest
    dense point to the costliest, SLACK beyond either end; else None (no extrapolation)."""
    pts, kept = sorted((math.log(f), v) for f, v in points), []
    for x, v in pts:
        if not kept or v < kept[-1][1] or not envelope:
            kept.append((x, v))
    if pts and kept[-1][0] < pts[-1][0]:
        kept.append((pts[-1][0], kept[-1][1]))

    def at(flops):
        x = math.log(flops)
        if not pts or not pts[0][0] - SLACK <= x <= pts[-1][0] + SLACK:
            return None
        if x <= kept[0][0] or x >= kept[-1][0]:
            return kept[0][1] if x <= kept[0][0] else kept[-1][1]
        for (x0, y0), (x1, y1) in zip(kept, kept[1:], strict=False):
            if x0 <= x <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    return at


def control_of(name: str):
    """The run a configuration is also compared with, seed by seed: DLO its dense expansion
    (dlo_control), MoR its recursive baseline; None for the others."""
    return (
        "dlo_control"
        if name.startswith("dlo_rho")
        else "recursive_" + name[4:]
        if name.startswith("mor_")
        else None
    )


def summarise(rows: list) -> list:
    """rows: runs.csv's rows -> one line per comparison: each non-dense configuration against
    the dense frontier of its own seed, and DLO and MoR against their controls; paired over
    the seeds, Holm-corrected across all the comparisons of the grid."""
    seeds = sorted({r["seed"] for r in rows})
    dense = [r for r in rows if r["name"].startswith("dense_")]

    def fronts(key: str, envelope: bool = True) -> dict:  # each seed's dense frontier of key
        return {
            s: frontier([(r["flops_per_token"], r[key]) for r in dense if r["seed"] == s], envelope)
            for s in seeds
        }

    loss_fronts, time_fronts = fronts("val_loss"), fronts("ms_per_token_masked", envelope=False)
    run = {(r["name"], r["seed"]): r for r in rows}
    lines = []

    def of_seeds(some):  # how many of the rows' seeds a line holds
        return len(some) if len(some) == len(seeds) else f"{len(some)} of {len(seeds)}"

    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        base = {
            k: statistics.mean(r[k] for r in mine)
            for k in (
                "val_loss",
                "sparsity",
                "flops_per_token",
                "params",
                "ms_per_token_masked",
                "ms_per_token_compact",
            )
        }
        base["val_loss_sd"] = (
            statistics.stdev(r["val_loss"] for r in mine) if len(mine) > 1 else None
        )
        base["val_se"] = max((r["val_se"] for r in mine if r["val_se"] is not None), default=None)
        ms = [t for r in mine if (t := time_fronts[r["seed"]](r["flops_per_token"]))]
        base["dense_ms_at_equal_flops"] = statistics.mean(ms) if ms else None
        if name.startswith("dense_"):
            lines.append(dict(base, name=name, vs="", seeds=of_seeds(mine), verdict="frontier"))
            continue
        for vs in ("dense frontier", control_of(name)):
            if vs is None or vs != "dense frontier" and not any(r["name"] == vs for r in rows):
                continue
            other = [
                loss_fronts[r["seed"]](r["flops_per_token"])
                if vs == "dense frontier"
                else run[(vs, r["seed"])]["val_loss"]
                if (vs, r["seed"]) in run
                else None
                for r in mine
            ]
            deltas = [r["val_loss"] - o for r, o in zip(mine, other, strict=False) if o is not None]
            # seeds: fewer where a seed has no run, its point is out of the frontier's range, or it
            # has no control
            lines.append(dict(base, name=name, vs=vs, seeds=of_seeds(deltas), **paired(deltas)))
    adjusted = holm([ln.get("p") for ln in lines])
    tests = sum(p is not None for p in adjusted)
    for ln, p in zip(lines, adjusted, strict=False):
        if ln["vs"]:
            ln["p_holm"] = p
            ln["detectable"] = (
                detectable(ln["sd"], ln["n"], 0.05 / tests) if p is not None else None
            )
            ln["verdict"] = verdict(ln)
    return lines


def verdict(ln: dict) -> str:
    """The record's words: better / worse only where the Holm-corrected p < 0.05."""
    if ln["mean"] is None:
        return "outside the dense FLOPs range" if ln["vs"] == "dense frontier" else "no control run"
    if ln["p_holm"] is None:
        side = "below" if ln["mean"] < 0 else "above" if ln["mean"] > 0 else "equal"
        why = "one seed" if ln["n"] < 2 else "the same difference in every seed"
        return f"{side} ({why}: no test)"
    than = "dense" if ln["vs"] == "dense frontier" else ln["vs"]
    if ln["p_holm"] < 0.05:
        return f"{'better' if ln['mean'] < 0 else 'worse'} than {than}"
    return f"no detectable difference (uncorrected 95% CI [{ln['lo']:+.3f}, {ln['hi']:+.3f}])"


def verdict_text(lines: list) -> str:
    """The verdict in words: each tested comparison's that is not "no detectable difference",
    then each untested one's, with why (verdict)."""
    tested = [ln for ln in lines if ln["vs"] and ln.get("p_holm") is not None]
    untested = "; ".join(
        f"{ln['name']} {ln['verdict']}" for ln in lines if ln["vs"] and ln.get("p_holm") is None
    )
    if not tested:
        return f"no difference can be tested: {untested}." if untested else "no comparison."
    said = [
        f"{ln['name']} {ln['verdict']} ({ln['mean']:+.3f}, uncorrected 95% CI [{ln['lo']:+.3f}, "
        f"{ln['hi']:+.3f}], Holm p = {ln['p_holm']:.3g})"
        for ln in tested
        if not ln["verdict"].startswith("no detectable")
    ]
    n = len(tested)
    return (
        f"{n} paired comparison{'s' if n > 1 else ''} over {max(ln['n'] for ln in tested)} seeds, "
        f"Holm-corrected: " + ("; ".join(said) if said else "no detectable difference in any") + "."
    ) + (f" Not tested: {untested}." if untested else "")


# ---------------------------------------------------------------------------- the record

RUN_KEYS = {  # runs.csv's columns, in order, and each one's type
    "name": str,
    "seed": int,
    "val_loss": float,
    "val_se": float,
    "val_docs": int,
    "encoding": str,
    "flops_per_token": float,
    "sparsity": float,
    "steps": int,
    "tokens": int,
    "commit": str,
    "corpus_sha256": str,
    "router": str,
    "n_layers": int,
    "params": int,
    "ms_per_token_masked": float,
    "ms_per_token_compact": float,
    "gate_zero": str,
    "target_zero": str,
    "command": str,
}


MAX_RUNS_CSV = 64 << 20  # a grid's runs.csv: about 2 kB a run; more is not one
# where runs.csv's numbers lie (read_runs); any other: [0, 1e100), a bound that keeps the
# report's statistics and figure finite
RUN_RANGES = {"flops_per_token": "(0, 1e100)", "sparsity": "[0, 1]"}
OPTIONAL = ("val_se", "val_docs")  # its columns that may be empty (None)
# a number as a CSV writer writes one (Python's int() and float() take more: 1_0, " 5", "٥", nan)
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)


def column_problem(column: str, v, name: str = None) -> str:
    """What keeps the value v (named name, by default the column's) from runs.csv's numeric
    column: empty (None) where it may not be (OPTIONAL), not a number of its type (RUN_KEYS), or
    out of its range (RUN_RANGES); "" where nothing does."""
    name, spec = name or column, RUN_RANGES.get(column, "[0, 1e100)")
    whole = RUN_KEYS.get(column, float) is int
    if v is None:
        return "" if column in OPTIONAL else f"{name} is empty"
    if type(v) not in ((int,) if whole else (int, float)):
        return f"{name}={v!r} is not {'a whole number' if whole else 'a number'}"
    return "" if support.within(v, spec) else f"{name}={v} must lie in {spec}"


def read_runs(path: str) -> list:
    """runs.csv -> its rows, numbers as numbers (an empty field: None). At most MAX_RUNS_CSV
    bytes; a file cut short (its last row unended, or a row short of the header's fields) is
    refused, naming the line."""
    if os.path.getsize(fileio.need(path, "a file")) > MAX_RUNS_CSV:
        raise support.UserError(
            f"{path}: over {MAX_RUNS_CSV >> 20} MiB: not a runs.csv of sweep.py"
        )
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8-sig")
        table = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(table)
    except (UnicodeDecodeError, csv.Error) as e:
        raise support.UserError(f"{path}: not a runs.csv of sweep.py ({e})") from None
    if set(RUN_KEYS) - set(table.fieldnames or ()):
        raise support.UserError(
            f"{path}: not a runs.csv of sweep.py (columns: {', '.join(RUN_KEYS)})"
        )
    if not rows:
        raise support.UserError(f"{path}: a runs.csv with no run in it")
    if not text.endswith("\n"):
        raise support.UserError(f"{path}: its last row is not ended: the file was cut short")
    for i, r in enumerate(rows, 2):
        if None in r or None in r.values():  # (csv's marks: fields beyond the header, or short)
            raise support.UserError(f"{path}:{i}: not as many fields as the header: cut short?")
        for k, v in r.items():
            kind = RUN_KEYS.get(k, float)  # (a column that is not ours: a number)
            try:
                if kind is not str:
                    if v and not NUMBER.fullmatch(v):
                        raise ValueError
                    r[k] = kind(v) if v else None
            except (TypeError, ValueError):
                raise support.UserError(f"{path}:{i}: {k}={v!r} is not a number") from None
        if not r["name"].strip():
            raise support.UserError(f"{path}:{i}: a run with no name")
        for k, v in r.items():
            if RUN_KEYS.get(k, float) is not str and (problem := column_problem(k, v)):
                raise support.UserError(f"{path}:{i}: {problem}")
        zero, target = r["gate_zero"].split(), r["target_zero"].split()
        if len(zero) != len(target) or not all(
            is_share(z) and (t == "none" or is_share(t)) for z, t in zip(zero, target, strict=True)
        ):
            raise support.UserError(
                f"{path}:{i}: gate_zero and target_zero: a share in [0, 1] per gated block "
                f"each (a target may be none), or both empty"
            )
    if len({(r["name"], r["seed"]) for r in rows}) < len(rows):
        raise support.UserError(f"{path}: a (name, seed) appears twice; one row per run")
    for k in ("encoding", "corpus_sha256"):  # (the runs of one study: compared with each other)
        if len({r[k] for r in rows}) > 1:
            raise support.UserError(f"{path}: its runs differ in {k}: one study's runs only")
    return rows


def check_record(out: str, grid: dict, seeds: range):
    """A record in OUT is replaced only by one that measures each of its runs again: one of a
    grid split over commands (--first_seed) would lose the others' rows. Checked before the
    runs and again before the record is written (a command beside this one may have written
    it since)."""
    path = os.path.join(out, "runs.csv")
    if not os.path.exists(path):
        return
    try:
        held = {(r["name"], r["seed"]) for r in read_runs(path)}
    except support.UserError as e:
        raise support.UserError(f"{e}; this command would replace it: give another --out") from None
    lost = sorted(held - {(name, seed) for seed in seeds for name, *_ in grid["runs"]})
    if lost:
        more = f" and {len(lost) - 1} more" if lost[1:] else ""
        raise support.UserError(
            f"{path} holds runs that this command does not measure ({lost[0][0]} seed "
            f"{lost[0][1]}{more}: not among this grid's runs and seeds), and would lose them: "
            f"give another --out, or one command that measures them all (one grid's seeds split "
            f"by --first_seed: each part its own --out, then --seeds=K over the same --runs)"
        )


def is_share(text: str) -> bool:
    """Whether text reads as a number in [0, 1] (a zero share of runs.csv)."""
    with contextlib.suppress(ValueError):
        return 0 <= float(text) <= 1
    return False


def fmt(v, spec=".4f"):
    return "" if v is None else format(v, spec)


def write_runs(out: str, rows: list):
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, list(RUN_KEYS), lineterminator="\n")
    w.writeheader()
    w.writerows({k: "" if r.get(k) is None else r[k] for k in RUN_KEYS} for r in rows)
    fileio.write_output(out, "runs.csv", text.getvalue().encode(), by=__file__)


REPORT = ("table.md", "figure.png")  # what write_report writes


def write_report(out: str, rows: list) -> list:
    """table.md and figure.png from runs.csv's rows (also: python sweep.py --report=runs.csv)."""
    lines = summarise(rows)
    unit = "nats per " + ("byte" if rows[0]["encoding"] == "bytes" else "token")
    tests = sum(ln.get("p_holm") is not None for ln in lines)
    table = [
        f"Differences in validation cross-entropy ({unit}), each run minus the same seed's "
        f"dense frontier (the lower envelope of that seed's dense points: those better than "
        f"every cheaper one, linear in log FLOPs between them) or control; mean over seeds, "
        f"t-based 95% interval (df = n - 1, uncorrected), two-sided paired t-test, its p "
        f"Holm-corrected across the {tests} tests (the verdict reads the corrected p alone). SD: "
        f"of the per-seed differences. Detectable: the true difference a test at level "
        f"0.05 / {tests} finds with 80% power, the seeds' SD taken as the true one, by the "
        f"shifted-t approximation (exactly, fewer at few seeds: 75% at n = 5 and 0.05 / 6). "
        f"val SE: the largest over seeds of the validation estimate's standard error over "
        f"documents.",
        "",
        "| run | vs | n | difference | 95% CI | SD | p | Holm p | verdict | detectable | "
        "val CE (mean ± SD) | val SE | sparsity | fwd MFLOPs/token | unique params (M) | "
        "eval ms/1k tok masked | compact | dense at equal FLOPs |",
        "|" + "---|" * 18,
    ]
    for ln in lines:
        ci = f"[{ln['lo']:+.4f}, {ln['hi']:+.4f}]" if ln.get("lo") is not None else ""
        table.append(
            f"| {cell(ln['name'])} | {cell(ln['vs'])} | {ln['seeds']} | "
            f"{fmt(ln.get('mean'), '+.4f')} | {ci} | {fmt(ln.get('sd'))} | "
            f"{fmt(ln.get('p'), '.3g')} | {fmt(ln.get('p_holm'), '.3g')} | "
            f"{ln['verdict']} | {fmt(ln.get('detectable'))} | {ln['val_loss']:.4f}"
            f"{' ± ' + fmt(ln['val_loss_sd']) if ln['val_loss_sd'] is not None else ''} | "
            f"{fmt(ln['val_se'])} | {ln['sparsity']:.3f} | {ln['flops_per_token'] / 1e6:.3f} | "
            f"{ln['params'] / 1e6:.3f} | {1e3 * ln['ms_per_token_masked']:.2f} | "
            f"{1e3 * ln['ms_per_token_compact']:.2f} | "
            f"{fmt(ln['dense_ms_at_equal_flops'] and 1e3 * ln['dense_ms_at_equal_flops'], '.2f')} |"
        )
    per_block = [
        "| run | seed | zero share per block (measured) | target | largest gap |",
        "|---|---|---|---|---|",
    ]
    per_block += [
        f"| {cell(r['name'])} | {r['seed']} | {r['gate_zero']} | {r['target_zero']} | "
        f"{off_target(r)} |"
        for r in rows
        if r["gate_zero"]
    ]
    png = figure(lines, unit)  # (drawn before anything is written)
    fileio.write_output(
        out,
        "table.md",
        (
            "\n".join(table)
            + "\n\nPer gated block, the share of validation tokens with g = 0 against "
            "the controller's target (1 - mu*):\n\n" + "\n".join(per_block) + "\n"
        ).encode(),
        by=__file__,
    )
    if png is not None:
        fileio.write_output(out, "figure.png", png, by=__file__)
    return lines


def cell(text: str) -> str:
    """text as one cell of a markdown table: its pipes escaped, its line breaks spaces (a run's
    name is any text of runs.csv)."""
    return " ".join(text.splitlines()).replace("|", "\\|")


def off_target(row: dict) -> str:
    """The largest |measured - target| zero share over a gated run's blocks that have a target
    (issue 57: settled within 0.05)."""
    gaps = [
        abs(float(z) - float(t))
        for z, t in zip(row["gate_zero"].split(), row["target_zero"].split(), strict=True)
        if t != "none"
    ]
    return f"{max(gaps):.4f}" if gaps else ""


def figure(lines: list, unit: str) -> bytes:
    """figure.png's bytes (None without matplotlib, a plot-only requirement)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # left: each comparison's mean difference with its 95% interval (uncorrected) and its
    # Holm-corrected p, which alone decides the verdict (verdict); right: validation CE, the
    # dense means joined in black, every other configuration its own colour (tab20 without its
    # greys: 18, the 9 strong ones first), named once in the legend
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    tab20 = plt.get_cmap("tab20").colors  # its strong colours first, then their light ones
    colours = [tab20[i] for i in [*range(0, 20, 2), *range(1, 20, 2)] if i not in (14, 15)]
    names = [n for n in dict.fromkeys(ln["name"] for ln in lines) if not n.startswith("dense_")]
    colour = {n: colours[i % len(colours)] for i, n in enumerate(names)}
    tested = [ln for ln in lines if ln["vs"] and ln.get("p_holm") is not None]
    for y, ln in enumerate(tested):
        ax.errorbar(
            ln["mean"],
            y,
            xerr=[[ln["mean"] - ln["lo"]], [ln["hi"] - ln["mean"]]],
            fmt="o",
            color=colour[ln["name"]],
            capsize=3,
            mfc="white" if ln["vs"] != "dense frontier" else None,
        )
    ax.axvline(0, color="black", lw=0.8)
    ticks = [f"{ln['name']} - {ln['vs']}\nHolm p = {ln['p_holm']:.2g}" for ln in tested]
    ax.set_yticks(range(len(tested)), ticks, fontsize=8)
    ax.invert_yaxis()
    n = max((ln["n"] for ln in tested), default=0)
    ax.set_xlabel(
        f"difference in validation CE, {unit} (negative: better)\nmean over n = {n} "
        f"seeds, bars: t-based 95% CI of the paired difference, uncorrected (a difference is\n"
        f"found where Holm p < 0.05, not where a bar misses 0); hollow: against its control",
        fontsize=9,
    )
    dense = sorted(
        (ln["flops_per_token"], ln["val_loss"]) for ln in lines if ln["name"].startswith("dense_")
    )
    if dense:
        ax2.plot(*zip(*dense, strict=True), "o-", color="black", label="dense (mean over seeds)")
    for ln in lines:
        if not ln["name"].startswith("dense_") and ln["vs"] in ("dense frontier", ""):
            ax2.errorbar(
                ln["flops_per_token"],
                ln["val_loss"],
                yerr=ln["val_loss_sd"] or 0,
                fmt="s",
                color=colour[ln["name"]],
                capsize=3,
                label=ln["name"],
            )
    ax2.set_xscale("log")
    ax2.set_xlabel("estimated forward FLOPs per token (at the measured sparsity)", fontsize=9)
    ax2.set_ylabel(
        f"validation CE, {unit}\nmean over n = {n} seeds, bars: SD over seeds", fontsize=9
    )
    ax2.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()


# ---------------------------------------------------------------------------- main


def parser() -> support.ArgParser:
    p = support.ArgParser("python sweep.py", __doc__)
    p.add_argument(
        "--grid",
        default="cpu",
        choices=list(GRIDS),  # read now: tests add grids
        help="which grid of runs (default: %(default)s)",
    )
    p.add_argument(
        "--seeds",
        type=support.in_range(int, 1, 1000),
        default=1,
        metavar="K",
        help="seeds per configuration (default: %(default)s)",
    )
    p.add_argument(
        "--first_seed",
        type=support.in_range(int, 0),
        default=0,
        metavar="S",
        help="train and report seeds S to K - 1 only: one grid split over commands that "
        "share --runs, each with its own --out, then --seeds=K measures them all "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--nproc_per_node",
        type=support.in_range(int, 1, support.MAX_PROCESSES),
        default=1,
        metavar="N",
        help="processes per run; above 1 under torchrun (default: %(default)s)",
    )
    p.add_argument(
        "--jobs",
        type=support.in_range(int, 1, support.MAX_PROCESSES),
        default=1,
        metavar="J",
        help="runs at once, each in its own process and folder, side by side on the one device "
        "(a DLO run after its source), each with its share of the CPUs unless OMP_NUM_THREADS "
        "or TORCHINDUCTOR_COMPILE_THREADS is set: on 2 cores three runs of one thread outrun one "
        "of two threads (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        type=support.path_arg,
        metavar="DIR",
        help="folder of the run directories (default: logs/sweep_<grid>)",
    )
    p.add_argument(
        "--out",
        type=support.path_arg,
        metavar="DIR",
        help="record folder (default: records/<date>_figure2_<grid>)",
    )
    p.add_argument(
        "--report",
        type=support.path_arg,
        metavar="CSV",
        help="only write table.md and figure.png from a record's runs.csv, into --out (with "
        "--report its default is the CSV's folder) (default: none: the grid is run)",
    )
    p.add_argument(
        "--device",
        type=support.check_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the evaluation is measured: cpu, cuda or cuda:K (default: %(default)s)",
    )
    return p


def main(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.report:  # the table and figure again, from a record's runs.csv
        p.refuse(p.given(argv) - {"report", "out"}, "with --report (runs.csv is the study)")
        rows = read_runs(args.report)
        out = fileio.writable_dir(
            args.out or os.path.dirname(os.path.abspath(args.report)), REPORT, by=__file__
        )
        with support.signals_held():  # (as a grid's record below)
            lines = write_report(out, rows)
        print(verdict_text(lines))
        return
    if args.first_seed >= args.seeds:  # before any folder is made: a grid of no run
        raise support.UserError(
            f"--first_seed={args.first_seed} leaves no seed below --seeds={args.seeds}"
        )
    if args.jobs > 1 and args.nproc_per_node > 1:
        raise support.UserError(
            f"--jobs={args.jobs} places runs side by side on one device: give --nproc_per_node=1"
        )
    grid = GRIDS[args.grid]
    # absolute: the trainers run in the repository, this command wherever it was started
    runs_dir = os.path.abspath(args.runs or os.path.join("logs", f"sweep_{args.grid}"))
    out = fileio.writable_dir(
        args.out or os.path.join("records", f"{time.strftime('%Y-%m-%d')}_figure2_{args.grid}"),
        ("runs.csv", "README.md", *REPORT),
        by=__file__,
    )
    seeds = range(args.first_seed, args.seeds)
    check_record(out, grid, seeds)
    fileio.writable_dir(runs_dir)
    t0 = time.time()
    try:
        done = run_grid(grid, runs_dir, seeds, args.nproc_per_node, args.jobs)
    except launch.Stopped as e:
        print(e, flush=True)
        return
    for *_, run_dir, _ in done:  # (one changed corpus: before any run is measured)
        check_corpus(run_dir)
    rows = []
    for name, seed, run_dir, command in done:
        t1 = time.perf_counter()
        rows.append(dict(name=name, seed=seed, **measure(run_dir, args.device), command=command))
        print(f"{name} seed {seed}: measured in {time.perf_counter() - t1:.1f} s", flush=True)
    check_record(out, grid, seeds)
    with support.signals_held():  # a signal waits for the last: one record, not a mix
        write_runs(out, rows)
        rows = read_runs(os.path.join(out, "runs.csv"))  # the record is what runs.csv regenerates
        lines = write_report(out, rows)
        corpus = ", ".join(sorted({r["corpus_sha256"] for r in rows}))
        pin = grid.get("corpus_sha256")
        said = f"Corpus sha256 {corpus}: " + (
            "no pin for this grid's corpus"
            if not pin
            else "the pinned corpus"
            if corpus == pin
            else f"NOT the pinned corpus ({pin})"
        )
        readme = (
            f"# Figure 2, grid `{args.grid}`\n\n    python sweep.py {shlex.join(argv)}\n    "
            f"python sweep.py --report=runs.csv   # table.md and figure.png from runs.csv\n\n"
            f"{said}\n\nVerdict: {verdict_text(lines)}\n\n![figure](figure.png)\n\n"
            f"The table: table.md. Hardware (the runs, {args.jobs} at once: each one's threads in "
            f"its train.log; the evaluation timed in this process, with the threads below):\n\n"
            f"```\n{runlog.describe_system()}\n```\n"
        )
        fileio.write_output(out, "README.md", readme.encode(), by=__file__)
    print(said, verdict_text(lines), sep="\n")
    print(f"{len(done)} runs, {time.time() - t0:.0f} s; written to {out}")


if __name__ == "__main__":
    sys.exit(support.cli(main, sys.argv[1:]))
