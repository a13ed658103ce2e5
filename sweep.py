"""The paper's Figure 2 in one command: dense baselines and gated models, cross-entropy against
estimated forward FLOPs per token, with the verdict as a number.

    python sweep.py --grid=cpu                      # 2 CPU cores, embedded sample, ~8 min
    python sweep.py --grid=gpu1                     # one H100, ~27 min, FineWeb
    python sweep.py --grid=paper --nproc_per_node=8 # Table 2 settings, 8 GPUs, about a day
    python sweep.py --grid=bytes --seeds=3          # byte-level study, 2 CPU cores, ~2 h
                                                    # (python data/debian_docs.py first)
    options: --seeds=K (default 1)  --runs=DIR (default logs/sweep_<grid>)
             --out=DIR (default records/<date>_figure2_<grid>)

Each configuration of the grid trains through train_gpt.py in its own run directory under
--runs, as a subprocess (under torchrun when --nproc_per_node > 1). A run that finished is
skipped and one with a checkpoint is resumed, so rerunning the command after a crash finishes
the grid without redoing finished runs. A Ctrl-C (SIGINT, SIGTERM or SIGUSR1) reaches the run
in flight once: it saves its checkpoint, and the sweep waits for it, then stops (status 0). Then, in this process, on each run's final weights:
validation cross-entropy and estimated FLOPs per token at the measured sparsity come from the
run's last validation record; evaluation tokens per second are measured here, masked and (for
gated runs) compacted, side by side. The dense frontier is cross-entropy against log FLOPs per
token, linear between neighbouring dense points; every other run is reported as its
cross-entropy minus the frontier's at its FLOPs (negative: better than dense). With --seeds=K
the difference is the mean over seeds, and it is called real only beyond twice its standard
deviation. The record folder gets table.md, results.csv, figure.png (matplotlib, a plot-only
requirement) and a README with the command, the hardware and the verdict.

Add a configuration to a grid with one line in GRIDS: (name, [train_gpt.py overrides]). Names
starting with "dense_" make the frontier. A run that starts from another (DLO) has a third
element, expand.py's arguments, with "{runs}" and "{seed}" filled in: it is expanded from a
dense run of the same grid and seed, listed before it, then trained with --resume.
"""

import csv
import io
import json
import math
import os
import statistics
import signal
import subprocess
import sys
import time
from dataclasses import replace

import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from data.shards import find_shards, read_shard  # noqa: E402

# ---------------------------------------------------------------------------- grids

def dense(L):
    return (f"dense_{L}", ["--router=none", f"--n_layers={L}"])


def gated(name, *extra):
    return (name, ["--router=skip_middle", *extra])


def dlo(rho, source, groups, anneal, tokens=None):
    """A third element: the run starts as expand.py's identity expansion of `source`, then
    trains `tokens` more (default: the grid's train_tokens)."""
    return (f"dlo_rho{rho}", ["--router=dlo", f"--dlo_rho={rho}", f"--dlo_anneal_steps={anneal}"]
            + ([f"--train_tokens={tokens}"] if tokens else []),
            ["{runs}/" + source + "_s{seed}", f"--groups={groups}", "--per_group=1", "--init=identity"])


def dlo_control(source, groups, tokens):
    """DLO's control: the same expansion of the same source, trained through the same two phases
    (fresh optimiser and warm-up) as a dense model that skips nothing."""
    name, _, expansion = dlo(0, source, groups, 0, tokens)
    return ("dlo_control", ["--router=none", f"--train_tokens={tokens}"], expansion)


def mod(capacity, L):
    return (f"mod_c{capacity}", ["--router=mod", f"--n_layers={L}", f"--mod_capacity={capacity}"])


def mor(L, routed=True):
    """Mixture-of-Recursions at the deepest applied depth n <= L that its sharing allows (N_r = 3,
    or 2 below 5 layers), or its recursive baseline (the same sharing, every token every time)."""
    r = 3 if L >= 5 else 2
    return (f"{'mor' if routed else 'recursive'}_r{r}",
            ["--router=mor", f"--n_layers={L - (L - 2) % r}", f"--mor_recursions={r}"]
            + ([] if routed else ["--mor_routed=false"]))


def figure2_runs(L, dlo_anneal_steps, tokens):
    """The paper's points for an L-layer gated model, plus our extra points: the authors' gate
    axis, the zero gate init, DLO at two skip rates, Mixture-of-Depths, and Mixture-of-Recursions
    with its recursive baseline. tokens: the grid's train_tokens. DLO trains from the same total
    budget as every other point: an L/2-layer dense source trains tokens / 2 (dlo_source_L/2, a
    point off the frontier), its expansion to L layers the other half."""
    half = tokens // 2
    return ([dense(n) for n in range(2, L + 1, 2)] +
            [gated("gated_nocontrol", f"--n_layers={L}", "--controller=none")] +
            [gated(f"gated_mu{m}", f"--n_layers={L}", f"--mu_end={m}") for m in (0.75, 0.5, 0.25, 0.0)] +
            [gated("gated_query_mu0.5", f"--n_layers={L}", "--mu_end=0.5", "--gate_axis=query"),
             gated("gated_zeroinit_mu0.5", f"--n_layers={L}", "--mu_end=0.5", "--gate_init=zero")] +
            [(f"dlo_source_{L // 2}", ["--router=none", f"--n_layers={L // 2}", f"--train_tokens={half}"])] +
            [dlo(rho, f"dlo_source_{L // 2}", L // 2, dlo_anneal_steps, half) for rho in (0.25, 0.5)] +
            [dlo_control(f"dlo_source_{L // 2}", L // 2, half)] +
            [mod(0.125, L), mor(L), mor(L, routed=False)])


BYTES_BASE = ["--train_files=data/debian_docs/docs_train_*.bin",
              "--val_files=data/debian_docs/docs_val_*.bin", "--encoding=bytes", "--vocab_size=256",
              "--dim=64", "--n_heads=4", "--n_kv_heads=4", "--max_seq_len=256", "--seq_len=256",
              "--batch_size=8", "--device_batch_size=8", "--val_every=0", "--val_tokens=262144",
              "--save_every=200", "--lr=3e-3", "--compile=false"]
GRIDS = {
    # Table 2 for every run (dense 2..12 layers, 10B tokens each). Estimated wall time on
    # 8 H100s: the 12-layer model costs 3 x 0.32 GFLOPs per token; at ~40% of 8 x 989 TFLOPs
    # that is ~3 M tokens/s, ~1 h per 10B-token run, ~18 h for the 19 runs (smaller ones faster).
    "paper": dict(base=[], n_layers=12, runs=figure2_runs(12, 500, 10_000_000_000)),
    # One H100 in ~27 min: 17 runs of ~95 s each, ~30 s of it compilation. An
    # 8-layer dim-512 model at seq 512 costs ~0.35 GFLOPs per training token; at ~150 TFLOPs
    # achieved that is ~400k tokens/s, so 24M tokens (730 steps of 32k tokens) per run.
    "gpu1": dict(base=["--dim=512", "--n_heads=8", "--n_kv_heads=8", "--max_seq_len=512",
                       "--seq_len=512", "--batch_size=64", "--device_batch_size=64",
                       "--train_tokens=24000000", "--val_every=0", "--val_tokens=1048576",
                       "--save_every=200"],
                 n_layers=8, runs=figure2_runs(8, 100, 24_000_000)),
    # The mechanics on the embedded sample, 2 CPU cores, ~8 min (15 runs): a demonstration only
    # (tiny models, 120 steps, the output head dominates the FLOPs).
    "cpu": dict(base=["--preset=smoke", "--dim=64", "--n_heads=4", "--n_kv_heads=2",
                      "--max_seq_len=64", "--seq_len=64", "--batch_size=8",
                      "--device_batch_size=8", "--train_tokens=61440", "--val_every=0",
                      "--val_tokens=4096", "--save_every=40", "--lr=3e-3"],
                n_layers=4, runs=figure2_runs(4, 40, 61440)),
    # The byte-level study (README: Results): blocks, not the 256-row head, are the compute.
    # 6 layers of width 64 on data/debian_docs.py's corpus, 1,200 steps of 8 x 256 bytes (600,
    # records/2026-11-25_figure2_bytes_cpu, left the deeper dense models undertrained); the
    # validation: 512 held-out excerpts of 512 characters, one per page.
    "bytes": dict(base=BYTES_BASE + ["--train_tokens=2457600"], n_layers=6,
                  runs=figure2_runs(6, 100, 2457600)),
}
# bytes' grid reduced to what answers the question (the paper's gate at its mu_end 0.5, DLO and its
# dense control, MoD), so that five seeds fit about two hours on 2 cores.
GRIDS["bytes_core"] = dict(GRIDS["bytes"], runs=[r for r in GRIDS["bytes"]["runs"] if r[0] in (
    "dense_2", "dense_4", "dense_6", "gated_mu0.5", "dlo_source_3", "dlo_rho0.5", "dlo_control",
    "mod_c0.125")])


# ---------------------------------------------------------------------------- running

def run_state(run_dir: str) -> str:
    """done (its final validation is recorded), resume (a checkpoint), or fresh."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            steps = json.load(f)["num_steps"]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            vals = [m for m in map(json.loads, f) if m["kind"] == "val"]
        if vals and vals[-1]["step"] == steps:
            return "done"
    except (OSError, ValueError, KeyError):
        pass
    return "resume" if os.path.exists(os.path.join(run_dir, tg.CHECKPOINT)) else "fresh"


class Stopped(Exception):
    """A signal reached the sweep; the run in flight saved its checkpoint and stopped."""


def launch(args: list, nproc: int, script: str = "train_gpt.py", label: str = ""):
    """Run script to its end. It runs in a session of its own, so that a Ctrl-C at the
    terminal reaches this sweep alone, which passes each of the trainer's saving signals on
    once (to torchrun's whole group): the run saves its checkpoint, this waits for it, then
    raises Stopped. A second signal, passed on too, stops the run at once."""
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script])
    here = os.path.dirname(os.path.abspath(__file__))
    got, proc = [], None

    def send(sig):
        proc.send_signal(sig) if nproc == 1 else os.killpg(proc.pid, sig)

    def forward(sig, _):
        got.append(sig)
        if proc is not None:
            send(sig)
    previous = {sig: signal.signal(sig, forward) for sig in support.SAVE_SIGNALS}
    try:
        proc = subprocess.Popen(cmd + args, cwd=here, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        if got:  # one that came before the trainer existed
            send(got[0])
        out, err = proc.communicate()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    label = label or " ".join(args[-1:])
    if got and proc.returncode in {0} | {128 + s for s in got} | {-s for s in got}:  # obeyed
        done = ("saved its checkpoint" if proc.returncode == 0 and "checkpoint: none;" not in out
                else "stopped, keeping its last checkpoint if it had one")  # (starting, or twice)
        raise Stopped(f"sweep stopped by {signal.Signals(got[0]).name}; {label} {done}; run "
                      f"the same command again to go on")
    if proc.returncode:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        kind = support.UserError if proc.returncode == 2 and not got else support.RunStopped
        raise kind(f"{label}: {script} exited {proc.returncode}: {tail}")


def check_settings(run_dir: str, args: list):
    """A run begun before the grid was edited (its train_tokens, say) is not taken as this
    grid's: a UserError naming the settings of args that its config.json does not hold."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # not written yet: the run starts or resumes with these settings
    given = tg.parse_overrides([a for a in args if not a.startswith("--run_dir=")])
    changed = [f"{k}={config.get(k)} there, {v} here" for k, v in given.items()
               if k not in tg.JOB and k not in ("train_files", "val_files") and config.get(k) != v]
    if changed:
        raise support.UserError(f"{run_dir} was trained with other settings ({'; '.join(changed)}):"
                                f" the grid changed since; give another --runs")


def run_grid(grid: dict, runs_dir: str, seeds: int, nproc: int) -> list:
    """Train every (configuration, seed) not finished yet. -> [(name, seed, run_dir)]."""
    done = []
    for seed in range(seeds):
        for name, overrides, *expansion in grid["runs"]:
            run_dir = os.path.join(runs_dir, f"{name}_s{seed}")
            state = run_state(run_dir)
            args = [a.format(runs=runs_dir, seed=seed) for a in overrides]
            if state != "fresh":
                check_settings(run_dir, args if expansion else grid["base"] + args + [f"--seed={seed}"])
            if state == "fresh" and expansion:  # a step-0 checkpoint, then trained as a resume
                source, *how = [a.format(runs=runs_dir, seed=seed) for a in expansion[0]]
                launch([source, run_dir, *how, *args], 1, "expand.py", label=run_dir)
            elif state == "fresh":
                launch(grid["base"] + args + [f"--seed={seed}", f"--run_dir={run_dir}"], nproc)
            if state == "resume" or state == "fresh" and expansion:
                launch([f"--resume={run_dir}"], nproc)
            print(f"{name} seed {seed}: {state if state == 'done' else 'trained'}", flush=True)
            done.append((name, seed, run_dir))
    return done


# ---------------------------------------------------------------------------- measuring

@torch.no_grad()
def eval_ms_per_token(model, idx, repeats: int = 3) -> float:
    """Median wall time of an evaluation forward pass over idx, per token, in ms."""
    cuda = idx.is_cuda
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx:
            model(idx)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times) / idx.numel()


def measure(run_dir: str, device: str) -> dict:
    """The run's final validation record, the sparsity each block reached against its
    target, and evaluation time per token on its final weights (masked, and compacted where
    blocks are gated), measured here."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        val = [m for m in map(json.loads, f) if m["kind"] == "val"][-1]
    model = tg.load_model(run_dir, device).eval()
    hp = model.hp
    can_compact = not tg.ROUTERS[hp.router].check(replace(hp, compact=True))
    compact = tg.load_model(run_dir, device, compact=True).eval() if can_compact else model
    for m in {model, compact} if device.startswith("cuda") else ():  # its blocks compiled,
        tg.compile_model(m)  # the same way on both paths measured
    tokens = read_shard(find_shards(hp.val_files)[0], hp.vocab_size)[:hp.device_batch_size * hp.seq_len]
    idx = torch.from_numpy(tokens.astype("int64")).view(-1, hp.seq_len).to(device)
    row = dict(router=hp.router, n_layers=hp.n_layers, val_loss=val["val_loss"],
               params=sum(p.numel() for n, p in model.named_parameters()  # unique, outside
                          if not n.startswith(("embed.", "head."))),  # the embedding and head
               sparsity=val["sparsity"], flops_per_token=val["fwd_flops_per_token"],
               ms_per_token_masked=eval_ms_per_token(model, idx))
    row["ms_per_token_compact"] = (eval_ms_per_token(compact, idx) if can_compact
                                   else row["ms_per_token_masked"])
    targets = model.router.zero_targets()
    if targets:  # gates with a controller: their zero share against its target
        row["gate_zero"] = [1 - a for a in val["block_active"]]
        row["target_zero"] = targets
    return row


# ---------------------------------------------------------------------------- the verdict

SLACK = 0.01  # a run up to 1% beyond the end dense point (a gated model with few zero
              # gates costs its gate linears more than the dense model) takes that point's value


def frontier(points: list):
    """points: (flops, value) of the dense runs -> f(flops): value linear in log FLOPs between
    neighbouring points, the end point's value within SLACK beyond it, else None (no
    extrapolation)."""
    pts = sorted((math.log(f), v) for f, v in points)

    def at(flops):
        x = math.log(flops)
        if pts and pts[0][0] - SLACK <= x <= pts[0][0]:
            return pts[0][1]
        if pts and pts[-1][0] <= x <= pts[-1][0] + SLACK:
            return pts[-1][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return None
    return at


def summarise(rows: list) -> list:
    """rows: measured runs (name, seed, ...) -> one line per configuration: mean values, the
    cross-entropy minus the dense frontier (mean, std over seeds) and whether it is real."""
    seeds = sorted({r["seed"] for r in rows})
    fronts, time_fronts = {}, {}
    for s in seeds:
        dense_rows = [r for r in rows if r["seed"] == s and r["name"].startswith("dense_")]
        fronts[s] = frontier([(r["flops_per_token"], r["val_loss"]) for r in dense_rows])
        time_fronts[s] = frontier([(r["flops_per_token"], r["ms_per_token_masked"])
                                   for r in dense_rows])
    out = []
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        deltas = [r["val_loss"] - f for r in mine
                  if (f := fronts[r["seed"]](r["flops_per_token"])) is not None]
        dense_ms = [t for r in mine if (t := time_fronts[r["seed"]](r["flops_per_token"]))]
        line = {"name": name, "seeds": len(mine)}
        for key in ("val_loss", "sparsity", "flops_per_token", "params", "ms_per_token_masked",
                    "ms_per_token_compact"):
            line[key] = statistics.mean(r[key] for r in mine)
        line["val_loss_std"] = statistics.stdev(r["val_loss"] for r in mine) if len(mine) > 1 else None
        line["dense_ms_at_equal_flops"] = statistics.mean(dense_ms) if dense_ms else None
        if name.startswith("dense_") or not deltas:
            line.update(delta=None, delta_std=None, verdict="frontier" if
                        name.startswith("dense_") else "outside the dense FLOPs range")
        else:
            mean = statistics.mean(deltas)
            std = statistics.stdev(deltas) if len(deltas) > 1 else None
            real = std is not None and abs(mean) > 2 * std
            line.update(delta=mean, delta_std=std, verdict=(
                ("better than dense" if mean < 0 else "worse than dense") if real else
                "no difference beyond 2 std" if std is not None else
                ("below" if mean < 0 else "above") + " the frontier (one seed: no spread)"))
        out.append(line)
    return out


def verdict_text(lines: list) -> str:
    others = [ln for ln in lines if ln["delta"] is not None]
    better = [ln["name"] for ln in others if ln["verdict"] == "better than dense"]
    below = [ln["name"] for ln in others if ln["delta"] < 0]
    text = (f"{len(others)} non-dense configurations lie within the dense FLOPs range; "
            f"{len(below)} of them below the dense frontier"
            + (f" ({', '.join(below)})" if below else "") + "; ")
    if better:
        return text + f"significantly better than dense (beyond 2 std): {', '.join(better)}."
    return text + ("none significantly better than dense (the paper's finding at its scale)."
                   if any(ln["delta_std"] is not None for ln in others) else
                   "with one seed no difference can be called real (use --seeds=3).")


# ---------------------------------------------------------------------------- the record

def fmt(v, spec=".4f"):
    return "" if v is None else format(v, spec)


def write_record(out: str, lines: list, rows: list, command: str, grid_name: str):
    keys = ["name", "seeds", "val_loss", "val_loss_std", "delta", "delta_std", "verdict", "sparsity",
            "flops_per_token", "params", "ms_per_token_masked", "ms_per_token_compact",
            "dense_ms_at_equal_flops"]
    csv_text = io.StringIO(newline="")
    w = csv.DictWriter(csv_text, keys)
    w.writeheader()
    w.writerows({k: ln[k] for k in keys} for ln in lines)
    support.write_atomically(os.path.join(out, "results.csv"), csv_text.getvalue().encode())
    table = ["| run | seeds | val CE | CE - dense frontier | std | verdict | sparsity | "
             "fwd MFLOPs/token | unique params, no embedding or head (M) | eval ms/1k tok "
             "masked | compact | dense at equal FLOPs |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        table.append(f"| {ln['name']} | {ln['seeds']} | {ln['val_loss']:.4f}"
                     f"{' ± ' + fmt(ln['val_loss_std']) if ln['val_loss_std'] is not None else ''} | "
                     f"{fmt(ln['delta'], '+.4f')} | {fmt(ln['delta_std'])} | {ln['verdict']} | "
                     f"{ln['sparsity']:.3f} | {ln['flops_per_token'] / 1e6:.3f} | "
                     f"{ln['params'] / 1e6:.3f} | "
                     f"{1e3 * ln['ms_per_token_masked']:.2f} | "
                     f"{1e3 * ln['ms_per_token_compact']:.2f} | "
                     f"{fmt(ln['dense_ms_at_equal_flops'] and 1e3 * ln['dense_ms_at_equal_flops'], '.2f')} |")
    per_block = ["| run | seed | zero share per block (measured) | target |", "|---|---|---|---|"]
    for r in rows:
        if "gate_zero" in r:
            per_block.append(f"| {r['name']} | {r['seed']} | "
                             f"{' '.join(f'{z:.2f}' for z in r['gate_zero'])} | "
                             f"{' '.join('none' if z is None else f'{z:.2f}' for z in r['target_zero'])} |")
    support.write_atomically(os.path.join(out, "table.md"),
                             ("\n".join(table) + "\n\n" + "\n".join(per_block) + "\n").encode())
    figure = plot(out, lines)
    readme = (f"# Figure 2, grid `{grid_name}`\n\n    {command}\n\nVerdict: {verdict_text(lines)}\n\n"
              + ("![figure](figure.png)\n\n" if figure else "(no figure: matplotlib is not "
                 "installed)\n\n")
              + "\n".join(table) + "\n\nPer gated block, the share of validation tokens with "
              "g = 0 against the controller's target (1 - mu*):\n\n" + "\n".join(per_block)
              + f"\n\nHardware:\n\n```\n{support.describe_system()}\n```\n")
    support.write_atomically(os.path.join(out, "README.md"), readme.encode())


def plot(out: str, lines: list) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # no text beside the points (it would overlap): each configuration has its own colour and
    # its kind's marker, named once in a legend beside the panels; error bars: the std over seeds
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    markers = (("dense_", "o"), ("gated", "s"), ("dlo", "^"), ("mod", "D"), ("mor", "v"), ("recursive", "P"))
    colours = plt.get_cmap("tab20").colors
    for ax, xkey, xlabel in zip(axes, ("flops_per_token", "sparsity", "ms_per_token_compact"),
                                ("estimated forward FLOPs per token (at measured sparsity)",
                                 "sparsity: share of (token, block) MLP calls skipped",
                                 "measured eval time per 1k tokens, ms (compact where possible)")):
        scale = 1e3 if xkey.startswith("ms") else 1
        dense = sorted((ln[xkey] * scale, ln["val_loss"]) for ln in lines if ln["name"].startswith("dense_"))
        if dense and xkey != "sparsity":  # (dense models skip nothing)
            ax.plot(*zip(*dense), "-", color="grey", label="dense frontier")
        for i, ln in enumerate(lines):
            marker = next((m for kind, m in markers if ln["name"].startswith(kind)), "x")
            ax.errorbar(ln[xkey] * scale, ln["val_loss"], yerr=ln.get("val_loss_std") or 0, fmt=marker,
                        color=colours[i % len(colours)], label=ln["name"], capsize=2)
        if xkey == "flops_per_token":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("validation cross-entropy")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.83, 0.5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    support.write_atomically(os.path.join(out, "figure.png"), png.getvalue())
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- main

def parser() -> support.ArgParser:
    p = support.ArgParser("python sweep.py", __doc__)
    p.add_argument("--grid", default="cpu", choices=list(GRIDS),  # read now: tests add grids
                   help="which grid of runs (default: %(default)s)")
    p.add_argument("--seeds", type=support.in_range(int, 1), default=1, metavar="K",
                   help="seeds per configuration (default: %(default)s)")
    p.add_argument("--nproc_per_node", type=support.in_range(int, 1), default=1, metavar="N",
                   help="processes per run; above 1 under torchrun (default: %(default)s)")
    p.add_argument("--runs", type=support.path_arg, metavar="DIR",
                   help="folder of the run directories (default: logs/sweep_<grid>)")
    p.add_argument("--out", type=support.path_arg, metavar="DIR",
                   help="record folder (default: records/<date>_figure2_<grid>)")
    p.add_argument("--device", type=support.check_device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the evaluation is measured: cpu, cuda or cuda:K "
                   "(default: %(default)s)")
    return p


def main(argv):
    args = parser().parse_args(argv)
    seeds, nproc = args.seeds, args.nproc_per_node
    device = args.device
    grid = GRIDS[args.grid]
    runs_dir = args.runs or os.path.join("logs", f"sweep_{args.grid}")
    out = support.writable_dir(args.out or os.path.join(
        "records", f"{time.strftime('%Y-%m-%d')}_figure2_{args.grid}"))
    support.writable_dir(runs_dir)
    t0 = time.time()
    try:
        done = run_grid(grid, runs_dir, seeds, nproc)
    except Stopped as e:
        print(e, flush=True)
        return
    rows = [{"name": name, "seed": seed, **measure(run_dir, device)} for name, seed, run_dir in done]
    lines = summarise(rows)
    command = "python sweep.py " + " ".join(argv)
    write_record(out, lines, rows, command, args.grid)
    print(verdict_text(lines))
    print(f"{len(done)} runs, {time.time() - t0:.0f} s; written to {out}")


if __name__ == "__main__":
    sys.exit(support.cli(main, sys.argv[1:]))
