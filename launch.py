"""sweep.py's runs side by side: each command of a run a process of its own (under torchrun
for more than one process a run), up to --jobs at once (then each with its share of the
CPUs); a signal that reaches the sweep is passed on once to every trainer in flight, which saves
and stops; a failed command starts nothing more and is raised with its error line (run_plans).

Guarantees: no trainer is left running where a Ctrl-C no longer reaches it (Trainers: an error
here stops them as a signal would; on Linux a sweep ended by any means, SIGKILL too, sends each
a SIGTERM: ORPHAN_STOP); under torchrun a signal goes to the workers, not torchrun
(which would send them a second one that cuts their save), where /proc lists them (Linux)."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from support import HERE, SAVE_SIGNALS, SECOND, RunStopped, UserError, usable_cpus


class Stopped(Exception):
    """A signal reached the sweep; the runs in flight saved their checkpoints and stopped."""


@dataclass
class Plan:
    """One run's commands, in order (script, argv); `after`: the label of a plan to be done
    first (a DLO run's source)."""

    label: str
    steps: list
    after: str = ""
    said: str = ""  # printed once it is done


@dataclass
class Trainer:
    """A command of a plan in flight, its output files, and how many of the signals that came it
    was sent."""

    plan: Plan
    step: int
    nproc: int
    files: list
    sent: int = 0


class Trainers:
    """The trainer processes in flight, each in a session of its own, so that a Ctrl-C at the
    terminal reaches this sweep alone. Each of the trainer's saving signals that comes (and a
    SIGHUP, unless ignored as under nohup, as a SIGTERM) is passed on once to every trainer in
    flight, or started after it (under torchrun to its workers: pass_on): each saves its
    checkpoint. The handler only notes a signal and the waiting loop passes it on
    (a handler that sent could run in the middle of a start and send twice). Output goes to
    files, read once a trainer ends (a pipe could fill while others run). Left with trainers in
    flight (an error here), it stops them as a signal would and waits for them. env: the
    processes' environment (None: this one's)."""

    def __init__(self, env: dict = None):
        self.live = {}  # Popen -> Trainer
        self.got = []  # the signals that came, in order
        self.env = env

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self.note) for sig in SAVE_SIGNALS}
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (nohup's ignoring: kept)
            self.previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.hung_up)
        return self

    def __exit__(self, *exc):
        try:
            if self.live:  # not left running where no Ctrl-C reaches them
                self.got.append(signal.SIGTERM)
                while self.live:
                    self.ended()
        finally:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)

    def note(self, sig, _):
        self.got.append(sig)

    def hung_up(self, sig, _):  # the terminal closed: the trainers, in sessions of their own,
        # would train on unseen (and hold their folders from a rerun); they save and stop as
        # on a SIGTERM, which they take
        self.got.append(signal.SIGTERM)

    def pass_on(self):
        """Each signal that came, once, to each trainer in flight: under torchrun to its
        workers, which save and exit 0, torchrun then too (signalled itself, torchrun sends its
        workers a second signal, which cuts their save); to those there at the first look that
        finds any (one rank is enough: every rank stops at the step the first signalled one
        does, ranks.agreed_signal), or without /proc (not Linux) to its process group."""
        came = len(self.got)
        for proc, trainer in self.live.items():
            if trainer.sent == came:
                continue
            pids = [proc.pid] if trainer.nproc == 1 else children(proc.pid)
            if pids == []:
                continue  # (torchrun starting its workers: passed on once they are there)
            for sig in self.got[trainer.sent : came]:
                for pid in pids or [-proc.pid]:  # (a negative pid: the group)
                    with contextlib.suppress(ProcessLookupError):  # (ended since)
                        os.kill(pid, sig)
            trainer.sent = came

    def start(self, plan: Plan, step: int, nproc: int):
        """The plan's command `step`, a trainer under torchrun when nproc > 1 (expand.py: one)."""
        script, args = plan.steps[step]
        nproc = 1 if script == "expand.py" else nproc
        cmd = [sys.executable, script]
        if nproc > 1:
            cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if sys.platform.startswith("linux"):  # (elsewhere: no PR_SET_PDEATHSIG)
            cmd[1:1] = ["-c", ORPHAN_STOP, str(os.getpid())]
        files = [tempfile.TemporaryFile("w+") for _ in range(2)]
        proc = subprocess.Popen(
            cmd + args,
            cwd=HERE,
            stdout=files[0],
            stderr=files[1],
            text=True,
            start_new_session=True,
            env=self.env,
        )
        self.live[proc] = Trainer(plan, step, nproc, files)

    def ended(self) -> tuple:
        """Wait for a trainer to end, passing signals on: -> (the Trainer, its exit status,
        stdout, stderr)."""
        while True:
            self.pass_on()
            for proc in list(self.live):
                if proc.poll() is not None:
                    trainer = self.live.pop(proc)
                    return trainer, proc.returncode, *map(read_back, trainer.files)
            time.sleep(0.05)


# a trainer's start (Linux): a SIGTERM once the sweep ends, however it ends (a SIGKILL that no
# handler sees), so that it saves and stops rather than train on unseen; set before the exec,
# which keeps it (prctl's PR_SET_PDEATHSIG, 1), then the trainer's command (argv[2:]) in its place
ORPHAN_STOP = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):  # (the sweep ended before)
    sys.exit(128 + signal.SIGTERM)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def children(pid: int):
    """The pids of pid's child processes (torchrun's: its workers), from /proc; None without
    /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # (ended, or not a process)
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 1 :].split()[1]) == pid:  # (after the name: ppid)
                found.append(int(entry))
    return found


def read_back(f) -> str:
    """All that was written to the temporary file f; closed (so removed)."""
    with f:
        f.seek(0)
        return f.read()


def share_of_cpus(jobs: int) -> dict:
    """The environment of one of `jobs` processes side by side: its share of the CPUs this
    process may use (usable_cpus; at least one) for torch's threads and for Inductor's compile
    workers (by default each process takes every CPU for each: 8 runs on 16 CPUs would start
    128 workers), unless the user set them."""
    share = str(max(1, usable_cpus() // jobs))
    return {"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share, **os.environ}


# of a failed run's stderr (a traceback) that has no error line of its own, a process (under
# torchrun its report on the failed workers follows theirs: about 40 lines for two, 81 for 8)
SHOWN_LINES = 100


def run_plans(plans: list, nproc: int, jobs: int = 1):
    """Run each plan's commands in order, up to `jobs` plans at once, each command a process
    of its own (expand.py one process; a trainer under torchrun when nproc > 1), a plan after
    the one it names; more than one at once, each with its share of the CPUs (share_of_cpus). A
    signal: every trainer in flight saves its checkpoint, this waits for them, then raises
    Stopped; a second, passed on too, stops them at once. A command that fails: no other starts
    (nor a plan's next command), those in flight run to their end, then its error line is raised
    (with none, its last line, and its stderr's end printed). Rerun, the grid resumes (run_grid)."""
    todo = list(plans)  # not started
    t0 = time.monotonic()  # (each run's line says when it ended, since this call began)
    failed = []  # (error kind, message), in the order they came
    saved = []  # what each run stopped by a signal left
    with Trainers(share_of_cpus(jobs) if jobs > 1 else None) as trainers:
        while todo or trainers.live:
            if len(trainers.live) < jobs and not (trainers.got or failed):
                busy = {p.label for p in todo} | {t.plan.label for t in trainers.live.values()}
                plan = next((p for p in todo if p.after not in busy), None)
                if plan is not None:
                    todo.remove(plan)
                    if plan.steps:
                        trainers.start(plan, 0, nproc)
                    elif plan.said:
                        print(plan.said, flush=True)
                    continue
            if not trainers.live:
                break  # stopped or failed: nothing more starts
            trainer, code, out, err = trainers.ended()
            plan, step = trainer.plan, trainer.step
            script = plan.steps[step][0]
            got = trainers.got
            # obeyed: under torchrun, whose status is 1 for workers a signal stopped at once (a
            # second, or one that came as they started), 1 too once it was passed on, unless a
            # worker said an error of its own (a save that failed: a full disk, say)
            own = [ln for ln in err.splitlines() if ln.startswith("error: ") and SECOND not in ln]
            torchrun = {1} if trainer.nproc > 1 and trainer.sent and not own else set()
            if got and code in {0} | {128 + s for s in got} | {-s for s in got} | torchrun:
                # a second signal, or one while the run was starting, leaves no new checkpoint
                saved.append(
                    f"{plan.label} saved its checkpoint"
                    if code == 0 and "checkpoint: none;" not in out
                    else f"{plan.label} stopped, keeping its last checkpoint if it had one"
                )
            elif code:
                # its error line (under torchrun, each rank's comes before the launcher's own
                # lines); else (a bug's traceback, a crash) its stderr's end, shown, and its
                # last line (torchrun's: its own report, so not that)
                lines = [ln for ln in err.strip().splitlines() if ln.strip("=-")]
                tail = next((ln for ln in reversed(lines) if ln.startswith("error: ")), None)
                if tail is None and lines:
                    shown = err.rstrip().splitlines()[-SHOWN_LINES * trainer.nproc :]
                    print(
                        f"{plan.label}: {script}'s stderr ends:",
                        *shown,
                        sep="\n  ",
                        file=sys.stderr,
                    )
                    tail = (
                        "a worker failed: its stderr is above" if trainer.nproc > 1 else lines[-1]
                    )
                tail = tail or "nothing on stderr"
                kind = UserError if code == 2 and not got else RunStopped
                how = f"ended by signal {-code}" if code < 0 else f"exited {code}"
                failed.append((kind, f"{plan.label}: {script} {how}: {tail}"))
                if trainers.live:
                    print(
                        f"{failed[-1][1]}; no other run starts: waiting for the "
                        f"{len(trainers.live)} in flight",
                        flush=True,
                    )
            elif step + 1 < len(plan.steps) and not failed:  # its next command, in its place
                trainers.start(plan, step + 1, nproc)
            elif step + 1 == len(plan.steps) and plan.said:
                print(f"{plan.said} ({time.monotonic() - t0:.0f} s in)", flush=True)
    if failed:
        kind, said = failed[0]
        raise kind(said + (f" (and {len(failed) - 1} more runs failed)" if failed[1:] else ""))
    if trainers.got:
        what = "; ".join(saved) or "no run was in flight"
        raise Stopped(
            f"sweep stopped by {signal.Signals(trainers.got[0]).name}; {what}; "
            f"run the same command again to go on"
        )
