"""Runs side by side (launch.py): the sweep's trainers as processes, their failures, their
share of the CPUs, and the signals passed on to them (the sweep's own Ctrl-C cases:
tests/test_signals.py)."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import launch
import support


def script(path, body: str) -> str:
    """A command for run_plans: a Python file at path -> its path."""
    path.write_text(body)
    return str(path)


def test_a_failed_command_starts_nothing_more_not_even_a_plans_next(tmp_path, capsys):
    # two at once: one plan's command fails while the other's first runs; that one runs to its
    # end, then neither its next command nor the third plan starts, and the failure is raised
    flag = tmp_path / "failed"
    fail = script(
        tmp_path / "fail.py",
        f"""import pathlib, sys
pathlib.Path({str(flag)!r}).touch()
sys.exit("error: refused")
""",
    )
    wait = script(
        tmp_path / "wait.py",
        f"""import pathlib, time
while not pathlib.Path({str(flag)!r}).exists():
    time.sleep(0.01)
time.sleep(0.5)
""",
    )
    touch = script(
        tmp_path / "touch.py", "import pathlib, sys\npathlib.Path(sys.argv[1]).touch()\n"
    )
    plans = [
        launch.Plan("bad", [(fail, [])]),
        launch.Plan("two", [(wait, []), (touch, [str(tmp_path / "next")])]),
        launch.Plan("other", [(touch, [str(tmp_path / "other")])]),
    ]
    with pytest.raises(support.RunStopped, match=r"^bad: .*fail\.py exited 1: error: refused$"):
        launch.run_plans(plans, 1, jobs=2)
    killed = script(  # (the out-of-memory killer's, say: its printed lines are no error's)
        tmp_path / "killed.py", "import os, signal\nprint('step:1')\nos.kill(os.getpid(), 9)\n"
    )
    said = r"^k: .*killed\.py ended by signal 9: nothing on stderr$"
    with pytest.raises(support.RunStopped, match=said):
        launch.run_plans([launch.Plan("k", [(killed, [])])], 1)
    assert "no other run starts: waiting for the 1 in flight" in capsys.readouterr().out
    assert not (tmp_path / "next").exists() and not (tmp_path / "other").exists()


def test_a_run_that_fails_with_no_error_line_has_its_stderrs_end_shown(tmp_path, capsys):
    # a bug's traceback (or a crash's output): the sweep's line says its last line, and the
    # end of what it wrote (a traceback's frames) is shown above it, not lost
    bug = script(
        tmp_path / "bug.py",
        "import sys\nfor i in range(200):\n    print(f'note {i}', file=sys.stderr)\n"
        "def train():\n    raise ValueError('boom')\ntrain()\n",
    )
    with pytest.raises(support.RunStopped, match=r"^b: .*bug\.py exited 1: ValueError: boom$"):
        launch.run_plans([launch.Plan("b", [(bug, [])])], 1)
    alone = subprocess.run([sys.executable, bug], capture_output=True, text=True, cwd=tmp_path)
    ends = alone.stderr.splitlines()[-launch.SHOWN_LINES :]  # (its traceback, and notes before)
    assert "Traceback (most recent call last):" in ends and ends[0].startswith("note ")
    assert capsys.readouterr().err.splitlines() == [f"b: {bug}'s stderr ends:"] + [
        f"  {line}" for line in ends
    ]


def test_of_two_failures_the_first_is_raised_and_the_other_counted(tmp_path):
    # the first to fail is named, with its kind (status 2, bad input: UserError), and the other,
    # which fails once the first has been reaped (run_plans has seen it end), counted
    flag = tmp_path / "failed"
    first = script(
        tmp_path / "first.py",
        f"""import os, pathlib, sys
print("error: refused", file=sys.stderr)
pathlib.Path({str(flag)!r}).write_text(str(os.getpid()))
sys.exit(2)
""",
    )
    later = script(
        tmp_path / "later.py",
        f"""import os, pathlib, sys, time
flag = pathlib.Path({str(flag)!r})
while not flag.exists() or not flag.read_text():
    time.sleep(0.01)
while True:
    try:
        os.kill(int(flag.read_text()), 0)  # (until reaped, an ended process is still there)
    except ProcessLookupError:
        break
    time.sleep(0.01)
sys.exit("error: broke")
""",
    )
    plans = [launch.Plan("later", [(later, [])]), launch.Plan("first", [(first, [])])]
    said = r"^first: .*first\.py exited 2: error: refused \(and 1 more runs failed\)$"
    with pytest.raises(support.UserError, match=said):
        launch.run_plans(plans, 1, jobs=2)


def test_expand_runs_as_one_process_where_trainers_run_under_torchrun(tmp_path, monkeypatch):
    # (expand.py is not a distributed job) a plan's commands as started with nproc_per_node=2
    started = []

    class Ended:  # a process that has ended well (no pid: none is signalled)
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def poll(self):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Ended)
    steps = [("train_gpt.py", ["--a"]), ("expand.py", ["--b"]), ("train_gpt.py", ["--c"])]
    launch.run_plans([launch.Plan("dlo", steps)], 2)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # (on Linux each through ORPHAN_STOP, which runs the rest in its place)
    linux = sys.platform.startswith("linux")
    python = [sys.executable, *(["-c", launch.ORPHAN_STOP, str(os.getpid())] if linux else [])]
    assert started == [
        [*python, *torchrun, "train_gpt.py", "--a"],
        [*python, "expand.py", "--b"],
        [*python, *torchrun, "train_gpt.py", "--c"],
    ]


def test_a_plan_starts_once_the_one_it_names_is_done(tmp_path):
    # (a DLO run's expansion reads its source's checkpoint) with room for two at once, a plan
    # listed first but named after another waits for that one's last command to end; a third
    # runs meanwhile
    log = tmp_path / "log"
    step = script(
        tmp_path / "step.py",
        """import sys, time
open(sys.argv[1], "a").write(sys.argv[2] + " begins\\n")
time.sleep(float(sys.argv[3]))
open(sys.argv[1], "a").write(sys.argv[2] + " ends\\n")
""",
    )
    plans = [
        launch.Plan("dlo", [(step, [str(log), "dlo", "0"])], after="dense"),
        launch.Plan("dense", [(step, [str(log), "dense", "0.6"]), (step, [str(log), "more", "0"])]),
        launch.Plan("other", [(step, [str(log), "other", "0.3"])]),
    ]
    launch.run_plans(plans, 1, jobs=2)
    lines = log.read_text().splitlines()
    assert sorted(lines[:2]) == ["dense begins", "other begins"]
    assert lines.index("dlo begins") > lines.index("more ends") and len(lines) == 8


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPUs by affinity (Linux)")
def test_runs_side_by_side_each_get_their_share_of_the_cpus(tmp_path, monkeypatch):
    # each of J runs at once gets 1/J of the CPUs this process may use (at least one; its
    # affinity within its cgroup's quota) for torch's threads and for Inductor's compile
    # workers, a value the user set kept; one run at a time: this process's environment as it is
    names = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
    tell = script(
        tmp_path / "tell.py",
        f"""import json, os, sys
print(json.dumps([os.environ.get(k) for k in {names!r}]), file=open(sys.argv[1], "w"))
""",
    )
    for name in names:
        monkeypatch.delenv(name, raising=False)

    (tmp_path / "cg" / "box" / "run").mkdir(parents=True)  # this process's group: /box/run
    (tmp_path / "self").write_text("0::/box/run\n")
    monkeypatch.setattr(support, "CGROUP", str(tmp_path / "cg"))
    monkeypatch.setattr(support, "SELF_CGROUP", str(tmp_path / "self"))
    (tmp_path / "cg" / "box" / "run" / "cpu.max").write_text("max 100000\n")  # none in its own

    def seen(cpus: int, jobs: int) -> list:
        monkeypatch.setattr(support.os, "sched_getaffinity", lambda pid: set(range(cpus)))
        out = [tmp_path / f"{cpus}_{jobs}_{i}.json" for i in range(jobs)]
        launch.run_plans([launch.Plan(str(p), [(tell, [str(p)])]) for p in out], 1, jobs)
        told = [json.loads(p.read_text()) for p in out]
        assert all(t == told[0] for t in told)
        return told[0]

    assert seen(16, 8) == ["2", "2"]  # one H200 machine's 16 CPUs, bytes_gpu's --jobs=8
    assert seen(2, 3) == ["1", "1"]  # bytes_core's three one-thread runs on 2 cores
    assert seen(16, 1) == [None, None]
    quota = tmp_path / "cg" / "box" / "cpu.max"  # a container's --cpus=3.5, above it: 4 CPUs
    quota.write_text("350000 100000\n")
    assert seen(16, 2) == ["2", "2"]
    (tmp_path / "cg" / "cpu.max").write_text("200000 100000\n")  # the root's 2: the least
    assert seen(16, 2) == ["1", "1"]
    (tmp_path / "cg" / "cpu.max").write_text("-1 100000\n")  # not a quota: the box's 4
    (tmp_path / "self").write_text("0::/box/../box/run/\n")  # (the same group, spelt so)
    assert seen(16, 2) == ["2", "2"]
    for path in (quota, tmp_path / "cg" / "cpu.max"):  # no quota: the affinity alone
        path.unlink()
    assert seen(16, 2) == ["8", "8"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert seen(16, 2) == ["3", "8"]


def test_a_signal_to_the_sweep_reaches_torchruns_workers_once_and_not_torchrun(tmp_path):
    # a stand-in for torchrun: signalled itself it exits 1 (torchrun's SignalException) and its
    # workers would get a second signal (its shutdown's), cutting their save; else it ends as its
    # workers do. The sweep's signal reaches each worker once, and the launcher ends 0
    worker = script(
        tmp_path / "worker.py",
        """import os, pathlib, signal, sys, time
mine = pathlib.Path(sys.argv[1], str(os.getpid()))
signal.signal(signal.SIGINT, lambda *_: mine.open("a").write("INT\\n"))
mine.touch()
while "INT" not in mine.read_text():
    time.sleep(0.01)
time.sleep(0.3)  # (saving: a second signal would be written down too)
""",
    )
    launcher = script(
        tmp_path / "launcher.py",
        f"""import signal, subprocess, sys
signal.signal(signal.SIGINT, lambda *_: sys.exit(1))
workers = [subprocess.Popen([sys.executable, {worker!r}, sys.argv[1]]) for _ in range(2)]
sys.exit(max(w.wait() for w in workers))
""",
    )
    (tmp_path / "seen").mkdir()
    with launch.Trainers() as trainers:
        files = [launch.tempfile.TemporaryFile("w+") for _ in range(2)]
        cmd = [sys.executable, launcher, str(tmp_path / "seen")]
        proc = subprocess.Popen(cmd, stdout=files[0], stderr=files[1], start_new_session=True)
        trainers.live[proc] = launch.Trainer(launch.Plan("run", [(launcher, [])]), 0, 2, files)
        while len(os.listdir(tmp_path / "seen")) < 2:  # (both workers begun)
            time.sleep(0.01)
        trainers.got.append(signal.SIGINT)
        _, code, out, err = trainers.ended()
    assert code == 0, err
    seen = [p.read_text() for p in (tmp_path / "seen").iterdir()]
    assert seen == ["INT\n", "INT\n"]


@pytest.mark.slow
def test_torchrun_ending_1_on_a_signal_passed_to_its_workers_is_a_stop_not_a_failure(
    tmp_path, capsys
):
    # torchrun's status is 1 for workers a signal ended at once (here, with no handler: as one
    # that comes while they start, or a second one): the sweep stopped, no run failed
    worker = script(tmp_path / "worker.py", "import time\ntime.sleep(60)\n")
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # (torchrun starting)
    timer.start()
    said = "sweep stopped by SIGINT; r stopped, keeping its last checkpoint if it had one"
    with pytest.raises(launch.Stopped, match=said):
        launch.run_plans([launch.Plan("r", [(worker, [])])], 2)
    timer.join()
    # but a worker that said an error of its own (its save failed, say) failed: as at one process
    failing = script(
        tmp_path / "failing.py",
        "import pathlib, sys, time\nprint('error: cannot save: No space left', file=sys.stderr)\n"
        f"sys.stderr.flush()\npathlib.Path({str(tmp_path / 'said')!r}).touch()\ntime.sleep(60)\n",
    )

    def once_said():  # (the signal after a worker's line: before it, it could end it unsaid)
        while not (tmp_path / "said").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=once_said)
    timer.start()
    with pytest.raises(support.RunStopped, match="r: .*exited 1: error: cannot save: No space"):
        launch.run_plans([launch.Plan("r", [(failing, [])])], 2)
    timer.join()
    # a worker's traceback (a bug): the line points to it, shown above, not to torchrun's report
    # (rank 0's alone: two ranks' tracebacks written at once interleave; torchrun stops rank 1)
    bug = script(
        tmp_path / "bug.py",
        "import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(60)\n"
        "raise ValueError('boom')\n",
    )
    with pytest.raises(support.RunStopped, match=r"bug\.py exited 1: a worker failed: its stderr"):
        launch.run_plans([launch.Plan("r", [(bug, [])])], 2)
    assert "ValueError: boom" in capsys.readouterr().err


def test_a_hangup_reaches_the_trainers_as_a_sigterm_unless_ignored_as_by_nohup(tmp_path):
    # the terminal closed: the trainer, in a session of its own, saves and stops (SIGTERM, which
    # it takes), not trains on unseen; under nohup (SIGHUP ignored) the sweep goes on
    trainer = script(
        tmp_path / "trainer.py",
        f"""import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pathlib.Path({str(tmp_path / "begun")!r}).touch()
time.sleep(60)
""",
    )
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (the suite may run under nohup)
    try:
        with launch.Trainers() as trainers:
            assert signal.getsignal(signal.SIGHUP) == trainers.hung_up
            trainers.start(launch.Plan("run", [(trainer, [])]), 0, 1)
            while not (tmp_path / "begun").exists():
                time.sleep(0.01)
            signal.raise_signal(signal.SIGHUP)
            assert trainers.ended()[1] == 0 and trainers.got == [signal.SIGTERM]
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with launch.Trainers():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_a_sweep_killed_outright_leaves_its_trainer_a_sigterm_not_training_on(tmp_path):
    # a SIGKILL to the sweep runs no handler of its: the trainer, in a session of its own, gets a
    # SIGTERM from the kernel (ORPHAN_STOP) and saves and stops; it runs its own command, the
    # sweep's pid its parent's
    begun, saved = tmp_path / "begun", tmp_path / "saved"
    trainer = script(
        tmp_path / "trainer.py",
        f"""import os, pathlib, signal, sys, time
def save(signum, _):
    pathlib.Path({str(saved)!r}).write_text(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
pathlib.Path({str(begun)!r}).write_text(" ".join([str(os.getppid()), *sys.argv[1:]]))
time.sleep(60)
""",
    )
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import launch; launch.run_plans([launch.Plan('run', [({trainer!r}, ['a b'])])], 1)",
        ],
        cwd=support.HERE,
    )
    try:
        deadline = time.monotonic() + 60
        while not begun.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert begun.read_text() == f"{sweep.pid} a b"
        assert not saved.exists()
        sweep.kill()
        while not saved.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert saved.read_text() == str(int(signal.SIGTERM))
    finally:
        sweep.kill()
        sweep.wait()


def test_an_error_in_the_sweep_stops_its_trainers_as_a_signal_would(tmp_path, monkeypatch):
    # run_plans fails while starting its second command: the first, in flight, is not left
    # running where no Ctrl-C reaches it (a session of its own); it gets SIGTERM and is waited for
    begun, saved = tmp_path / "begun", tmp_path / "saved"
    slow = script(
        tmp_path / "slow.py",
        f"""import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(saved)!r}).touch(), sys.exit(0)))
pathlib.Path({str(begun)!r}).touch()
time.sleep(60)
""",
    )
    made, real = [], launch.tempfile.TemporaryFile

    def temporary_file(*args):  # the second command's files cannot be made
        while len(made) == 2 and not begun.exists():
            time.sleep(0.01)
        if len(made) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(launch.tempfile, "TemporaryFile", temporary_file)
    plans = [launch.Plan("slow", [(slow, [])]), launch.Plan("next", [(slow, [])])]
    t0 = time.monotonic()
    with pytest.raises(OSError, match="No space left"):
        launch.run_plans(plans, 1, jobs=2)
    assert saved.exists() and time.monotonic() - t0 < 30
