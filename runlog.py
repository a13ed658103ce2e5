"""The record of a run: train.log (the sources it executes, in full, the command, the commit,
the machine, the settings, then every line the job prints), metrics.jsonl (one JSON record a
step, validation, checkpoint and warm-up) and config.json (the settings, the provenance), all
written on rank 0 only (docs/run-record.md); and the clock: train_time and step_avg leave out
warm-up steps and steps that compiled (StepClock).

Guarantees: a resume keeps the metrics its checkpoint saw, each step once, and every line of
the user's; metrics.jsonl is read within MAX_METRICS_BYTES, before anything is rewritten."""

import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from fileio import MAX_RECORD_BYTES, named, regular, sha256_of, write_atomically
from support import HERE, RunStopped, UserError, fmt_list, one_line, os_error_text, out_of_memory

LOGS = ("train.log", "metrics.jsonl", "config.json")  # a run directory's record (RunLog)


def ours(m) -> bool:
    """Whether a metrics.jsonl line's object is a record of ours (RECORD_KINDS, a whole-number
    step), not a user's note."""
    return isinstance(m, dict) and m.get("kind") in RECORD_KINDS and type(m.get("step")) is int


def run_records(run_dir: str, kind: str) -> list:
    """The run's metrics.jsonl records of kind (ours), in order; other lines, a user's notes,
    skipped. No records ([]) without the file (expand.py's new run); one that cannot be read (a
    permission, not a regular file) is its OSError: its records are not known to be none."""
    out = []
    path = os.path.join(run_dir, LOGS[1])
    with contextlib.suppress(FileNotFoundError), open(regular(path), "rb") as f:
        for line in f:
            m = None  # a line that does not parse: a user's
            with contextlib.suppress(ValueError, RecursionError):  # (too deep: a user's too)
                m = json.loads(line)
            if ours(m) and m["kind"] == kind:
                out.append(m)
    return out


def complete(run_dir: str) -> bool:
    """Whether the run validated at its last step (its final validation is recorded)."""
    vals = run_records(run_dir, "val")
    config = json_object(os.path.join(run_dir, "config.json"))
    return bool(vals) and vals[-1]["step"] == config.get("num_steps")


def json_object(path: str) -> dict:
    """The JSON object in path, a run's small record (config.json, expand.json); {} where there is
    none: not a regular file, over MAX_RECORD_BYTES, not JSON, not an object."""
    with (
        contextlib.suppress(OSError, ValueError, RecursionError),
        open(regular(path), "rb") as f,
    ):
        data = f.read(MAX_RECORD_BYTES + 1)
        if len(data) <= MAX_RECORD_BYTES:
            obj = json.loads(data.decode("utf-8-sig"))  # (a BOM: an editor's, kept)
            return obj if isinstance(obj, dict) else {}
    return {}


# what a run executes: each one's sha256 in config.json and train.log, and its text in train.log
SOURCES = (
    "train_gpt.py",
    "routers.py",
    "sources.py",
    "runs.py",
    "support.py",
    "fileio.py",
    "hub.py",
    "ranks.py",
    "runlog.py",
    os.path.join("data", "shards.py"),
)


def provenance() -> dict:
    """The git commit, whether the tree differs, and the sha256 of each source a run executes."""

    def git(*args):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=20)
            return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain")) if commit else None
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        **{f"sha256 {name}": sha256_of(os.path.join(HERE, name)) for name in SOURCES},
    }


def describe_system() -> str:
    lines = [
        f"python {sys.version.split()[0]}  torch {torch.__version__}  "
        f"cuda {torch.version.cuda}  numpy {np.__version__}",
        f"platform {platform.platform()}  cpus {os.cpu_count()}  threads {torch.get_num_threads()}",
    ]
    if torch.cuda.is_available():
        lines.append(f"gpu {torch.cuda.get_device_name()} x {torch.cuda.device_count()}")
        with contextlib.suppress(Exception):
            lines.append(
                subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
            )
    return "\n".join(lines)


def clock(train_ms: float, timed_steps: int) -> str:
    """The timing fields of the trainer's train and validation lines: the same in both."""
    avg = f"{train_ms / timed_steps:.2f}ms" if timed_steps else "-"
    return f"train_time:{train_ms:.0f}ms step_avg:{avg}"


RECORD_KINDS = ("train", "val", "checkpoint", "warmup")  # what RunLog.record writes
MAX_METRICS_BYTES = 1 << 30  # a resume reads metrics.jsonl whole: a run's is ~1 kB a step


def check_metrics(path: str):
    """metrics.jsonl within MAX_METRICS_BYTES, which a resume reads (kept_metrics)."""
    if os.path.isfile(path) and os.path.getsize(path) > MAX_METRICS_BYTES:
        raise UserError(
            f"{path} is over {MAX_METRICS_BYTES >> 30} GiB, more than a run's metrics: not "
            f"this run's to rewrite (move it away to resume; nothing was written)"
        )


def kept_metrics(path: str, resumed_at: int, val_done: int) -> bytes:
    """metrics.jsonl as a job resumed at step resumed_at rewrites it: our records past what the
    checkpoint saw are dropped, and one that a crash cut short (no newline); a line of the
    user's stays, ended by a newline; then one checkpoint record of the step, unless there is."""
    check_metrics(path)
    kept = []
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        for line in f:
            try:
                m = json.loads(line)
                seen = min(resumed_at, val_done) if m["kind"] == "val" else resumed_at
                gone = ours(m) and m["step"] > seen  # (a user's line stays)
            except (ValueError, KeyError, TypeError, RecursionError):
                gone = line.startswith(b'{"kind": ') and not line.endswith(b"\n")
            if not gone:
                kept.append(line.rstrip(b"\n") + b"\n")
    record = json.dumps({"kind": "checkpoint", "step": resumed_at}).encode() + b"\n"
    if record not in kept:
        kept.append(record)
    return b"".join(kept)


def validation_lines(router, v: dict, head: str, tail: str, step: int = None) -> list:
    """evaluate's result as the log shows it: head + the line + tail, then per-layer lines; at a
    training step, the router's state too (none where the model was only evaluated)."""
    return [
        f"{head}val_loss:{v['val_loss']:.4f} (SE {v['val_se'] or math.nan:.4f} over "
        f"{v['val_docs']} docs) sparsity:{v['sparsity']:.4f} fwd_flops/token:"
        f"{v['fwd_flops_per_token']:.4g} dense:{v['fwd_flops_per_token_dense']:.4g}{tail}",
        "  " + " ".join(f"{k}:{fmt_list(v[k])}" for k in ("block_active", "mlp_active")),
        *router.log_lines(v),
        *(router.state_lines(step) if step is not None else []),
        f"  resid_norm:{fmt_list(v['resid_norm'])}",
    ]


class RunLog:
    """train.log, config.json and metrics.jsonl (rank 0 only). Each job appends to train.log the
    sources it runs, in full; a resume keeps the metrics its checkpoint saw, each step once."""

    def __init__(
        self, run_dir: str, config: dict, active: bool, resumed_at: int = None, val_done: int = -1
    ):
        self.active, self.resumed_at = active, resumed_at
        if not active:
            return
        log, metrics, config_path = (os.path.join(run_dir, n) for n in LOGS)
        if resumed_at is not None:  # (read before anything is rewritten)
            kept = kept_metrics(metrics, resumed_at, val_done)
        write_atomically(config_path, json.dumps(config, indent=2).encode())
        with named(log):  # a write error carries no file name
            self.log = open(log, "w" if resumed_at is None else "a")
            if resumed_at is not None:
                self.log.write(f"{'=' * 100}\nresumed at step {resumed_at}\n")
                write_atomically(metrics, kept)
            for name in SOURCES:  # in full, as they ran: the trainer's first, unmarked
                with open(os.path.join(HERE, name)) as f:
                    rule = "" if name == SOURCES[0] else f"{'-' * 40} {name}\n"
                    self.log.write(rule + f.read())
            self.metrics = open(metrics, "a")
            dirty = {True: " (tree differs from the commit)", False: " (clean)", None: ""}
            sources = "".join(f"source: {n} sha256 {config[f'sha256 {n}']}\n" for n in SOURCES)
            self.log.write(
                f"{'=' * 100}\ncommand: {config['command']}\n"
                f"git: {config['git_commit'] or 'not a git checkout'}"
                f"{dirty[config['git_dirty']]}\n{sources}{describe_system()}\n"
                f"hyperparameters: {json.dumps(config)}\n{'=' * 100}\n"
            )
            self.log.flush()

    def print(self, line: str):
        if self.active:
            print(line, flush=True)
            self.write(line)

    def write(self, line: str):
        """line to train.log alone."""
        if self.active:
            with named(self.log.name):
                self.log.write(line + "\n")
                self.log.flush()

    def saved(self, step: int):
        """A checkpoint of step is on disk: said in both logs (metrics.jsonl: once per step)."""
        self.print(f"checkpoint saved at step {step}")
        if step != self.resumed_at:  # (a resumed job's step saved again, its validation done)
            self.record({"kind": "checkpoint", "step": step})

    def record(self, obj: dict):
        if self.active:
            with named(self.metrics.name):
                self.metrics.write(json.dumps(obj) + "\n")
                self.metrics.flush()

    def step(
        self,
        run,
        steps: int,
        stats: dict,
        means: tuple,
        lrs: list,
        times: tuple,
        mfu: float = None,
    ):
        """A training step's line and its record (stats: train_step's sums; means: the router's,
        made per-layer means as the blocks' shares are). times: the step's wall time and the part
        of it spent compiling (ms). A step that compiled shows its compile time, no tok/s nor
        MFU: its time is not a step's (StepClock leaves it out whole)."""
        n = stats["tokens"][0]
        step_ms, compile_ms = times
        line = (
            f"step:{run.step}/{steps} train_loss:{stats['lm_loss'][0]:.4f} "
            f"{clock(run.train_ms, run.timed_steps)}"
        )
        if compile_ms:  # a graph new to this process (compile_model; a new packed length)
            line += f" compile:{compile_ms:.0f}ms"
        else:
            line += f" tok/s:{n / step_ms * 1000:.0f}"
            if mfu is not None:
                line += f" mfu:{100 * mfu:.1f}%"
        if "redone" in stats:  # compact: a sequence outgrew a packed length (train_step)
            line += " redone:full_length"
        self.print(line)
        self.record(
            {
                "kind": "train",
                "step": run.step,
                "tokens": run.tokens,
                "train_loss": stats["lm_loss"][0],
                "total_loss": stats["total_loss"][0],
                "lr": lrs[0],
                "layer_lr": lrs[1:],
                "step_ms": step_ms,
                "compile_ms": compile_ms,
                "packed": stats["packed"],  # per layer, the most tokens of a sequence (compact)
                "redone": "redone" in stats,
                **{k: [v / n for v in stats[k]] for k in ("block_active", "mlp_active", *means)},
            }
        )

    def validation(self, router, v: dict, run, steps: int):
        """A validation's lines (validation_lines) and its record."""
        tail = f" {clock(run.train_ms, run.timed_steps)}"
        for line in validation_lines(router, v, f"step:{run.step}/{steps} ", tail, run.step):
            self.print(line)
        self.record({"kind": "val", "step": run.step, "train_time_ms": run.train_ms, **v})

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        # the error line (support.cli's, but the checkpoint the ledger names after) in train.log
        # too, if it can be written: the error itself (a full disk, say) goes on, as it was
        try:
            text = out_of_memory(error)
            if text is None and isinstance(error, (RunStopped, UserError, OSError)):
                text = os_error_text(error)
            if text is not None:
                with contextlib.suppress(OSError, ValueError):  # (ValueError: a closed log)
                    self.write(f"error: {one_line(text)}")
        finally:
            self.close()

    def close(self):
        if self.active:  # every write was flushed: a failure here would only hide the first
            for f in (self.log, self.metrics):
                with contextlib.suppress(OSError):
                    f.close()


def compile_ms() -> float:
    """This process's time in torch.compile so far, ms: Dynamo's compiles (a graph's forward,
    Inductor included) and AOTAutograd's, of a backward graph at its first backward."""
    from torch._dynamo.utils import compilation_time_metrics as times

    return 1000 * sum(
        sum(times.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl")
    )


class StepClock:
    """The clock: a job's first `untimed` steps are warm-up, logged once as such; train_time and
    step_avg count the other steps of all jobs that compiled nothing. A step that compiled (a
    packed length new to a compiled model compiles one block: compile_ms) is left out whole:
    on an H200 such steps took 0.20-0.25 s more than compile_ms and a step that compiled
    nothing (records/2026-11-28_gpu_check_NVIDIA_H200; on what, not measured). The job's total
    compile time (its steps' and its validations') and the steps left out are logged at its
    end."""

    def __init__(self, log: RunLog, start: int, untimed: int):
        self.log, self.start, self.untimed = log, start, untimed
        self.ms = 0.0  # this job's warm-up time
        self.compile_ms = 0.0  # this job's compile time
        self.left_out, self.left_out_ms = 0, 0.0  # this job's steps that compiled after warm-up
        log.print(
            f"clock: the first {untimed} steps of each job are untimed warm-up; train_time and "
            f"step_avg count the other steps of all jobs that compiled nothing"
        )

    def begin(self, d):
        """Before a timed stretch (a step, a validation): the device's queued work done."""
        d.sync()
        self.t0, self.compiled = time.perf_counter(), compile_ms()

    def lap(self, d) -> tuple:
        """-> (ms, compile ms) since begin(), the device's work included."""
        d.sync()
        return 1000 * (time.perf_counter() - self.t0), compile_ms() - self.compiled

    def add(self, run, step_ms: float, compile_ms: float):
        self.compile_ms += compile_ms
        if run.step - self.start > self.untimed:
            if compile_ms:
                self.left_out += 1
                self.left_out_ms += step_ms
            else:
                run.train_ms += step_ms
                run.timed_steps += 1
        else:
            self.ms += step_ms
            if run.step - self.start == self.untimed:
                self.report(run)

    def end(self, run):
        if 0 < run.step - self.start < self.untimed:  # the job ended inside its warm-up
            self.report(run)
        if self.compile_ms:
            self.log.print(
                f"compile: {self.compile_ms / 1000:.1f}s in this job; steps after the warm-up "
                f"that compiled, left out of train_time: {self.left_out} ({self.left_out_ms:.0f}ms)"
            )

    def report(self, run):
        self.log.print(
            f"warm-up: steps {self.start + 1}-{run.step} of this job untimed, "
            f"{self.ms:.0f}ms (compile {self.compile_ms:.0f}ms)"
        )
        self.log.record(
            {
                "kind": "warmup",
                "step": run.step,
                "steps": run.step - self.start,
                "warmup_ms": self.ms,
                "compile_ms": self.compile_ms,
            }
        )
