"""Run management for train_gpt.py: checkpoints (what a run carries from job to job, saved and
read back checked), run directories (chosen, locked), and a job's saves and stops (the ranks:
ranks.py; the log and the clock: runlog.py; sweep.py's runs side by side: launch.py).

Guarantees: a checkpoint is written whole (a temporary file renamed over the old one) and only
when every weight and optimiser moment is finite; the one before it is kept as PREVIOUS when a
step from it trained with a finite loss, so a run stopped by a non-finite loss before any step
from the newest trained goes back to that one (last_good: only an earlier checkpoint of the same
run); a resume reads a checkpoint checked field by field and refuses another run's, one that
changed under it, a PREVIOUS that is not its run's and any of the run's files that is a link;
one job at a time holds a run directory (an flock the kernel drops however the process ends);
every rank saves and stops at the same step (ranks.agreed_signal)."""

import contextlib
import errno
import glob
import io
import os
import pickle
import re
import shlex
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields

import torch

import hub
from fileio import kind_of, need, open_mode, refuse, writable_dir, write_atomically
from ranks import Dist
from runlog import LOGS, RunLog, check_metrics, complete, json_object, provenance
from support import (
    RunStopped,
    UserError,
    check_fields,
    lock_folder,
    os_error_text,
    out_of_memory,
    setting,
)

# -----------------------------------------------------------------------------
# Checkpoints: what a run carries from job to job, saved whole and read back checked

CHECKPOINT = "checkpoint.pt"  # the run directory's newest, replaced atomically at each save

PREVIOUS = "checkpoint.prev.pt"  # the one before it, if a step from it had a finite loss

RUN_ID = "[0-9a-f]+"  # a run's id (os.urandom(8).hex()): it names its checkpoint's temporary file


@dataclass
class RunState:
    """What a run carries from step to step and from job to job; all of it is checkpointed.
    A checkpoint's values are checked against each field's range, like the settings'."""

    run_id: str = setting("", help="names the run in config.json and its checkpoints")
    step: int = setting(0, "[0, inf)", "optimiser steps done: the lr schedule is a function of it")
    tokens: int = setting(0, "[0, inf)", "training tokens seen")
    train_ms: float = setting(0.0, "[0, inf)", "wall time of every job's timed steps (StepClock)")
    timed_steps: int = setting(0, "[0, inf)", "at most step, as bad_steps and val_done")
    bad_steps: int = setting(0, "[0, inf)", "non-finite losses skipped")
    val_done: int = setting(-1, "[-1, inf)", "the last step whose validation is recorded")


# a checkpoint: the RunState's fields, then what a job needs to go on exactly where one stopped
CHECKPOINT_KEYS = tuple(f.name for f in fields(RunState)) + (
    "hp",
    "world_size",
    "model",
    "optimizer",
    "routing",
    "loader",
    "rng",
)


def save_checkpoint(run_dir: str, state: dict, keep: bool = False):
    """torch.save to RUN_DIR/checkpoint.pt (write_atomically), keep: the old one as PREVIOUS too
    (a hard link to it, or where the file system has none a copy, if there is room)."""
    path, prev = (os.path.join(run_dir, n) for n in (CHECKPOINT, PREVIOUS))
    buf = io.BytesIO()
    torch.save(state, buf)
    if keep:  # the old file stays under both names until the rename below
        with contextlib.suppress(OSError):  # (none: a first keep)
            os.remove(prev)
        try:
            os.link(path, prev)
        except FileNotFoundError:  # a first save has none to keep
            pass
        except OSError:  # no hard links here: a copy, streamed; none if it fails (a full disk:
            # the new checkpoint comes first), as where there is none to keep
            with contextlib.suppress(OSError), open(path, "rb") as f:
                write_atomically(prev, f, tag=state["run_id"], mode=open_mode(path))
    write_atomically(path, buf.getvalue(), tag=state["run_id"])


def read_checkpoint(run_dir: str, keys: tuple, check) -> dict:
    """RUN_DIR/checkpoint.pt if it loads, holds keys and passes check(state) (a UserError for
    malformed records); state["mtime"] is the file's."""
    path = os.path.join(need(run_dir, "a folder"), CHECKPOINT)
    if not os.path.isfile(path):
        model = os.path.lexists(os.path.join(run_dir, hub.WEIGHTS))  # (an export, say)
        raise UserError(
            f"{run_dir}: no checkpoint ({CHECKPOINT}) in it"
            + (f" ({path} is {kind_of(path)})" if os.path.lexists(path) else "")
            + (f"; it holds a model ({hub.WEIGHTS}), not a run" if model else "")
        )
    try:
        mtime = os.stat(path).st_mtime_ns
        state = load_tensors(path)
        missing = [k for k in keys if k not in state]
        if not missing:
            check(state)
    except UserError as e:
        raise UserError(f"{path}: {e} (an edited or damaged checkpoint)") from None
    except OSError as e:  # (not the file's fault: a permission, say)
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # truncated, overwritten, or from an incompatible version
        if out_of_memory(e):  # (the machine's, not the file's: support.cli says so)
            raise
        raise UserError(
            f"{path}: corrupt or incompatible checkpoint ({type(e).__name__})"
        ) from None
    if missing:
        raise UserError(
            f"{path}: checkpoint lacks {', '.join(missing)} (written by an older "
            f"version of train_gpt.py?)"
        )
    return {**state, "mtime": mtime}


def load_tensors(path: str, mmap: bool = False):
    """torch.load(path) on the CPU, weights only, any sparse tensor's indices checked (an edited
    file's could point past its memory; torch 2.15 checks them anyway, and warns that it does: a
    refusal then took three lines, so that note alone is dropped)."""
    with torch.sparse.check_sparse_tensor_invariants(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Validating sparse tensor invariants")
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


# what torch.load raises on a truncated, damaged or foreign file (tried: all but the last four)
UNREADABLE = (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError)
UNREADABLE += (KeyError, TypeError, AttributeError, IndexError)


def saved_step(path: str, run_id: str):
    """The step of the checkpoint at path if it is a regular file (a link, pipe or device is
    never opened) of run `run_id` that loads; else None."""
    if kind_of(path) != "a file":
        return None
    try:
        state = load_tensors(path, mmap=True)
    except UNREADABLE as e:  # truncated, damaged, or not a checkpoint
        if out_of_memory(e):  # (the machine's: not known to be unreadable)
            raise
        return None
    if not isinstance(state, dict) or state.get("run_id") != run_id:
        return None
    step = state.get("step")
    return step if type(step) is int else None


def checkpoint_state(run: RunState, hp, world: int, raw, opt, loader: dict, validated=None):
    """Everything a job needs to go on exactly where this one is (CHECKPOINT_KEYS); loader: its
    position (DistributedLoader.state), the global batch's; validated: the record of the shards
    its validations read (DistributedLoader.fingerprints), which a resume checks (none: a run
    that expand.py begins)."""
    return {
        **asdict(run),
        "hp": asdict(hp),
        "world_size": world,
        "model": raw.state_dict(),
        "optimizer": opt.state_dict(),
        "routing": raw.router.routing_state(),
        "packing": {"lengths": raw.router.lengths, "seen": raw.router.seen},  # compact's redo
        "loader": loader,
        "validation": validated or {},
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if next(raw.parameters()).is_cuda else [],
        },
    }


def check_run_state(run: RunState):
    """Values a run can reach: an edited checkpoint may hold others (a UserError)."""
    check_fields(run)
    if not re.fullmatch(RUN_ID, run.run_id):  # it names files (save_checkpoint)
        raise UserError(f"run_id={run.run_id!r} is not a run's (hex digits)")
    for name in ("timed_steps", "bad_steps", "val_done"):
        if getattr(run, name) > run.step:
            raise UserError(f"{name}={getattr(run, name)} exceeds step={run.step}")


FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what a weight may be


def check_weights(own: dict, weights: dict, path: str, label=str):
    """The one fit check, before any copy: the tensors a model's settings make (own: its
    state_dict, on the meta device if need be), by name and shape, none more (the first misfit
    named, label(name) as its file names it); then their values: floating point, finite."""
    if not isinstance(weights, dict):
        raise UserError(f"{path}: the weights are not a table of named tensors (damaged?)")
    misfits = (
        [f"{label(k)} is missing" for k in own if k not in weights]
        + [f"{label(k)} has no place in this model" for k in weights if k not in own]
        + [
            f"{label(k)} is not a tensor"
            for k in own
            if k in weights and not torch.is_tensor(weights[k])
        ]
        + [
            f"{label(k)} is {tuple(weights[k].shape)}, the settings make {tuple(own[k].shape)}"
            for k in own
            if torch.is_tensor(weights.get(k)) and weights[k].shape != own[k].shape
        ]
    )
    if misfits:
        more = f" (and {len(misfits) - 1} more)" if misfits[1:] else ""
        raise UserError(f"{path}: the weights do not fit the settings ({misfits[0]}{more})")
    for k, t in weights.items():
        if own[k].is_floating_point() and (t.layout != torch.strided or t.dtype not in FLOATS):
            raise UserError(
                f"{path}: {label(k)} is {t.dtype} ({t.layout}); a weight is one of "
                f"{', '.join(map(str, FLOATS))}, dense"
            )
        if t.is_floating_point() and not bool(t.to(own[k].dtype).isfinite().all()):  # (as kept)
            raise UserError(
                f"{path}: {label(k)} holds NaN or Inf (edited or damaged: no run saves one)"
            )


def restore(ckpt: dict, job, raw, opt, loader, cuda: bool) -> RunState:
    """Weights, optimiser, routing, data position, random state, packed lengths (compact) and
    clock from a checkpoint; an edited or damaged one is a UserError."""
    where = os.path.join(job.run_dir, CHECKPOINT)
    check_weights(raw.state_dict(), ckpt["model"], where)
    ours = [dict(group) for group in opt.param_groups]  # (load_state_dict takes the file's)
    try:
        raw.load_state_dict(ckpt["model"])  # (strict; floating dtypes convert)
        opt.load_state_dict(ckpt["optimizer"])
        raw.router.load_routing_state(ckpt["routing"])
        torch.set_rng_state(ckpt["rng"]["cpu"])
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"] if cuda else [])  # ([]: none is set)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        if out_of_memory(e):  # (the AdamW moments moved to a full GPU: not the file's fault)
            raise
        raise UserError(
            f"{where}: corrupt or incompatible checkpoint ({type(e).__name__})"
        ) from None
    check_moments(raw, opt, where)
    check_switches(opt, ours, where)
    routing = [
        t
        for v in raw.router.routing_state().values()  # tensors, or dicts of them
        for t in (v.values() if isinstance(v, dict) else [v])
    ]
    if not (all_finite(raw, opt) and all(t.isfinite().all() for t in routing)):  # never saved so
        raise UserError(
            f"{where}: non-finite weights, optimiser or controller state (an edited "
            f"or damaged checkpoint)"
        )
    loader.restore(ckpt["loader"])
    if raw.router.packs():
        raw.router.restore_packing(ckpt, where)
    return RunState(**{f.name: ckpt[f.name] for f in fields(RunState)})


# -----------------------------------------------------------------------------
# Run directories: chosen, locked, and a run that never saved moved aside


def new_run_dir(name: str) -> str:
    """A fresh logs/<date_time>_<name>_<6 hex>/ (never shared: mkdir refuses an existing one)."""
    while True:  # a taken name (the same second, the same 6 hex digits) draws another
        stamp = time.strftime("%Y-%m-%d_%H%M%S")
        path = os.path.join("logs", f"{stamp}_{name}_{os.urandom(3).hex()}")
        try:
            os.makedirs(path)
        except OSError as e:
            if e.errno != errno.EEXIST:
                refuse(e, path, "create")
            continue
        return path


def lock_run_dir(run_dir: str, make: bool = True):
    """support.lock_folder on RUN_DIR (made first if make): one job at a time."""
    if make:
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            refuse(e, run_dir, "use run_dir")
    lock_folder(run_dir)


def open_run_dir(run_dir: str, name: str, ckpt: dict = None) -> str:
    """Choose (default: a new one) and lock the run directory. Resuming (ckpt: read_checkpoint's),
    the checkpoint must be the one read and of this folder's run; a new run where an unfinished
    one left no checkpoint starts afresh, its files kept in aborted_<k>/ (check_new_run_dir)."""
    writable_dir(run_dir or "logs")  # before anything is written, folders included
    run_dir = run_dir or new_run_dir(name)
    for path in (os.path.join(run_dir, n) for n in LOGS + (CHECKPOINT, PREVIOUS)):
        if os.path.lexists(path) and kind_of(path) != "a file":  # ours are files, never links
            raise UserError(
                f"{path} is {kind_of(path)}, not a file: move it, or give another folder"
            )
    path, resuming = os.path.join(run_dir, CHECKPOINT), ckpt is not None
    lock_run_dir(run_dir, make=not resuming)  # first: what is checked below cannot change under it
    old = [] if resuming else check_new_run_dir(run_dir)
    if resuming and (os.stat(path).st_mtime_ns if os.path.exists(path) else None) != ckpt["mtime"]:
        raise UserError(
            f"{path} changed while this job started (another job was using the run); resume again"
        )
    if resuming:
        check_owner(run_dir, ckpt)
        check_previous(run_dir, ckpt)
        check_metrics(os.path.join(run_dir, LOGS[1]))  # (before anything is written)
    # a save killed half-way (SIGKILL) left its temporary file, named by its run's id
    # (save_checkpoint): the resumed run's, or the one that never saved, whose logs go aside
    owner = ckpt["run_id"] if resuming else logged(run_dir)  # (a new run: None, or checked above)
    if isinstance(owner, str) and re.fullmatch(RUN_ID, owner):  # (config.json: edited?)
        for saved in (CHECKPOINT, PREVIOUS):  # (PREVIOUS: a copy, where there are no links)
            cut = f"{saved}.{owner}.????????.tmp"  # (mkstemp's 8 random characters)
            for stale in glob.glob(os.path.join(glob.escape(run_dir), cut)):
                if os.path.isfile(stale):
                    os.remove(stale)
    if old:
        k = 1
        while os.path.lexists(aside := os.path.join(run_dir, f"aborted_{k}")):  # (a link: taken)
            k += 1
        move_aside(run_dir, old, aside)
        print(f"{run_dir} held a run with no checkpoint; its files are in {aside}", file=sys.stderr)
    return run_dir


def move_aside(run_dir: str, names: list, aside: str):
    """RUN_DIR's files `names` moved into the new folder aside, all of them or none: where one
    cannot move, those moved go back and the folder goes (one attempt's logs stay in one place),
    and a UserError names it (and any that could not go back); a full disk stays one (refuse)."""
    try:
        os.makedirs(aside)
    except OSError as e:
        refuse(e, aside, "create")
    moved = []
    try:
        for n in names:
            os.replace(os.path.join(run_dir, n), os.path.join(aside, n))
            moved.append(n)
    except OSError as e:
        for n in moved:
            with contextlib.suppress(OSError):
                os.replace(os.path.join(aside, n), os.path.join(run_dir, n))
        left = os.listdir(aside)  # (made above: empty, unless one could not go back)
        if not left:
            os.rmdir(aside)
        raise UserError(
            f"cannot move the earlier attempt's logs aside ({os_error_text(e)})"
            + (f"; {', '.join(sorted(left))} left in {aside}" if left else "")
            + ": move them yourself, or give another folder"
        ) from None


def check_new_run_dir(run_dir: str) -> list:
    """A new run's folder RUN_DIR as open_run_dir takes it, read only (sweep.py checks its grid's
    before any run starts): a checkpoint there is refused, and the logs there (LOGS, returned)
    are moved aside only as those of an unfinished run of ours (its config.json, written first,
    has its run_id and job); a model folder, a complete run, or anyone else's config.json or
    logs, is refused, nothing moved."""
    held = [n for n in (CHECKPOINT, PREVIOUS) if os.path.lexists(os.path.join(run_dir, n))]
    if held == [PREVIOUS] and complete(run_dir):  # (resumed from it, it would be rewound)
        held = []  # (refused below, as complete)
    if held:
        raise UserError(
            f"{run_dir} already holds a run that saved a checkpoint ({held[0]}); "
            f"choose another directory, or continue it with train_gpt.py --resume="
            f"{shlex.quote(run_dir)}"
            + (f" once {PREVIOUS} is renamed {CHECKPOINT}" if held == [PREVIOUS] else "")
        )
    old = [n for n in LOGS if os.path.exists(os.path.join(run_dir, n))]
    if os.path.lexists(os.path.join(run_dir, hub.WEIGHTS)):
        raise UserError(
            f"{run_dir} holds a model ({hub.WEIGHTS}), not a run: give another run_dir "
            f"(nothing was moved)"
        )
    if old and not (isinstance(logged(run_dir), str) and isinstance(logged(run_dir, "job"), dict)):
        why = (
            f"its {LOGS[2]} lacks a run's run_id and job"
            if LOGS[2] in old
            else f"no {LOGS[2]}, which a run writes first"
        )
        raise UserError(
            f"{run_dir} holds {', '.join(old)}, not a run's of this project ({why}): not one to "
            f"take over; give another run_dir (nothing was moved)"
        )
    if complete(run_dir):  # (its checkpoint removed, or a record's folder: a result)
        raise UserError(
            f"{run_dir} holds a complete run (validated at its last step) and no checkpoint of "
            f"that step: not one to start again; give another run_dir (nothing was moved)"
        )
    return old


def check_owner(run_dir: str, ckpt: dict):
    """A checkpoint read from a run folder is this folder's run's: the run_id its config.json
    records (a resume would cut another run's logs and overwrite a config.json that is not a
    run's; export, expand would describe it by them); no config.json and no metrics: expand.py's
    new run, whose first job this is."""
    path, run_id = os.path.join(run_dir, CHECKPOINT), logged(run_dir)
    config = os.path.join(run_dir, "config.json")
    logs = (config, os.path.join(run_dir, "metrics.jsonl"))
    if run_id is None and any(os.path.lexists(p) for p in logs):
        raise UserError(
            f"{config} is missing, unreadable or not a run's (no run_id), so nothing says "
            f"that {path} (run_id {ckpt['run_id']}) is this folder's run: put the run's back"
        )
    if run_id is not None and run_id != ckpt["run_id"]:
        raise UserError(
            f"{path} belongs to another run (run_id {ckpt['run_id']}; config.json says "
            f"{run_id}): use the folder of the run it came from"
        )


def check_previous(run_dir: str, ckpt: dict):
    """PREVIOUS, which a resume's next save replaces, is an earlier checkpoint of ckpt's run."""
    path, prev = os.path.join(run_dir, CHECKPOINT), os.path.join(run_dir, PREVIOUS)
    cut = os.path.isfile(path) and os.path.exists(prev) and os.path.samefile(prev, path)
    if os.path.lexists(prev) and not cut:  # (cut: a save stopped after its link, the same file)
        step = saved_step(prev, ckpt["run_id"])
        if step is None or step > ckpt["step"]:
            raise UserError(
                f"{prev} is not an earlier checkpoint of this run, and the next save would "
                f"replace it: move it"
            )


def logged(run_dir: str, key: str = "run_id"):
    """What RUN_DIR/config.json records under key, or None (none read: runlog.json_object)."""
    return json_object(os.path.join(run_dir, LOGS[2])).get(key)


# -----------------------------------------------------------------------------
# A job's saves and stops, agreed by every rank


def check_moments(model, opt, where: str):
    """Each parameter's AdamW state, where it has one (a parameter that never had a gradient has
    none), as a step reads it: a step count of at least 0 and two dense floating moments of its
    shape, the second (of squares) at least 0 everywhere.
    load_state_dict checks none of it; the fused step read a moment of another shape out of
    bounds (a crash, after the run's files were written)."""
    for name, p in model.named_parameters():
        state = opt.state.get(p)
        if not state:
            continue
        moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
        step = state.get("step")
        if not (
            set(state) == {"step", "exp_avg", "exp_avg_sq"}
            and all(torch.is_tensor(m) and m.is_floating_point() for m in moments)
            and all(m.shape == p.shape and m.layout == torch.strided for m in moments)
            and not bool((moments[1] < 0).any())  # (a step takes its square root; NaN: later)
            and torch.is_tensor(step)
            and step.numel() == 1
            and not float(step) < 0
        ):
            raise UserError(
                f"{where}: the optimiser's state of {name} is not AdamW's for that parameter "
                f"(an edited or damaged checkpoint)"
            )


def check_switches(opt, ours: list, where: str):
    """Each loaded group's switches (its options that are bool or None: amsgrad, maximize, fused,
    ...) as in ours, the groups this trainer built, taken before load_state_dict: it takes them
    from the file (amsgrad=True crashed a step, maximize=True trained uphill). The numbers a job
    sets itself (adamw_options, lr_at)."""
    for group, mine in zip(opt.param_groups, ours, strict=True):  # (as many: load_state_dict)
        for k, v in mine.items():
            if (isinstance(v, bool) or v is None) and group.get(k, v) != v:
                raise UserError(
                    f"{where}: the optimiser's {k}={group[k]!r} is not this trainer's ({v!r}; "
                    f"an edited or damaged checkpoint)"
                )


def all_finite(model, opt) -> bool:
    """Whether every weight and every optimiser moment is finite (one host sync)."""
    tensors = [p.detach() for p in model.parameters()] + [
        v
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.is_floating_point()
    ]
    return bool(torch.stack([t.float().abs().max() for t in tensors if t.numel()]).isfinite().all())


class Ledger:
    """A training job's checkpoints, owned by its train(): the last good one, `last` ("none"
    before the run's first save), named by its stop and error lines (inside `with ledger:` an
    error's line, support.cli, names it too), and whether no step from the newest has trained
    yet (untried: a save then keeps no PREVIOUS, and last_good may put one back)."""

    def __init__(self, run_dir: str, step: int = None):
        self.run_dir, self.untried = run_dir, True
        self.saved = step is not None  # (a resume's checkpoint, of step `step`)
        self.last = self.named(step) if self.saved else "none"

    def named(self, step: int) -> str:
        return f"{os.path.join(self.run_dir, CHECKPOINT)} (step {step})"

    def save(self, step: int):
        """A checkpoint of step is written: the newest, no step from it trained yet."""
        self.saved = True
        self.untried = True
        self.last = self.named(step)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, (KeyboardInterrupt, UserError, OSError)) or out_of_memory(error):
            error.checkpoint = self.last  # (a RunStopped names it in its message)


def resume_note(d: Dist, ledger: Ledger, run: RunState) -> str:
    """A resume's note on its first line (rank 0's: the others print none): its step, and
    PREVIOUS where an earlier checkpoint of this run is kept (a stop on a non-finite loss may put
    it back: last_good)."""
    prev = saved_step(os.path.join(ledger.run_dir, PREVIOUS), run.run_id) if d.master else None
    kept = prev is not None and prev < run.step  # (a save cut after its link: the same file)
    return f" resumed_at:{run.step}" + (
        f" ({PREVIOUS}, step {prev}, kept beside it)" if kept else ""
    )


def save_run_checkpoint(d: Dist, ledger: Ledger, run: RunState, hp, raw, opt, loader, validated):
    """checkpoint_state as RUN_DIR/checkpoint.pt (rank 0) if every weight is finite; else, or
    failing, RunStopped. The old one stays as PREVIOUS if a step from it was finite (not
    ledger.untried): last_good."""
    if not all_finite(raw, opt):
        raise RunStopped(
            f"non-finite weights after step {run.step}; the checkpoint was not "
            f"replaced; last good checkpoint: {ledger.last}"
        )
    try:
        d.on_master(
            lambda: save_checkpoint(
                ledger.run_dir,
                checkpoint_state(run, hp, d.world, raw, opt, loader.state(), validated),
                keep=not ledger.untried,
            ),
            last=ledger.last,
        )
    except (UserError, OSError) as e:  # a full disk, or a folder made read-only
        raise RunStopped(
            f"cannot write the checkpoint of step {run.step} ({os_error_text(e)}); "
            f"last good checkpoint: {ledger.last}"
        ) from None
    ledger.save(run.step)


def last_good(d: Dist, ledger: Ledger, run_id: str) -> str:
    """For a stop on a non-finite loss: the newest checkpoint, or if no step from it was finite
    (an update that exploded but stayed finite, saved at its step), PREVIOUS put back: only a
    regular file of this run (run_id) at an earlier step than the newest."""
    path, prev = (os.path.join(ledger.run_dir, n) for n in (CHECKPOINT, PREVIOUS))

    def put_back():
        """PREVIOUS renamed over the newest -> its step; None, and nothing moved, when there is
        none, when it is not a file of this run older than the newest (the same file, after a
        save cut after its link, is not) or when it does not load."""
        old, new = saved_step(prev, run_id), saved_step(path, run_id)
        if old is None or new is None or old >= new:
            return None
        try:
            os.replace(prev, path)
        except OSError:
            return None
        return old

    if not ledger.untried or not ledger.saved:  # (a run that never saved has none to name)
        return ledger.last
    step = d.on_master(put_back, last=ledger.last)
    if step is None:  # the newest stays, but it is not a good one
        return (
            f"none: no step from the newest, {ledger.last}, had a finite loss, and no earlier "
            f"checkpoint of this run could be put back"
        )
    ledger.untried = False
    ledger.last = (
        f"{path} (step {step}, put back: no step from the newer {ledger.last} had a finite loss)"
    )
    return ledger.last


def open_log(d: Dist, ledger: Ledger, run: RunState, hp, job, argv, origin, resumed, **facts):
    """The job's RunLog (inactive off rank 0); config.json: the run's settings (hp), the job's,
    facts (the steps), where the weights came from (origin: --init_from's source; a resumed
    job keeps the run's first job's), the provenance and the command (argv: its arguments).
    Failing, RunStopped: the run directory exists."""
    if resumed:
        origin = logged(ledger.run_dir, "init_from")
    config = {
        **asdict(hp),
        "job": asdict(job),
        "world_size": d.world,
        **facts,
        "run_dir": ledger.run_dir,
        "device": d.device,
        "run_id": run.run_id,
        "init_from": origin,
        **provenance(),
        "command": " ".join([d.launcher, *map(shlex.quote, argv)]),
    }
    run_dir = ledger.run_dir
    resumed_at = run.step if resumed else None
    try:
        log = d.on_master(
            lambda: RunLog(run_dir, config, True, resumed_at, run.val_done),
            share=False,
            last=ledger.last,
        )
    except (UserError, OSError) as e:
        raise RunStopped(
            f"cannot write the run's logs ({os_error_text(e)}); last checkpoint: {ledger.last}"
        ) from None
    return log if d.master else RunLog(run_dir, config, active=False)


def skip_bad_step(log: RunLog, run: RunState, max_bad_steps: int, steps: int, d, ledger: Ledger):
    """A step whose loss was not finite applied no update; past max_bad_steps the run stops,
    naming its last good checkpoint (last_good)."""
    run.bad_steps += 1
    if run.bad_steps > max_bad_steps:
        raise RunStopped(
            f"non-finite loss at step {run.step}; no update was applied; last good "
            f"checkpoint: {last_good(d, ledger, run.run_id)}"
        )
    log.print(
        f"step:{run.step}/{steps} skipped: non-finite loss ({run.bad_steps} of "
        f"max_bad_steps={max_bad_steps})"
    )


def report_end(log: RunLog, d: Dist, ledger: Ledger, run: RunState, start, steps, signum, owed):
    """The job's last lines: why it stopped and how to resume (signum: the signal, 0 for
    stop_step; owed: the validation of its step is still to run), or complete; peak memory."""
    if run.step < steps or run.val_done < run.step:
        why = f"signal {signal.Signals(signum).name}" if signum else "stop_step"
        log.print(
            f"stopped by {why} at step {run.step}"
            + (" (its validation is still owed)" if owed else "")
            + f"; checkpoint: {ledger.last}; resume with: {d.launcher} "
            f"--resume={shlex.quote(ledger.run_dir)}"
        )
    elif run.step == start:
        log.print(f"the run is complete at step {run.step}")
    if d.device.startswith("cuda"):
        log.print(f"peak memory: {torch.cuda.max_memory_allocated() // 2**20} MiB")
