"""Signals: to a training job, to a command as it starts or ends, and launchers (torchrun, the
sweep) that go while their workers run."""

import contextlib
import errno
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import launch
import ranks
import runs
import support
import train_gpt as tg
from conftest import (
    AUTHORS_TINY,
    COMMANDS,
    OUT_OF_MEMORY_LINES,
    REPO,
    RESUME_RUN,
    TINY_RUN,
    read_metrics,
    run_command,
    run_main,
    signal_self,
    start_command,
    timing,
    val_steps,
    wait_for_line,
)

# ------------------------------------------------------- a signal to a training job


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])  # SIGUSR1: Slurm's warning
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
    proc = start_command(
        "train_gpt.py", *RESUME_RUN, "--train_tokens=1024000", f"--run_dir={tmp_path}", threads=1
    )
    wait_for_line(proc, "step:2/4000 train_loss")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    assert step >= 2 and f"stopped by signal {signal.Signals(signum).name} at step {step}" in out
    assert f"resume with: python train_gpt.py --resume={tmp_path}" in out
    r = run_command("train_gpt.py", f"--resume={tmp_path}", f"--stop_step={step + 1}", threads=1)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed at step {step}\n" in (tmp_path / "train.log").read_text()


def signal_during_step(monkeypatch, n):
    """A SIGTERM that arrives while training step n runs (the flag the handler sets)."""
    real = tg.train_step

    def step(*args):
        if args[-1] == n - 1:  # the 0-based step index is train_step's last argument
            tg.STOP.signum = signal.SIGTERM
        return real(*args)

    monkeypatch.setattr(tg, "train_step", step)


@pytest.mark.parametrize("n", [4, 8])  # a validation step, and the last step
def test_a_signal_never_loses_a_validation(tmp_path, monkeypatch, capsys, n):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'ref'}"], capsys)
    assert code == 0, err
    with monkeypatch.context() as m:
        signal_during_step(m, n)
        code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err
    assert f"stopped by signal SIGTERM at step {n} (its validation is still owed)" in out
    assert val_steps(tmp_path / "run") == [0, 4, 8][: n // 4]
    code, _, err = run_main([f"--resume={tmp_path / 'run'}"], capsys)
    assert code == 0, err
    ref, run = (read_metrics(tmp_path / r) for r in ("ref", "run"))

    def strip(ms):
        return [timing(m) for m in ms if m["kind"] in ("train", "val")]

    assert val_steps(tmp_path / "run") == [0, 4, 8] and strip(ref) == strip(run)
    # each save's step once, though the resumed job saved step n again with its validation
    assert [m["step"] for m in run if m["kind"] == "checkpoint"] == sorted({n, 8})

    def files():
        return {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}

    before = files()
    code, out, _ = run_main([f"--resume={tmp_path / 'run'}", "--lr=0.5"], capsys)  # nothing to do
    assert code == 0 and "the run is complete at step 8" in out
    assert files() == before  # nothing written, not even the settings given (they never ran)


def test_a_signal_that_reached_another_rank_stops_this_one_with_its_name(
    tmp_path, monkeypatch, capsys
):
    real = ranks.all_reduce

    def other_rank_signalled(t, op="sum"):  # what the MAX all-reduce gives when rank 1 got SIGTERM
        return t.fill_(signal.SIGTERM) if op == "max" and t.numel() == 1 else real(t, op)

    monkeypatch.setattr(ranks, "all_reduce", other_rank_signalled)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert code == 0 and err == "", err
    assert "stopped by signal SIGTERM at step 0" in out


def test_a_signal_during_a_validation_cuts_it_and_leaves_it_owed(tmp_path, monkeypatch, capsys):
    # SIGTERM while step 4's validation runs (its first batch of two): the ranks agree on it at
    # the next batch, the job saves with the validation owed and stops; a resume runs it first
    real, sizes = tg.to_device, []

    def to_device(batch, device):  # a step's batch: 8 sequences; a validation batch: 4
        sizes.append(batch.size(0))
        if batch.size(0) == 4 and 8 in sizes and "sent" not in sizes:
            sizes.append("sent")
            os.kill(os.getpid(), signal.SIGTERM)
        return real(batch, device)

    monkeypatch.setattr(tg, "to_device", to_device)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert code == 0 and err == "", err
    assert "stopped by signal SIGTERM at step 4 (its validation is still owed)" in out, out
    assert val_steps(tmp_path) == [0] and torch.load(tmp_path / "checkpoint.pt")["val_done"] == 0
    monkeypatch.setattr(tg, "to_device", real)
    code, out, err = run_main([f"--resume={tmp_path}"], capsys)
    assert code == 0 and val_steps(tmp_path) == [0, 4, 8], err


def test_a_first_signal_during_start_up_stops_cleanly(tmp_path, monkeypatch, capsys):
    real_setup, real_log = ranks.setup_distributed, runs.open_log

    def signalled():  # Ctrl-C while the job checks its settings: it stops at once, silently
        os.kill(os.getpid(), signal.SIGINT)
        return real_setup()

    monkeypatch.setattr(ranks, "setup_distributed", signalled)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'a'}"], capsys)
    assert (code, out, err) == (130, "", "") and not (tmp_path / "a").exists()
    monkeypatch.setattr(ranks, "setup_distributed", real_setup)

    def logged(*args, **kwargs):  # once the run directory is set up, a signal saves step 0
        os.kill(os.getpid(), signal.SIGINT)
        return real_log(*args, **kwargs)

    monkeypatch.setattr(runs, "open_log", logged)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert code == 0 and err == "", err
    assert (
        f"stopped by signal SIGINT at step 0 (its validation is still owed); checkpoint: "
        f"{tmp_path / 'checkpoint.pt'} (step 0); "
        f"resume with: python train_gpt.py --resume={tmp_path}" in out
    ), out
    monkeypatch.setattr(runs, "open_log", real_log)
    code, out, err = run_main([f"--resume={tmp_path}"], capsys)  # and that command goes on
    assert code == 0 and val_steps(tmp_path) == [0, 4, 8] and "resumed_at:0" in out, err

    def second(*args):
        raise KeyboardInterrupt  # what the handler raises on a second signal

    monkeypatch.setattr(tg, "train_step", second)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'b'}"], capsys)
    assert code == 130 and err == "error: interrupted by a second signal; last checkpoint: none\n"


def after_exit(*signums):
    """python -c code that runs train_gpt.py as a script and sends itself signums at exit."""
    return (
        f"import atexit, os, runpy, sys; sys.argv[0] = 'train_gpt.py'; "
        f"atexit.register(lambda: [os.kill(os.getpid(), s) for s in {list(map(int, signums))}]); "
        f"runpy.run_path('train_gpt.py', run_name='__main__')"
    )


def test_a_signal_after_the_final_save_leaves_status_0(tmp_path):
    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # each one, one after another
    r = run_command(
        "-c", after_exit(*signums), *RESUME_RUN, f"--run_dir={tmp_path}", threads=1, timeout=300
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 8


# --------------------------------------------- a signal as a command starts or ends


def when_mapped(proc, library):
    """Wait until the process has mapped a shared library whose path holds `library` (a point
    inside its imports), or has ended; without /proc, a moment after start-up."""
    if not os.path.exists("/proc/self/maps"):
        return time.sleep(0.3)
    while proc.poll() is None:
        try:
            if library in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:  # it ended meanwhile
            return
        time.sleep(0.001)


def test_sigint_while_the_trainer_starts_exits_quietly(tmp_path):
    proc = start_command("train_gpt.py", "--preset=smoke", f"--run_dir={tmp_path / 'r'}", threads=1)
    when_mapped(proc, "_multiarray_umath")  # torch is loading
    assert proc.poll() is None, "the trainer ended before the signal"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and err.count("\n") <= 1, err
    assert proc.returncode in (0, 130), err
    # status 0 only as a stop the signal caused (saved): a run that ignored it also ends with 0
    assert proc.returncode == 130 or "stopped by signal SIGINT" in out, out[-2000:]


def test_ctrl_c_while_a_command_loads_torch_is_quiet(tmp_path):
    # The signal lands at several points of torch's import, found in /proc/PID/maps so that a
    # faster machine does not move them: as its libraries map, and once numpy's C extension is
    # in (CI once caught one inside numpy's, which left a half-loaded module behind)
    commands = (
        ["expand.py", str(tmp_path / "a"), str(tmp_path / "b")],
        ["sample.py", str(tmp_path)],
    )
    for command, library in itertools.product(commands, ("libtorch", "_multiarray_umath")):
        proc = start_command(*command, stdout=None)
        when_mapped(proc, library)
        assert proc.poll() is None, "the command ended before the signal: no torch import?"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err, (command, library, err)


SIGNAL_HOOK = """import atexit, os, signal, sys
sig, at = getattr(signal, os.environ["HOOK_SIGNAL"]), os.environ["HOOK_AT"]
class Hook:  # the signal lands as the command first imports the module `at`
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), sig)
class Late:  # or later still, as the interpreter tears its modules down (its handlers reset)
    def __del__(self, kill=os.kill, pid=os.getpid()):
        kill(pid, sig)
if at == "exit":  # or once the command is over, during the interpreter's shutdown
    atexit.register(os.kill, os.getpid(), sig)
elif at == "teardown":
    sys.late_signal = Late()
else:
    sys.meta_path.insert(0, Hook())
"""


@pytest.mark.slow
def test_a_signal_as_a_command_loads_numpy_or_after_it_ended_prints_no_traceback(tmp_path):
    # every command, at a deterministic moment: numpy's import (before torch's, or during it),
    # the first heavy import of each; or in an atexit hook, after the command returned
    (tmp_path / "sitecustomize.py").write_text(SIGNAL_HOOK)
    for path in ("train_gpt.py", *COMMANDS):
        for sig, at, status in (
            ("SIGINT", "numpy", 130),
            ("SIGTERM", "exit", 0),
            ("SIGTERM", "teardown", 0),  # after the interpreter reset its signal handlers
            ("SIGINT", "teardown", 0),
        ):
            env = {"PYTHONPATH": str(tmp_path), "HOOK_SIGNAL": sig, "HOOK_AT": at}
            r = run_command(path, "--help", env=env, timeout=120)
            assert r.returncode == status and r.stderr == "", (
                path,
                sig,
                at,
                r.returncode,
                r.stderr,
            )
            assert (r.stdout != "") == (at != "numpy"), (path, at, r.stdout)


# -------------------------------------- launchers that go: torchrun and its workers


def process_stat(pid) -> list:
    """A process's /proc stat fields after its name (state, parent, ...), or [] if it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return []


def process_state(pid):
    """A process's state letter from /proc (Z: ended, not yet reaped), or None if it is gone."""
    return (process_stat(pid) or [None])[0]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_workers_whose_torchrun_died_of_a_signal_save_and_stop(tmp_path):
    # SIGUSR1 ends torchrun at once without passing it on: each worker finds its launcher gone at
    # the next step, and the job stops there with a checkpoint, as on any signal (no orphans)
    proc = start_command(  # (torchrun: one thread a process)
        "train_gpt.py",
        *RESUME_RUN,
        "--train_tokens=10000000",
        f"--run_dir={tmp_path}",
        nproc=2,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log, deadline = tmp_path / "train.log", time.time() + 120
    while time.time() < deadline and "step:3/" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    workers = processes_naming(f"--run_dir={tmp_path}", proc)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=60)
    while time.time() < deadline + 60 and any(process_state(w) not in (None, "Z") for w in workers):
        time.sleep(0.2)
    orphans = [w for w in workers if process_state(w) not in (None, "Z")]
    for w in orphans:  # (a failing test leaves none behind)
        os.kill(w, signal.SIGKILL)
    assert not orphans, "the workers train on as orphans"
    assert re.search(
        r"stopped by signal SIGHUP at step \d+[^;]*; checkpoint: \S+checkpoint.pt "
        r"\(step \d+\); resume with: torchrun",
        log.read_text(),
    ), log.read_text()[-2000:]


# a stand-in for torchrun: starts one worker with a worker's environment, says its pid, waits
FAKE_LAUNCHER = """import os, subprocess, sys, time
world, port, log, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": world, "OMP_NUM_THREADS": "1",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "test"}
with open(log, "w") as f:
    worker = subprocess.Popen([sys.executable, "train_gpt.py", *args], env=env, stdout=f, stderr=f)
print(worker.pid, flush=True)
time.sleep(600)
"""


def fake_launch(world: str, log, args) -> tuple:
    """FAKE_LAUNCHER started on a free port, its worker running train_gpt.py args into log
    -> (the launcher's Popen, the worker's pid)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    launcher = start_command("-c", FAKE_LAUNCHER, world, port, log, *args, stderr=None)
    return launcher, int(launcher.stdout.readline())


def kill_and_outlived(launcher, worker: int, seconds: float) -> bool:
    """Kill the launcher; whether its worker was still running `seconds` later (then killed:
    a failing test leaves none behind)."""
    launcher.kill()
    launcher.wait()
    deadline = time.time() + seconds
    while time.time() < deadline and process_state(worker) not in (None, "Z"):
        time.sleep(0.2)
    orphan = process_state(worker) not in (None, "Z")
    if orphan:
        os.kill(worker, signal.SIGKILL)
    return orphan


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_a_worker_whose_launcher_dies_at_start_up_gives_up(tmp_path):
    # the launcher dies while its worker waits for a rank that never comes (world 2), or just
    # after its worker joined (world 1): the worker knows its launcher from its start, and ends
    # (nothing written) or stops at its next step (saved), never an orphan or a wait till timeout
    for world, until in (("2", "libtorch_cpu"), ("1", "step:2/")):
        log, run = tmp_path / f"worker{world}.log", tmp_path / f"run{world}"
        args = [*RESUME_RUN, "--train_tokens=10000000", f"--run_dir={run}"]
        launcher, worker = fake_launch(world, log, args)
        deadline = time.time() + 120
        while time.time() < deadline and process_state(worker) not in (None, "Z"):
            maps = Path(f"/proc/{worker}/maps").read_text() if world == "2" else ""
            train_log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
            if until in maps or until in train_log:
                break
            time.sleep(0.1)
        time.sleep(3 if world == "2" else 0)  # (torch loaded, then into init_process_group's wait)
        orphan = kill_and_outlived(launcher, worker, 60)
        assert not orphan, f"world {world}: the worker goes on without its launcher"
        if world == "2":
            assert "error: the launcher is gone: this worker stops" in log.read_text()
            assert not run.exists()  # nothing written
        else:
            assert re.search(
                r"stopped by signal SIGHUP at step \d+[^;]*; checkpoint: \S+checkpoint.pt",
                (run / "train.log").read_text(),
            ), (run / "train.log").read_text()[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_an_evaluation_only_worker_ends_with_its_launcher(tmp_path):
    # --eval_only under a launcher (one rank) validating for about 30 s (the sample's training
    # shard, whole): the launcher killed mid-way, the worker ends within seconds, one line,
    # nothing written (before: it validated to the end as an orphan; issue 58)
    log = tmp_path / "worker.log"
    args = [f"--init_from={AUTHORS_TINY}", "--eval_only=true", "--seq_len=64"]
    args += ["--val_files=data/sample/sample_train_*.bin", f"--val_tokens={62 * 32 * 64}"]
    launcher, worker = fake_launch("1", log, args)
    time.sleep(8)  # (torch loaded, the model built, validating)
    assert process_state(worker) not in (None, "Z"), log.read_text()[-2000:]
    assert not kill_and_outlived(launcher, worker, 10), "the worker validates on without it"
    said = log.read_text()
    assert said.endswith("error: the launcher is gone: this worker stops; nothing was written\n")
    assert "val_loss" not in said and said.count("error:") == 1, said[-2000:]


def processes_naming(text: str, launcher=None) -> list:
    """The pids of the live processes whose command line holds text (from /proc); with a
    launcher's Popen, only its children that have exec'd. A fork shows its parent's command line
    till it execs: CI once counted torchrun mid-fork as a third of two workers; a worker's own
    children (bash's sleep, a forked helper) are not workers."""
    pids = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            said = (pid_dir / "cmdline").read_text()
            state, parent = (process_stat(pid_dir.name) or ["Z", 0])[:2]  # (gone: as ended)
            if text not in said or state == "Z":
                continue
            if launcher is None or (int(parent) == launcher.pid and said != launched(launcher)):
                pids.append(int(pid_dir.name))
    return pids


def launched(launcher) -> str:
    """The command line of a Popen's process as /proc holds it."""
    return "\0".join(launcher.args) + "\0"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGUSR1])
def test_workers_whose_torchrun_dies_before_they_start_give_up_at_once(tmp_path, signum):
    # torchrun killed while its workers start slowly (a second before Python does): each worker
    # starts with another parent than its launcher, so only torchrun's store, which refuses
    # it, says the launcher is gone; each ends in a few seconds with one line, nothing written
    # (before: both waited on the store for minutes, then a C++ stack dump)
    run = tmp_path / "run"
    command = f"sleep 1; exec {sys.executable} train_gpt.py {' '.join(TINY_RUN)} --run_dir={run}"
    launcher = start_command(  # torchrun --no-python bash -c COMMAND, one thread a process
        "--no-python", "bash", "-c", command, nproc=2, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 60
    while time.time() < deadline and launcher.poll() is None:
        if len(processes_naming(f"--run_dir={run}", launcher)) == 2:
            break
        time.sleep(0.05)
    assert len(processes_naming(f"--run_dir={run}", launcher)) == 2, launcher.poll()
    os.kill(launcher.pid, signum)
    try:  # (its workers hold its output till they end)
        said = launcher.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:  # (killed and reaped: left names its workers alone)
        launcher.kill()
        launcher.wait()
        said = ""
    left = processes_naming(f"--run_dir={run}")  # (the workers and anything they started)
    for pid in left:  # (a failing test leaves none behind)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlive their launcher"
    gone = "error: the launcher is gone: this worker stops; nothing was written"
    assert said.splitlines().count(gone) == 2 and "c10" not in said, said[-3000:]
    assert not run.exists()


# ---------------------------------------------------------- the sweep as a launcher


def test_ctrl_c_on_a_sweep_lets_each_run_in_flight_save_and_stop(tmp_path):
    # the sweep gets the signal (its trainers run in sessions of their own, as after a Ctrl-C
    # at a terminal) and passes it on once to each of the two in flight (--jobs=2): each
    # finishes its step and saves, and the sweep stops once both have
    dirs = [tmp_path / "a", tmp_path / "b"]
    plans = [
        launch.Plan(
            str(d), [("train_gpt.py", RESUME_RUN + ["--train_tokens=1024000", f"--run_dir={d}"])]
        )
        for d in dirs
    ]

    # run_plans has returned: no Ctrl-C then (the lock: not between the check and the kill),
    # and the thread ends with the test, so a stray one can hit no later test
    over, lock = threading.Event(), threading.Lock()

    def interrupt():
        deadline = time.time() + 120
        while (
            not over.is_set()
            and time.time() < deadline
            and not all(
                (d / "metrics.jsonl").exists() and '"step": 2' in (d / "metrics.jsonl").read_text()
                for d in dirs
            )
        ):
            time.sleep(0.05)
        with lock:
            if not over.is_set():
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        with pytest.raises(launch.Stopped, match="sweep stopped by SIGINT; ") as stopped:
            launch.run_plans(plans, 1, jobs=2)
    finally:
        with lock:
            over.set()
        thread.join()
    for d in dirs:
        assert f"{d} saved its checkpoint" in str(stopped.value)
        step = torch.load(d / "checkpoint.pt", weights_only=True)["step"]
        assert (
            step >= 2
            and f"stopped by signal SIGINT at step {step}" in (d / "train.log").read_text()
        )


def test_ctrl_c_while_a_sweep_starts_its_trainer_stops_it_quietly(tmp_path, monkeypatch):
    real = subprocess.Popen

    def interrupted_popen(*args, **kwargs):  # the Ctrl-C lands as the trainer is starting
        proc = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return proc

    monkeypatch.setattr(launch.subprocess, "Popen", interrupted_popen)
    said = "sweep stopped by SIGINT; .* stopped, keeping its last"
    with pytest.raises(launch.Stopped, match=said):
        launch.run_plans(
            [launch.Plan("run", [("train_gpt.py", RESUME_RUN + [f"--run_dir={tmp_path}"])])], 1
        )
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_trainer_that_exits_2_after_the_sweeps_signal_is_a_failed_run_not_bad_input(tmp_path):
    # status 2 is bad input only before a signal: after one, the sweep's input was good (it
    # started the run), so the run failed (RunStopped, status 1), named with its error line
    ready = tmp_path / "ready"
    refusing = tmp_path / "refusing.py"
    refusing.write_text(
        f"""import pathlib, signal, sys, time
def refuse(*_):
    print("error: refused on the signal", file=sys.stderr)
    sys.exit(2)
signal.signal(signal.SIGINT, refuse)
pathlib.Path({str(ready)!r}).touch()
time.sleep(60)
"""
    )
    over, lock = threading.Event(), threading.Lock()  # (as the Ctrl-C test above)

    def interrupt():
        deadline = time.time() + 60
        while not over.is_set() and time.time() < deadline and not ready.exists():
            time.sleep(0.01)
        with lock:
            if not over.is_set():
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    said = r"^run: .*refusing\.py exited 2: error: refused on the signal$"
    try:
        with pytest.raises(support.RunStopped, match=said):
            launch.run_plans([launch.Plan("run", [(str(refusing), [])])], 1)
    finally:
        with lock:
            over.set()
        thread.join()


def test_a_signal_any_rank_got_outranks_a_launcher_gone():
    here = ranks.Dist()  # not a torchrun worker
    orphan = ranks.Dist(parent=os.getpid())  # its launcher (this pid) is not its parent: gone
    for d, got, agreed in (
        (here, 0, 0),
        (here, signal.SIGTERM, signal.SIGTERM),
        (orphan, 0, signal.SIGHUP),
        (orphan, signal.SIGTERM, signal.SIGTERM),  # the signal a scheduler sent stays its own
        (orphan, signal.SIGINT, signal.SIGINT),
    ):
        assert ranks.agreed_signal(types.SimpleNamespace(signum=got), d) == agreed


def test_the_watch_ends_a_worker_whose_launcher_is_gone_only_while_it_watches(monkeypatch):
    exited, gone = threading.Event(), [False]
    monkeypatch.setattr(ranks, "gone", lambda d: gone[0])
    monkeypatch.setattr(ranks.os, "_exit", lambda code: exited.set())
    with ranks.watching(ranks.Dist(parent=1)):
        time.sleep(0.7)
        assert not exited.is_set()  # the launcher is there
        gone[0] = True
        assert exited.wait(3)  # polled every 0.5 s
    exited.clear()
    time.sleep(1.2)
    assert not exited.is_set()  # the watch ended with the block


def test_stop_records_a_first_signal_once_armed_and_a_second_stops_at_once():
    stop = support.StopSignal()
    handlers = {s: signal.getsignal(s) for s in support.SAVE_SIGNALS}
    try:
        with stop:
            with pytest.raises(support.Interrupted):  # not armed: at once
                stop(signal.SIGTERM, None)
            stop.armed = True
            with stop:  # re-entered (train() inside main())
                assert stop.armed and stop.signum == 0
            assert all(signal.getsignal(s) is stop for s in support.SAVE_SIGNALS)  # still held
            stop(signal.SIGTERM, None)
            assert stop.signum == signal.SIGTERM
            with pytest.raises(support.Interrupted) as second:
                stop(signal.SIGINT, None)
            assert second.value.signum == signal.SIGINT
            stop.finish()
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in support.SAVE_SIGNALS)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def test_a_cleanup_runs_to_its_end_through_signals_then_the_first_stops_the_command():
    # signals_held: a signal (here two, to this process) is noted, not raised, while the
    # cleanup runs; at its end the first is raised, unless the cleanup is a failure's, and the
    # handlers are the ones before it
    for sig in support.SAVE_SIGNALS:  # (own_signal_handlers puts the session's back)
        signal.signal(sig, support.interrupted)
    steps = []
    with pytest.raises(support.Interrupted) as stopped:
        with support.signals_held():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal_self(sig)
                steps.append(sig)
    assert steps == [signal.SIGTERM, signal.SIGINT] and stopped.value.signum == signal.SIGTERM
    assert all(signal.getsignal(s) is support.interrupted for s in support.SAVE_SIGNALS)
    with support.signals_held():  # none came: nothing raised
        steps.append("quiet")
    assert steps[-1] == "quiet"
    with pytest.raises(OSError):  # a cleanup of a failure: the failure stops the command
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            with support.signals_held():
                signal_self()
            raise


def test_add_sums_keeps_a_key_that_either_side_lacks():
    t = torch.tensor
    total = {"loss": t([1.0, 2.0]), "only_total": t([5.0])}
    more = {"loss": t([0.5, 0.5]), "only_more": t([7.0])}
    got = ranks.add_sums(total, more)
    assert sorted(got) == ["loss", "only_more", "only_total"]
    assert torch.equal(got["loss"], t([1.5, 2.5]))
    assert torch.equal(got["only_total"], t([5.0])) and torch.equal(got["only_more"], t([7.0]))
    assert ranks.add_sums({}, more).keys() == more.keys()


def test_check_memory_refuses_only_what_exceeds_the_machine(monkeypatch):
    monkeypatch.setattr(ranks, "machine_memory", lambda: 3 << 30)
    ranks.check_memory(3 << 30, "to train", "--dim")  # exactly the machine's: fits
    with pytest.raises(support.UserError, match=r"at least 3 GiB on one device to train; it has 3"):
        ranks.check_memory((3 << 30) + 1, "to train", "--dim")


def test_dist_master_and_launcher_by_hand():
    # the master is global rank 0, not each node's local rank 0; a job of two or more ranks is
    # resumed with torchrun and as many
    assert ranks.Dist().master and ranks.Dist(rank=0, local_rank=0, world=16).master
    assert not ranks.Dist(rank=8, local_rank=0, world=16).master
    assert ranks.Dist(world=2).launcher == "torchrun --nproc_per_node=2 train_gpt.py"
    assert ranks.Dist(world=1).launcher == "python train_gpt.py"


@pytest.mark.skipif(
    torch.cuda.is_available() or not os.path.exists("/proc/meminfo"), reason="RAM, on Linux"
)
def test_machine_memory_is_the_physical_ram_and_unknown_refuses_nothing(monkeypatch):
    # /proc/meminfo's MemTotal (the RAM less what the kernel keeps) is at most the physical
    # RAM, and close to it; the free memory would be less. No size known: nothing is refused
    total = int(re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())[1]) << 10
    assert total <= ranks.machine_memory() <= 1.1 * total

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(ranks.os, "sysconf", unknown)
    ranks.check_memory(1 << 50, "to train", "--dim")  # a petabyte: not refused


def test_a_gpu_worker_is_set_up_on_its_local_device_and_gives_up_when_its_launcher_is_gone(
    monkeypatch,
):
    # rank 3 of 4, local rank 1, as torchrun sets them, CUDA said to be there (none needed):
    # its device is cuda:1, set before NCCL's rendezvous, its launcher this process's parent.
    # A launcher gone at start-up: no rendezvous; gone during one: said so, not the C++ error
    import torch.distributed as dist

    calls, gone = [], [False, False]
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(ranks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ranks.torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.setattr(ranks, "gone", lambda d: gone.pop(0) if gone else False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(backend))
    d = ranks.setup_distributed()
    assert d == ranks.Dist(rank=3, local_rank=1, world=4, device="cuda:1", parent=os.getppid())
    assert calls == [("device", "cuda:1"), "nccl"]
    gone[:] = [True]
    with pytest.raises(support.RunStopped, match="^the launcher is gone: this worker stops"):
        ranks.setup_distributed()
    assert calls == [("device", "cuda:1"), "nccl"]  # no rendezvous tried

    def refused(backend):
        raise dist.DistError("connection refused\n<a C++ stack>")

    monkeypatch.setattr(dist, "init_process_group", refused)
    for later, message in ((False, "the rendezvous failed: connection refused$"), (True, "^the l")):
        gone[:] = [False, later]  # at start-up, then after the rendezvous failed
        with pytest.raises(support.RunStopped, match=message):
            ranks.setup_distributed()


def test_a_launcher_gone_before_set_up_is_noticed_by_the_parent_at_start(monkeypatch):
    # the launcher is the parent this worker had when it started: one gone before set-up (the
    # worker re-parented since) is gone, not a new launcher; no rendezvous is tried
    import torch.distributed as dist

    calls = []
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # (no store to ask)
    monkeypatch.setattr(ranks.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(backend))
    monkeypatch.setattr(ranks, "PARENT", os.getppid() + 1)  # (the launcher that started it)
    with pytest.raises(support.RunStopped, match="^the launcher is gone: this worker stops"):
        ranks.setup_distributed()
    assert calls == []


def test_ranks_agree_on_a_signal_with_a_tensor_on_their_device(monkeypatch):
    # (NCCL reduces no CPU tensor) one rank's on the CPU: no collective
    seen = []

    def all_reduce(t, op):
        seen.append((t.device.type, op))
        return torch.tensor(0.0)

    monkeypatch.setattr(ranks, "all_reduce", all_reduce)
    for world in (2, 1):
        ranks.agreed_signal(types.SimpleNamespace(signum=0), ranks.Dist(world=world, device="meta"))
    assert seen == [("meta", "max"), ("cpu", "max")]


def test_closing_a_job_collects_what_refers_to_its_group_before_destroying_it(monkeypatch):
    # (DDP's reducer sits in reference cycles; left to the exit, gloo could abort: Dist.close)
    import torch.distributed as dist

    order = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ranks.gc, "collect", lambda: order.append("collect"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: order.append("destroy"))
    ranks.Dist(world=2).close()
    assert order == ["collect", "destroy"]


def test_a_launcher_gone_while_the_rendezvous_waits_ends_the_worker(monkeypatch):
    # init_process_group waits in C++, where no Python signal handler runs: the watch ends
    # the worker (status 1) once its launcher is gone meanwhile
    import torch.distributed as dist

    exited, codes, gone = threading.Event(), [], [False]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(ranks.torch.cuda, "is_available", lambda: False)  # (no device to set)
    monkeypatch.setattr(ranks, "gone", lambda d: gone[0])

    def exit_(code):
        codes.append(code)
        exited.set()

    def rendezvous(backend):  # the launcher goes while this rank waits for the other
        gone[0] = True
        exited.wait(3)

    monkeypatch.setattr(ranks.os, "_exit", exit_)
    monkeypatch.setattr(dist, "init_process_group", rendezvous)
    ranks.setup_distributed()
    assert codes[:1] == [1]


def test_a_launcher_is_gone_when_its_store_refuses_and_only_torchruns_store_counts(monkeypatch):
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_port = listening.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]  # bound, never listening: refuses
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        for agent, port, refused in (
            ("True", closed_port, True),
            (None, closed_port, False),  # another launcher's variables: no evidence
            ("True", open_port, False),
            ("True", "not a port", False),
            ("True", None, False),
        ):
            for name, value in (("TORCHELASTIC_USE_AGENT_STORE", agent), ("MASTER_PORT", port)):
                if value is None:
                    monkeypatch.delenv(name, raising=False)
                else:
                    monkeypatch.setenv(name, str(value))
            assert ranks.store_refused() == refused, (agent, port)
            assert ranks.gone(ranks.Dist()) == refused  # (not a worker: the store alone)


def test_the_watch_says_the_launcher_is_gone_in_one_line_and_exits_1(monkeypatch, capsys):
    exited, codes = threading.Event(), []
    monkeypatch.setattr(ranks, "gone", lambda d: True)

    def exit_(code):
        codes.append(code)
        exited.set()

    monkeypatch.setattr(ranks.os, "_exit", exit_)
    with ranks.watching(ranks.Dist(parent=1)):
        assert exited.wait(3)
    assert codes[:1] == [1]
    assert capsys.readouterr().err.startswith(
        "error: the launcher is gone: this worker stops; nothing was written\n"
    )


# a barrier; rank 0 fails or returns in on_master; what each rank then gets, sums, maxima, the
# signal agreed on: written to RANK.json for the test to hold against its own figures
TWO_RANKS = r"""import errno, json, os, sys, time, types
sys.path.insert(0, sys.argv[1])
import torch
import ranks, support
d = ranks.setup_distributed()
out, calls = {"rank": d.rank, "world": d.world, "master": d.master}, []

def fn(value):
    calls.append(d.rank)
    return value

def raises(error):
    def fail():
        raise error
    return fail

if d.rank == 1:  # rank 0 passes the barrier only once rank 1 has reached it
    time.sleep(1)
    open(os.path.join(sys.argv[2], "reached"), "w").close()
d.barrier()
out["after barrier"] = os.path.exists(os.path.join(sys.argv[2], "reached"))
out["shared"] = d.on_master(lambda: fn({"from": d.rank}))
out["kept"] = d.on_master(lambda: fn([d.rank]), share=False)
for name, error, last in (
    ("user", support.UserError("bad input"), None),
    ("os", OSError(errno.ENOSPC, "No space left on device", "/x"), None),
    ("other", ValueError("boom"), "ck.pt"),
    ("memory", MemoryError(), None),
):
    try:
        d.on_master(raises(error), last=last)
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
out["calls"] = calls
sums = {"a": torch.tensor([d.rank + 1.0, 2.0], dtype=torch.float64),
        "b": torch.full((2, 1), 10.0 * d.rank, dtype=torch.float64)}
out["sums"] = {k: v.tolist() for k, v in ranks.all_reduce_sums(sums).items()}
out["max"] = ranks.all_reduce(torch.tensor([d.rank + 5.0]), "max").tolist()
for got in ((15, 10), (0, 0), (0, 2)):
    out[f"signal {got}"] = ranks.agreed_signal(types.SimpleNamespace(signum=got[d.rank]), d)
d.close()
out["closed"] = not torch.distributed.is_initialized()
with open(os.path.join(sys.argv[2], f"{d.rank}.json"), "w") as f:
    json.dump(out, f)
os._exit(0)  # (gloo's teardown at exit can abort: see test_compile_ddp's DDP_COMPACT)
"""


@pytest.mark.slow
def test_two_ranks_agree_on_master_results_failures_sums_maxima_and_signals(tmp_path):
    (tmp_path / "two.py").write_text(TWO_RANKS)
    r = run_command(tmp_path / "two.py", REPO, tmp_path, nproc=2, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    stopped = ["RunStopped", "rank 0 failed (ValueError: boom); last checkpoint: ck.pt"]
    for rank, said in enumerate(got):
        assert (said["rank"], said["world"], said["master"]) == (rank, 2, rank == 0)
        assert said["after barrier"]
        assert said["shared"] == {"from": 0}  # rank 0's result, on both
        assert said["kept"] == ([0] if rank == 0 else None)  # share=False: rank 0's alone
        assert said["calls"] == ([0, 0] if rank == 0 else [])  # fn runs on rank 0 only
        assert said["user"] == ["UserError", "bad input"]
        assert said["os"] == ["OSError", "[Errno 28] No space left on device: '/x'"]
        assert said["other"] == (["ValueError", "boom"] if rank == 0 else stopped)
        ran_out = ["RunStopped", f"rank 0 failed ({OUT_OF_MEMORY_LINES['python']})"]
        assert said["memory"] == (["MemoryError", ""] if rank == 0 else ran_out)
        assert said["sums"] == {"a": [3.0, 4.0], "b": [[10.0], [10.0]]}  # by key, shapes kept
        assert said["max"] == [6.0]
        assert [said[f"signal {g}"] for g in ((15, 10), (0, 0), (0, 2))] == [15, 0, 2]
        assert said["closed"]


def test_a_worker_environment_that_is_not_torchruns_is_one_error_line(
    tmp_path, monkeypatch, capsys
):
    # RANK set without LOCAL_RANK and WORLD_SIZE (another launcher's, or a shell's), a rank
    # past the world (it would wait for the others till a timeout) or not a number, or an
    # env:// rendezvous without MASTER_ADDR: one line, status 2, nothing written (before: a
    # KeyError or ValueError traceback, status 1, or a wait)
    monkeypatch.setenv("RANK", "0")
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code, out, err = run_main(TINY_RUN + [f"--run_dir={tmp_path / 'a'}"], capsys)
    assert (code, out, err) == (
        2,
        "",
        "error: RANK=0 LOCAL_RANK=(unset) WORLD_SIZE=(unset): not a torchrun worker's "
        "environment; start the job with torchrun, or unset RANK\n",
    )
    for rank, local, world in (("2", "0", "2"), ("0", "1", "2"), ("x", "0", "1")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local)
        monkeypatch.setenv("WORLD_SIZE", world)
        code, out, err = run_main(TINY_RUN + [f"--run_dir={tmp_path / 'a'}"], capsys)
        said = f"error: RANK={rank} LOCAL_RANK={local} WORLD_SIZE={world}: not a torchrun"
        assert (code, out) == (2, "") and err.startswith(said) and err.count("\n") == 1, err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, out, err = run_main(TINY_RUN + [f"--run_dir={tmp_path / 'b'}"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the rendezvous cannot start: ") and "MASTER_ADDR" in err, err
    assert not list(tmp_path.iterdir())
