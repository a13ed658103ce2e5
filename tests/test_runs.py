"""Runs (runs.py, train_gpt.py's job): run folders, logs, checkpoints, resume, and checkpoints
that survive a kill, a non-finite step or a full disk."""

import ast
import copy
import errno
import fnmatch
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import ranks
import runlog
import runs
import support
import train_gpt as tg
from conftest import (
    REPO,
    RESUME_RUN,
    another_job_locks,
    read_metrics,
    run_command,
    run_main,
    sha256,
    start_command,
    timing,
    tiny,
    val_steps,
    wait_for_line,
    write_shard,
)
from data import shards

# ---------------------------------------------------------------------- run folders


def test_default_run_dirs_are_unique_within_a_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "2026-01-01_000000")
    dirs = {runs.new_run_dir("smoke") for _ in range(20)}
    assert len(dirs) == 20 and all(d.startswith("logs/2026-01-01_000000_smoke_") for d in dirs)
    assert all(os.path.isdir(d) for d in dirs)
    # an existing folder is never reused: mkdir fails and another name is drawn
    names = iter(["aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(runs.os, "urandom", lambda n: bytes.fromhex(next(names)))
    assert runs.new_run_dir("smoke").endswith("_aaaaaa")
    assert runs.new_run_dir("smoke").endswith("_bbbbbb")


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "train.log").write_text("an earlier run\n")
    (tmp_path / "checkpoint.pt").write_bytes(b"its checkpoint")
    code, _, err = run_main(["--preset=smoke", f"--run_dir={tmp_path}"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path} already holds a run")
    assert (tmp_path / "train.log").read_text() == "an earlier run\n"
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"its checkpoint"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_directory_is_held_by_one_job(tmp_path):
    # a lock another job holds (an flock of its own on the folder) is refused; this job's is
    # taken once, writes no file, keeps others out, and is free again once released
    (tmp_path / "lock").write_text("a user's own file")
    other = another_job_locks(tmp_path)
    try:
        with pytest.raises(tg.UserError, match="is in use by another job"):
            runs.lock_run_dir(str(tmp_path))
    finally:
        os.close(other)
    try:
        runs.lock_run_dir(str(tmp_path))
        runs.lock_run_dir(str(tmp_path))  # (this job's already)
        assert another_job_locks(tmp_path) is None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]  # the lock writes no file
        assert (tmp_path / "lock").read_text() == "a user's own file"
    finally:
        support.release_locks()
    os.close(another_job_locks(tmp_path))  # released: free again
    gone = tmp_path / "moved_away"  # a resumed run's folder moved between its read and its lock
    with pytest.raises(tg.UserError, match="No such file"):
        runs.open_run_dir(str(gone), "", {"mtime": 0, "run_id": "ab"})
    assert not gone.exists()  # not made again, empty


def test_a_second_job_on_a_busy_run_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, capsys):
    args = RESUME_RUN + ["--train_tokens=1024000", "--save_every=1", f"--run_dir={tmp_path}"]
    proc = start_command("train_gpt.py", *args, threads=1)
    try:
        wait_for_line(proc, "step:2/4000 train_loss")
        metrics = (tmp_path / "metrics.jsonl").read_bytes()
        for second in (args, [f"--resume={tmp_path}"]):  # a fresh start or a resume
            code, _, err = run_main(second, capsys)  # (this process: another pid)
            assert code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: {tmp_path} is in use by another job"), err
        assert (tmp_path / "metrics.jsonl").read_bytes().startswith(metrics)
    finally:
        proc.kill()
        proc.wait()
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    # the lock is gone
    code, _, err = run_main([f"--resume={tmp_path}", f"--stop_step={step + 1}"], capsys)
    assert code == 0, err
    train = [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert train == list(range(1, step + 2))  # each step once


def test_a_run_whose_checkpoint_vanished_is_not_resumed_or_overwritten(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + ["--stop_step=2", f"--run_dir={tmp_path}"], capsys)
    assert code == 0, err
    (tmp_path / "checkpoint.pt").unlink()

    def files():
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}

    before = files()
    code, out, err = run_main([f"--resume={tmp_path}"], capsys)
    assert (
        code == 2 and err.count("\n") == 1 and out == "" and "no checkpoint (checkpoint.pt)" in err
    )
    (tmp_path / "checkpoint.pt").symlink_to(tmp_path / "moved.pt")  # a link whose file is gone
    for args in ([f"--resume={tmp_path}"], RESUME_RUN + [f"--run_dir={tmp_path}"]):
        code, _, err = run_main(args, capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert "checkpoint.pt is a broken symbolic link" in err, err  # (no run to continue)
    (tmp_path / "checkpoint.pt").unlink()
    assert files() == before  # a refusal writes nothing
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)  # afresh: logs kept
    assert code == 0 and "its files are in" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "aborted_1").iterdir()} == before


def test_a_run_that_died_before_its_first_checkpoint_can_start_again(tmp_path, monkeypatch, capsys):
    def crash(*args):
        raise MemoryError("killed before its first checkpoint")

    with monkeypatch.context() as m:
        m.setattr(tg, "train_step", crash)
        with pytest.raises(MemoryError):
            tg.main(RESUME_RUN + [f"--run_dir={tmp_path}"])
    capsys.readouterr()
    old_log = (tmp_path / "train.log").read_text()
    assert not (tmp_path / "checkpoint.pt").exists()
    # had its first save been killed (SIGKILL), its half-written file: the new run removes it
    run_id = json.loads((tmp_path / "config.json").read_text())["run_id"]
    (tmp_path / f"checkpoint.pt.{run_id}.k1ll3d_x.tmp").write_bytes(b"half a save")
    (tmp_path / "checkpoint.pt.0123456789abcdef.k1ll3d_x.tmp").write_bytes(b"not this run's")
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # nothing to resume from
    assert code == 2 and "no checkpoint (checkpoint.pt) in it" in err, err
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)  # afresh, same folder
    assert code == 0, err
    assert (
        "its files are in" in err and (tmp_path / "aborted_1" / "train.log").read_text() == old_log
    )
    left = [p.name for p in tmp_path.glob("checkpoint.pt.*.tmp")]
    assert left == ["checkpoint.pt.0123456789abcdef.k1ll3d_x.tmp"]
    assert val_steps(tmp_path) == [0, 4, 8]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 8


# -------------------------------------------------------------- logs and provenance


def test_provenance_names_the_commit_and_whether_the_tree_differs(tmp_path, monkeypatch):
    # the sources in a git repository of their own: its commit as git itself says it, clean,
    # then with a source changed, differing; each source's sha256 that of its bytes; and
    # train.log's header in those words
    src = tmp_path / "src"
    for name in runlog.SOURCES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, name), src / name)
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "the sources"]):
        subprocess.run(git + args, check=True, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    commit = head.stdout.strip()
    monkeypatch.setattr(runlog, "HERE", str(src))
    for edited, words in ((False, "(clean)"), (True, "(tree differs from the commit)")):
        if edited:
            with open(src / "runs.py", "a") as f:
                f.write("# a local change\n")
        got = runlog.provenance()
        assert (got["git_commit"], got["git_dirty"]) == (commit, edited)
        for name in runlog.SOURCES:
            assert got[f"sha256 {name}"] == sha256((src / name).read_bytes()), name
        run = tmp_path / f"run_{edited}"
        run.mkdir()
        with runlog.RunLog(str(run), {**got, "command": "python train_gpt.py"}, True):
            pass
        assert f"\ngit: {commit} {words}\n" in (run / "train.log").read_text()


def test_the_sources_a_run_records_are_every_module_of_ours_it_imports():
    # train_gpt.py's imports, followed through each file of this repository that one names
    # (a module's dots as folders), read from the sources' text: SOURCES, no more, no fewer
    found, todo = set(), ["train_gpt.py"]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        with open(os.path.join(REPO, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                path = os.path.join(*module.split(".")) + ".py"
                if os.path.isfile(os.path.join(REPO, path)):
                    todo.append(path)
    assert found == set(runlog.SOURCES)


def test_a_run_log_ends_with_a_stop_line_and_closes_both_files(tmp_path, capsys):
    # a RunStopped leaving the log's with: its error line in train.log too, both files closed;
    # another rank's log (inactive) writes and opens nothing
    config = {**runlog.provenance(), "command": "python train_gpt.py"}
    with pytest.raises(support.RunStopped):
        with runlog.RunLog(str(tmp_path), config, True) as log:
            log.record({"kind": "train", "step": 1})
            raise support.RunStopped("disk full; last checkpoint: none")
    said = "\nerror: disk full; last checkpoint: none\n"
    assert (tmp_path / "train.log").read_text().endswith(said)
    assert log.log.closed and log.metrics.closed
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1}]
    other = tmp_path / "other"
    other.mkdir()
    with runlog.RunLog(str(other), config, False) as quiet:
        quiet.print("a line")
        quiet.record({"kind": "train", "step": 1})
    assert os.listdir(other) == []
    assert capsys.readouterr().out == "error: disk full; last checkpoint: none\n"


def test_each_job_appends_the_sources_it_ran(tmp_path, monkeypatch, capsys):
    # the sources a run records, read from a copy outside any git checkout that changes
    # between the two jobs
    src, run = tmp_path / "src", tmp_path / "run"
    for name in runlog.SOURCES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, name), src / name)
    monkeypatch.setattr(runlog, "HERE", str(src))
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    with open(src / "train_gpt.py", "a") as f:
        f.write("# a local change\n")
    code, _, err = run_main([f"--resume={run}"], capsys)
    assert code == 0, err
    log = (run / "train.log").read_text()
    new = sha256((src / "train_gpt.py").read_bytes())
    assert log.count("\ngit: not a git checkout\n") == 2
    assert (
        log.count("\nsource: train_gpt.py sha256 ") == 2
        and f"\nsource: train_gpt.py sha256 {new}\n" in log
    )
    assert log.count("class GPT(nn.Module)") == 2 and log.count("# a local change") == 1
    assert log.count(f"\ncommand: python train_gpt.py --resume={run}\n") == 1


def test_a_resume_drops_only_our_records_past_its_checkpoint(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=2"], capsys)
    assert code == 0, err
    mine = [b"my note: try a lower lr\n", b'{"kind": "note", "step": "two"}\n', b"[1, 2]\n"]
    with open(tmp_path / "metrics.jsonl", "ab") as f:  # a user's lines, then as if a job had
        f.write(b"".join(mine) + b'{"kind": "train", "step": 3}\n{"kind": "tra')  # crashed
    code, _, err = run_main([f"--resume={tmp_path}", "--stop_step=3"], capsys)
    assert code == 0, err
    lines = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert all(lines.count(line) == 1 for line in mine) and all(
        line.endswith(b"}\n") for line in lines if line not in mine
    )
    ours = [json.loads(line) for line in lines if line not in mine]
    assert [m["step"] for m in ours if m["kind"] == "train"] == [1, 2, 3]
    with open(tmp_path / "metrics.jsonl", "ab") as f:  # a note with no newline: not a cut record
        f.write(b"last note")
    code, _, err = run_main([f"--resume={tmp_path}", "--stop_step=4"], capsys)
    assert code == 0, err
    assert b"\nlast note\n" in (tmp_path / "metrics.jsonl").read_bytes()


def test_logs_that_cannot_be_opened_on_resume_stop_the_job_with_status_1(
    tmp_path, monkeypatch, capsys
):
    code, _, err = run_main(RESUME_RUN + ["--stop_step=2", f"--run_dir={tmp_path}"], capsys)
    assert code == 0, err

    def files():
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}

    before = files()
    (tmp_path / "metrics.jsonl").rename(tmp_path / "m")
    (tmp_path / "metrics.jsonl").mkdir()  # a folder where a log belongs: bad input, refused
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    want = f"error: {tmp_path / 'metrics.jsonl'} is a folder, not a file: move it, or give another"
    assert (code, err) == (2, want + " folder\n")
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "m").rename(tmp_path / "metrics.jsonl")
    assert files() == before  # nothing written

    def full(self, run_dir, *args, **kwargs):  # the disk fills as the logs are opened
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(run_dir, "train.log"))

    monkeypatch.setattr(runlog.RunLog, "__init__", full)
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert (code, err) == (
        1,
        f"error: cannot write the run's logs ({tmp_path / 'train.log'}: "
        f"No space left on device); last checkpoint: "
        f"{tmp_path / 'checkpoint.pt'} (step 2)\n",
    )


def test_a_log_write_that_fails_mid_run_is_status_1_naming_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    import errno

    real = runlog.RunLog.record

    def record(self, obj):
        if obj.get("kind") == "train" and obj["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, obj)

    monkeypatch.setattr(runlog.RunLog, "record", record)
    code, _, err = run_main(RESUME_RUN + ["--save_every=2", f"--run_dir={tmp_path}"], capsys)
    assert (code, err) == (
        1,
        f"error: No space left on device; last checkpoint: {tmp_path / 'checkpoint.pt'} (step 2)\n",
    )
    monkeypatch.undo()
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # it goes on from step 2
    assert code == 0, err
    assert [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"] == list(range(1, 9))


# --------------------------------------------------------------------------- resume


def test_a_resume_draws_the_random_numbers_the_run_would_have_drawn(tmp_path):
    # nothing in training draws random numbers today; a user's dropout would: the checkpoint
    # holds the generator's state where the run stopped, and restore puts it back
    class Loader:
        def restore(self, state):
            self.state = state

    raw = tg.GPT(tiny())
    opt = tg.optimizer(raw, raw.hp)
    torch.manual_seed(3)
    torch.rand(5)
    run = runs.RunState(run_id="ab12", step=2)
    state = runs.checkpoint_state(run, raw.hp, 1, raw, opt, loader={"at": 7})
    expected = torch.rand(5)  # the run's next draw
    torch.rand(3)  # another job's draws
    loader = Loader()
    job = tg.Job(run_dir=str(tmp_path))
    assert runs.restore(state, job, raw, opt, loader, cuda=False) == run
    assert torch.equal(torch.rand(5), expected) and loader.state == {"at": 7}


@pytest.mark.slow
def test_resume_is_bitwise_identical(tmp_path, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={full}"], capsys)
    assert code == 0, err
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={part}", "--stop_step=4"], capsys)
    assert code == 0, err
    assert f"resume with: python train_gpt.py --resume={part}" in out
    half = torch.load(part / "checkpoint.pt", weights_only=True)
    # controller active
    assert half["step"] == 4 and half["routing"]["controller"]["alpha"].abs().sum() > 0
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in half["model"])
    # a new process goes on (a job setting: given again)
    r = run_command("train_gpt.py", f"--resume={part}", "--untimed_steps=1")
    assert r.returncode == 0, r.stderr

    def strip(ms):
        return [timing(m) for m in ms if m["kind"] in ("train", "val")]

    a, b = strip(read_metrics(full)), strip(read_metrics(part))
    assert len(a) == 8 + 3 and a == b  # same floats, bit for bit (json keeps every bit)
    # the clock spans both jobs: each left its first step untimed, so 6 of 8 steps are timed
    lines = (part / "train.log").read_text().split("resumed at step 4")[1].splitlines()
    last = [ln for ln in lines if ln.startswith("step:8/8 ")]
    assert len(last) == 2 and "train_loss" in last[0] and "val_loss" in last[1]
    clocks = [re.search(r"train_time:(\d+)ms step_avg:([\d.]+)ms", ln).groups() for ln in last]
    assert clocks[0] == clocks[1]  # train and validation lines say the same
    total, avg = float(clocks[0][0]), float(clocks[0][1])
    assert avg == pytest.approx(total / 6, abs=0.2)
    warm = [m for m in read_metrics(part) if m["kind"] == "warmup"]
    assert [(m["step"], m["steps"]) for m in warm] == [(1, 1), (5, 1)]
    # and its total is every timed step's time (steps 1 and 5 not), the first job's included
    records = read_metrics(part)
    timed = [m["step_ms"] for m in records if m["kind"] == "train" and m["step"] not in (1, 5)]
    last = [m for m in records if m["kind"] == "val"][-1]
    assert len(timed) == 6 and last["train_time_ms"] == pytest.approx(sum(timed), rel=1e-12)
    ca = torch.load(full / "checkpoint.pt", weights_only=True)
    cb = torch.load(part / "checkpoint.pt", weights_only=True)
    assert ca["step"] == cb["step"] == 8
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    assert torch.equal(ca["routing"]["controller"]["alpha"], cb["routing"]["controller"]["alpha"])
    model = tg.GPT(tg.Hyperparameters(**cb["hp"]))
    model.load_state_dict(cb["model"])  # strict: an unwrapped model, loadable on CPU
    assert (part / "train.log").read_text().count("resumed at step 4") == 1


def assert_same_tensors(a, b):
    """a and b, nested dicts and lists of tensors and numbers, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


@pytest.mark.slow
def test_a_compacted_run_resumes_bit_for_bit_wherever_it_stops(tmp_path, capsys):
    # under compact the packed lengths, and the counts of the last steps they come from, decide
    # how each step packs and which steps are redone at full length: a resumed run must pack
    # and redo as the uninterrupted one (the checkpoint keeps them), or its floats differ
    run = RESUME_RUN + ["--compact=true", f"--train_tokens={8 * 32 * 24}", "--init_std=0.2"]
    full = tmp_path / "full"
    code, _, err = run_main(run + [f"--run_dir={full}"], capsys)
    assert code == 0, err
    want = [timing(m) for m in read_metrics(full) if m["kind"] in ("train", "val")]
    redone = [m["step"] for m in want if m.get("redone")]
    packed = [m["step"] for m in want if m["kind"] == "train" and min(m["packed"]) < 32]
    assert redone and len(packed) > 12, (redone, packed)  # (gates N(0, 0.2): tokens skip)
    ca = torch.load(full / "checkpoint.pt", weights_only=True)
    for stop in (3, 8, 13, 21):
        part = tmp_path / f"part{stop}"
        code, _, err = run_main(run + [f"--run_dir={part}", f"--stop_step={stop}"], capsys)
        assert code == 0, err
        r = run_command("train_gpt.py", f"--resume={part}", "--untimed_steps=1")
        assert r.returncode == 0, r.stderr
        got = [timing(m) for m in read_metrics(part) if m["kind"] in ("train", "val")]
        assert got == want, stop  # every loss, count, packed length and redo, bit for bit
        cb = torch.load(part / "checkpoint.pt", weights_only=True)
        assert cb["packing"] == ca["packing"] and cb["step"] == 24
        for key in ("model", "optimizer", "routing"):
            assert_same_tensors(ca[key], cb[key])
    # at another seq_len the saved lengths do not apply: the resume packs from full lengths
    code, _, err = run_main(run + [f"--run_dir={tmp_path / 'seq'}", "--stop_step=5"], capsys)
    assert code == 0, err
    r = run_command(
        "train_gpt.py",
        f"--resume={tmp_path / 'seq'}",
        "--seq_len=16",
        "--batch_size=16",  # (a step of as many tokens)
        "--stop_step=7",
    )
    assert r.returncode == 0, r.stderr
    assert torch.load(tmp_path / "seq" / "checkpoint.pt", weights_only=True)["step"] == 7


def test_a_resume_refuses_a_training_shard_the_run_read_that_changed(tmp_path, capsys):
    # each shard the run had read (its fingerprint in the checkpoint, kept across resumes) must
    # be the same file when it resumes: a replaced or re-tokenized shard would silently give
    # another run. A shard it had not read may be added, but not once the run has been round
    # them all (in any of them, the last too). 700 tokens a shard: 2 steps of 257
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 50257, 700) for _ in range(4)]
    for i, tokens in enumerate(data[:3]):
        write_shard(tmp_path / f"train_{i}.bin", tokens)
    run = tmp_path / "run"
    args = RESUME_RUN + [f"--train_files={tmp_path}/train_*.bin", f"--run_dir={run}"]
    code, _, err = run_main(args + ["--train_tokens=4096", "--stop_step=5"], capsys)  # 16 steps
    assert code == 0, err  # shards 0, 1 and 2 read, in 2
    shutil.copytree(run, tmp_path / "more")  # not round yet: one more shard is taken, and read
    write_shard(tmp_path / "train_3.bin", data[3])
    code, _, err = run_main([f"--resume={tmp_path / 'more'}", "--stop_step=7"], capsys)
    assert code == 0, err
    state = torch.load(tmp_path / "more" / "checkpoint.pt", weights_only=True)["loader"]
    assert [e[:2] for e in state["read"]] == [[i, f"train_{i}.bin"] for i in range(4)]
    assert (state["laps"], state["files"]) == (0, 4)
    (tmp_path / "train_3.bin").unlink()
    code, _, err = run_main([f"--resume={run}", "--stop_step=7"], capsys)  # reloads 0 and 2
    assert code == 0, err  # round once: in shard 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)  # shard 1's kept from before
    assert [e[:3] for e in ckpt["loader"]["read"]] == [[i, f"train_{i}.bin", 700] for i in range(3)]
    assert (ckpt["loader"]["laps"], ckpt["loader"]["files"]) == (1, 3)

    def refused(start):
        before = (run / "metrics.jsonl").read_bytes()
        code, out, err = run_main([f"--resume={run}"], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("error: " + start), err
        assert (run / "metrics.jsonl").read_bytes() == before

    write_shard(tmp_path / "train_1.bin", data[1][::-1])  # its tokens reversed: same size
    refused(f"the run had read train_1.bin as training shard 1, and {tmp_path}/train_1.bin is")
    write_shard(tmp_path / "train_1.bin", data[1])
    edited = copy.deepcopy(ckpt)
    edited["loader"]["read"][1][2] = 700.0
    torch.save(edited, run / "checkpoint.pt")
    refused("the checkpoint's record of the training shards its run read is not one this")
    torch.save(ckpt, run / "checkpoint.pt")
    code, _, err = run_main([f"--resume={run}", "--stop_step=11"], capsys)  # in the last again
    assert code == 0, err
    write_shard(tmp_path / "train_3.bin", data[3])  # not read, but the run goes round again
    refused("the run has been round its 3 training shards and goes round them again: 4 match")
    (tmp_path / "train_3.bin").unlink()
    code, _, err = run_main([f"--resume={run}"], capsys)
    assert code == 0, err


def test_a_resume_refuses_a_validation_shard_the_run_was_validated_on_that_changed(
    tmp_path, capsys
):
    # a log's validation losses are on one set of tokens: a validation shard that its
    # validations read (in every checkpoint, a job's that validated nothing too) must be the
    # same file when it resumes; one they do not read may be added. Two shards of 200 tokens,
    # one validation batch of 4 x 32 each
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 50257, 200) for _ in range(2)]
    for i, tokens in enumerate(data):
        write_shard(tmp_path / f"val_{i}.bin", tokens)
    run = tmp_path / "run"
    args = RESUME_RUN + [f"--val_files={tmp_path}/val_*.bin", f"--run_dir={run}"]
    code, _, err = run_main(args + ["--stop_step=2"], capsys)  # validated at step 0: both read
    assert code == 0, err
    code, _, err = run_main([f"--resume={run}", "--stop_step=3"], capsys)  # no validation
    assert code == 0, err
    kept = torch.load(run / "checkpoint.pt", weights_only=True)["validation"]["read"]
    assert [e[:3] for e in kept] == [[i, f"val_{i}.bin", 200] for i in range(2)]
    write_shard(tmp_path / "val_2.bin", data[0])  # past val_tokens: never read
    write_shard(tmp_path / "val_1.bin", data[1][::-1])  # its tokens reversed: same size
    before = (run / "metrics.jsonl").read_bytes()
    code, out, err = run_main([f"--resume={run}"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"error: the run had read val_1.bin as validation shard 1, and {tmp_path}/val_1.bin is "
        f"another now (its name, token count, or first or last tokens differ): resume with the "
        f"validation shards the run was validated on"
    ), err
    assert (run / "metrics.jsonl").read_bytes() == before
    write_shard(tmp_path / "val_1.bin", data[1])
    code, _, err = run_main([f"--resume={run}"], capsys)
    assert code == 0, err


def test_a_run_validated_on_its_training_shards_says_so_in_its_log(tmp_path, capsys):
    # allowed (gpu_check.sh's paper runs do it: the sample's validation shard is too small for
    # their batch), but the record says it, however the shard is named (here: a link to it)
    sample = os.path.join(os.path.dirname(tg.__file__), "data", "sample")
    (tmp_path / "v.bin").symlink_to(os.path.join(sample, "sample_train_000001.bin"))
    note = "note: some validation shards are training shards too: the validation losses are on"
    for run, extra in (("own", []), ("linked", [f"--val_files={tmp_path}/v.bin"])):
        args = RESUME_RUN + extra + [f"--run_dir={tmp_path / run}", "--stop_step=1"]
        code, _, err = run_main(args + ["--val_tokens=128"], capsys)
        assert code == 0, err
        assert (note in (tmp_path / run / "train.log").read_text()) == (run == "linked")


def test_resume_refuses_a_different_model_shape(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=1"], capsys)
    assert code == 0, err
    before = (tmp_path / "metrics.jsonl").read_bytes()
    code, _, err = run_main([f"--resume={tmp_path}", "--dim=64", "--n_layers=4"], capsys)
    assert code == 2
    assert err == (
        "error: cannot resume with a different model shape: n_layers 2 -> 4, dim 32 -> 64\n"
    )
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_resuming_with_another_layout_of_routed_blocks_is_refused(tmp_path, capsys):
    gated = ("--gamma=", "--mu_start=")  # the skip-middle controller's: refused under mod
    mod = [a for a in RESUME_RUN if not a.startswith(gated)] + [
        "--router=mod",
        "--mod_every=1",
        "--stop_step=2",
        f"--run_dir={tmp_path}",
    ]
    code, _, err = run_main(mod, capsys)
    assert code == 0, err
    code, _, err = run_main([f"--resume={tmp_path}", "--mod_every=2"], capsys)
    assert code == 2 and "different model shape: mod_every 1 -> 2" in err, err


def test_a_resume_refuses_the_settings_of_a_new_models_initial_weights(tmp_path, capsys):
    # the weights and random state are the checkpoint's: --seed, --init_std and --gate_init
    # would do nothing (at their defaults too), yet config.json and export would record them
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=2"], capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for given in ("--seed=7", "--init_std=0.5", "--gate_init=zero", "--seed=0"):
        code, out, err = run_main([f"--resume={tmp_path}", given], capsys)
        name = given.split("=")[0]
        said = f"{name} sets a new model's initial weights, and --resume takes the checkpoint's"
        assert (code, out, err) == (2, "", f"error: {said}: drop it\n")
    assert before == {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}


def test_resume_with_fewer_steps_than_done_is_refused(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=4"], capsys)
    assert code == 0, err
    before = (tmp_path / "metrics.jsonl").read_bytes()
    code, out, err = run_main([f"--resume={tmp_path}", "--train_tokens=512"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1  # 2 steps in all, 4 done
    assert err.startswith("error: the checkpoint is at step 4 but these settings make 2 steps")
    # a step of other tokens would count the schedule's steps and the budget otherwise (a
    # finished run trained on, one half done complete); its sequences may be cut otherwise
    for more in (["--batch_size=32"], ["--seq_len=16"], ["--batch_size=4", "--seq_len=16"]):
        code, out, err = run_main([f"--resume={tmp_path}", *more], capsys)
        assert (code, out) == (2, "") and err == (
            "error: a resume keeps the tokens of a step, batch_size x seq_len = 256 (the "
            "schedule counts steps of them): give a batch_size and seq_len whose product is 256\n"
        ), err
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 4


def test_older_checkpoints_and_a_save_killed_half_way(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    # what an older version saved: the expand_* fields, data paths relative to the repository
    ckpt["hp"].update(expand_from="", expand_groups=1, train_files="data/sample/sample_train_*.bin")
    torch.save(ckpt, run / "checkpoint.pt")
    # what a SIGKILL mid-save leaves (the run's id, then mkstemp's 8 characters), and files that
    # are not it: a user's copies, another run's leftovers (an id that starts as this one's)
    run_id = ckpt["run_id"]
    (run / f"checkpoint.pt.{run_id}.k1ll3d_x.tmp").write_bytes(b"half a save")
    (run / f"checkpoint.prev.pt.{run_id}.k1ll3d_x.tmp").write_bytes(b"half a copy")
    others = [
        "checkpoint.pt.20261128.tmp",
        "checkpoint.pt.0123456789abcdef.k1ll3d_x.tmp",
        f"checkpoint.pt.{run_id}.my-copy.tmp",
        f"checkpoint.pt.{run_id}0.k1ll3d_x.tmp",
        f"checkpoint.prev.pt.{run_id}.k1ll3d.tmp",
    ]
    for name in others:
        (run / name).write_bytes(b"not this run's")
    assert tg.load_model(str(run)).hp.n_layers == ckpt["hp"]["n_layers"]
    # resumed from another folder: the relative data path is the repository's
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([f"--resume={run}", "--stop_step=2"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in run.glob("checkpoint*.tmp")) == sorted(others)
    assert {(run / name).read_bytes() for name in others} == {b"not this run's"}
    mask = os.umask(0)
    os.umask(mask)
    for name in ("checkpoint.pt", "config.json", "metrics.jsonl"):  # as open() would make them
        assert (run / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_a_checkpoint_from_another_run_or_shape_or_damaged_is_refused(tmp_path, capsys):
    for name in ("a", "b"):
        code, _, err = run_main(
            RESUME_RUN + [f"--run_dir={tmp_path / name}", "--stop_step=2"], capsys
        )
        assert code == 0, err
    a, b = tmp_path / "a", tmp_path / "b"
    metrics = (b / "metrics.jsonl").read_bytes()
    (b / "checkpoint.pt").write_bytes((a / "checkpoint.pt").read_bytes())
    code, out, err = run_main([f"--resume={b}"], capsys)
    assert code == 2 and out == "" and "belongs to another run" in err and err.count("\n") == 1
    assert (b / "metrics.jsonl").read_bytes() == metrics
    # a complete checkpoint of another run is refused as well, not called "complete"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'c'}"], capsys)
    assert code == 0, err
    (b / "checkpoint.pt").write_bytes((tmp_path / "c" / "checkpoint.pt").read_bytes())
    code, out, err = run_main([f"--resume={b}"], capsys)
    assert code == 2 and out == "" and "belongs to another run" in err and err.count("\n") == 1
    (b / "checkpoint.pt").write_bytes((a / "checkpoint.pt").read_bytes())
    (b / "config.json").unlink()  # no record of whose run this is, but a history to cut
    code, out, err = run_main([f"--resume={b}"], capsys)
    assert (
        code == 2
        and out == ""
        and f"{b / 'config.json'} is missing, unreadable or not a run's (no run_id), so" in err
        and err.endswith("is this folder's run: put the run's back\n")
        and err.count("\n") == 1
    ), err
    assert (b / "metrics.jsonl").read_bytes() == metrics and not (b / "config.json").exists()
    # a config.json that is not a run's (the user's own) is not overwritten, logs or none
    (b / "metrics.jsonl").unlink()
    (b / "config.json").write_text('{"my": "notes"}')
    code, out, err = run_main([f"--resume={b}"], capsys)
    assert code == 2 and out == "" and "not a run's (no run_id)" in err, err
    assert (b / "config.json").read_text() == '{"my": "notes"}'
    (b / "metrics.jsonl").write_bytes(metrics)
    state = torch.load(a / "checkpoint.pt", weights_only=True)
    for change, message in [
        (lambda s: s["hp"].update(dim=64), "weights do not fit"),
        (lambda s: s.pop("optimizer"), "checkpoint lacks optimizer"),
        (lambda s: s.update(step="4"), "saved step='4' is not of type int"),
        (lambda s: s["hp"].update(lr="x"), "saved lr='x' is not of type float"),
        (lambda s: s.update(run_id="../x"), "run_id='../x' is not a run's"),  # (it names files)
        (lambda s: s.update(loader={"shard": 0}), "data position"),
        (lambda s: s.update(routing={}), "corrupt or incompatible"),
        (lambda s: s.update(rng={"cuda": []}), "corrupt or incompatible"),
        (lambda s: s.update(optimizer={"state": {}}), "corrupt or incompatible"),
    ]:
        bad = {**state, "hp": dict(state["hp"])}
        change(bad)
        torch.save(bad, a / "checkpoint.pt")
        logs = {f: (a / f).read_bytes() for f in ("train.log", "metrics.jsonl", "config.json")}
        code, out, err = run_main([f"--resume={a}"], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert out == "" and logs == {f: (a / f).read_bytes() for f in logs}  # nothing written
    for packing in (  # read when the resumed job packs (compact=true)
        [32, 32],
        {"lengths": [0, 32], "seen": []},
        {"lengths": [32], "seen": []},
        {"lengths": [32.0, 32.0], "seen": []},
        {"lengths": [32, 32], "seen": [[40.0, 1.0]]},
        {"lengths": [32, 32], "seen": None},
        {"lengths": [32, 32], "seen": [[math.inf, 32.0]]},
        {"lengths": [32], "seen": [[32.0]]},
        {"lengths": [32, 32], "seen": [["32", "32"]]},
        {"lengths": [32, 32], "seen": [[True, 32.0]]},
        {"lengths": [32, 32], "seen": [[32.0, 32.0]] * 17},
    ):
        torch.save({**state, "packing": packing}, a / "checkpoint.pt")
        code, out, err = run_main([f"--resume={a}", "--compact=true"], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, (packing, err)
        assert "packed lengths that no run makes" in err, err
    torch.save(state, a / "checkpoint.pt")
    code, _, err = run_main([f"--resume={a}", "--max_seq_len=-1"], capsys)  # checked first
    assert code == 2 and err == "error: max_seq_len=-1 must lie in [1, inf)\n", err


def test_edited_counters_and_settings_are_checked_for_value_and_completeness(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + ["--stop_step=4", f"--run_dir={tmp_path}"], capsys)
    assert code == 0, err
    good = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    for key, value, message in (
        ("step", -3, "step=-3 must lie in [0, inf)"),
        ("val_done", 9, "val_done=9 exceeds step=4"),
        ("train_ms", float("nan"), "train_ms=nan must lie in [0, inf)"),
        ("train_ms", float("inf"), "train_ms=inf must lie in [0, inf)"),
        ("bad_steps", 5, "bad_steps=5 exceeds step=4"),
    ):
        torch.save({**good, key: value}, tmp_path / "checkpoint.pt")
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        code, _, err = run_main([f"--resume={tmp_path}"], capsys)
        assert code == 2 and f"checkpoint.pt: {message} (an edited or damaged checkpoint)" in err, (
            err
        )
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    # settings that lack one (no default stands in for it), and non-finite state
    nan = float("nan")
    for edit, message in (
        (lambda c: c["hp"].pop("lr"), "it lacks the setting 'lr'"),
        (lambda c: c["model"]["embed.weight"].__setitem__((0, 0), nan), "embed.weight holds NaN"),
        (
            lambda c: next(iter(c["optimizer"]["state"].values()))["exp_avg_sq"].fill_(nan),
            "non-finite weights, optimiser",
        ),
        (lambda c: c["routing"]["controller"]["alpha"].fill_(nan), "controller state"),
    ) + tuple(  # AdamW's state of a parameter, as a step reads it (the fused step crashed)
        (lambda c, edit=edit: edit(next(iter(c["optimizer"]["state"].values()))), "optimiser's")
        for edit in (
            lambda s: s.pop("exp_avg_sq"),
            lambda s: s.update(exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3)),
            lambda s: s.update(exp_avg="hello"),
            lambda s: s.update(exp_avg=s["exp_avg"].to_sparse()),
            lambda s: s.update(step=torch.zeros(2, 2)),
            lambda s: s.update(max_exp_avg_sq=s["exp_avg_sq"]),
        )
    ):
        edited = copy.deepcopy(good)
        edit(edited)
        torch.save(edited, tmp_path / "checkpoint.pt")
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        code, _, err = run_main([f"--resume={tmp_path}"], capsys)
        assert code == 2 and message in err and "edited or damaged" in err, err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


# ------------------------- checkpoints that survive kills, bad steps and full disks


@pytest.mark.slow
def test_sigkill_mid_run_resumes_from_the_last_checkpoint(tmp_path, capsys):
    # 4,000 steps: killed long before its end, however slow the machine; resumed for 3 more
    args = RESUME_RUN + ["--train_tokens=1024000", "--save_every=3", f"--run_dir={tmp_path}"]
    proc = start_command("train_gpt.py", *args, threads=1)
    wait_for_line(proc, "step:7/4000 train_loss")
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    assert step >= 6 and step % 3 == 0
    code, _, err = run_main([f"--resume={tmp_path}", f"--stop_step={step + 3}"], capsys)
    assert code == 0, err
    train = [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert train == list(range(1, step + 4))  # each step once: lines past the checkpoint dropped
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == step + 3


@pytest.mark.slow
def test_kill_while_saving_leaves_a_loadable_checkpoint(tmp_path, capsys):
    # a model big enough (~20M parameters, ~230 MB with Adam) that a save takes a while; 100
    # steps, each saved: a poll that misses the first saves meets a later one
    args = [
        "--preset=smoke",
        "--n_layers=2",
        "--dim=192",
        "--n_heads=4",
        "--n_kv_heads=4",
        "--seq_len=16",
        "--batch_size=2",
        "--device_batch_size=2",
        "--train_tokens=3200",
        "--val_tokens=32",
        "--val_every=0",
        "--save_every=1",
        f"--run_dir={tmp_path}",
    ]
    proc = start_command("train_gpt.py", *args, threads=1)
    ckpt = tmp_path / "checkpoint.pt"
    deadline = time.time() + 300
    while True:  # a second save is being written: stopped there (SIGSTOP), then killed
        while not (ckpt.exists() and glob.glob(f"{ckpt}.*.tmp")):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)  # (stopped now: nothing moves under the look below)
        if glob.glob(f"{ckpt}.*.tmp"):
            break
        proc.send_signal(signal.SIGCONT)  # (its rename came first: the next save, then)
    proc.kill()
    proc.wait()
    state = torch.load(ckpt, weights_only=True)  # the previous checkpoint, whole
    assert state["step"] >= 1
    cut = glob.glob(f"{ckpt}.*.tmp")
    assert cut and all(f".{state['run_id']}." in name for name in cut)  # named by its run
    more = f"--train_tokens={32 * (state['step'] + 1)}"  # one step more (32 tokens a step)
    code, _, err = run_main([f"--resume={tmp_path}", more], capsys)
    assert code == 0, err
    assert not glob.glob(f"{ckpt}.*.tmp")  # removed by the resume: its run's


def nan_on_call(*n):
    """The model's loss, NaN on its n-th calls with gradients enabled (training)."""
    calls, real = [0], tg.LinearCrossEntropy.apply

    def fake(*args, **kwargs):
        loss = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] in n:
                return loss * float("nan")
        return loss

    return fake


def test_stop_and_error_lines_say_what_is_true(tmp_path, monkeypatch, capsys):
    # a run that never saved meets a non-finite loss: it has no last good checkpoint, said so
    with monkeypatch.context() as m:
        m.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(1))
        code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'a'}"], capsys)
    assert (code, err) == (
        1,
        "error: non-finite loss at step 1; no update was applied; last good checkpoint: none\n",
    )
    # a checkpoint.prev.pt that is a dangling link: no run to continue, nor to rename
    (tmp_path / "b").mkdir()
    os.symlink(tmp_path / "gone.pt", tmp_path / "b" / "checkpoint.prev.pt")
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'b'}"], capsys)
    assert (code, err) == (
        2,
        f"error: {tmp_path / 'b' / 'checkpoint.prev.pt'} is a broken symbolic link, not a file: "
        "move it, or give another folder\n",
    )
    # a checkpoint that cannot be read (a permission) is said so, not called corrupt
    c = tmp_path / "c"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={c}", "--stop_step=1"], capsys)
    assert code == 0, err

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(torch, "load", denied)
        code, _, err = run_main([f"--resume={c}"], capsys)
    assert (code, err) == (2, f"error: cannot read {c / 'checkpoint.pt'}: Permission denied\n")
    # a resume names the checkpoint before its newest, kept beside it (one step trained from it)
    code, _, err = run_main([f"--resume={c}", "--stop_step=2"], capsys)
    assert code == 0, err
    code, out, err = run_main([f"--resume={c}", "--stop_step=3"], capsys)
    assert code == 0 and " resumed_at:2 (checkpoint.prev.pt, step 1, kept beside it)\n" in out, err

    # where the file system has no hard links, the one before the newest is kept as a copy
    def no_links(*args):
        raise OSError(errno.EPERM, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(os, "link", no_links)
        code, _, err = run_main([f"--resume={c}", "--stop_step=4"], capsys)
    prev = c / "checkpoint.prev.pt"
    assert code == 0 and not os.path.samefile(prev, c / "checkpoint.pt"), err
    assert torch.load(prev, weights_only=True)["step"] == 3
    assert not list(c.glob("*.tmp"))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # no room for the copy: none kept, the save goes on
        m.setattr(os, "link", no_links)
        m.setattr(shutil, "copyfileobj", full)
        code, _, err = run_main([f"--resume={c}", "--stop_step=5"], capsys)
    assert code == 0 and torch.load(c / "checkpoint.pt", weights_only=True)["step"] == 5, err
    assert not prev.exists() and not list(c.glob("*.tmp"))


def test_non_finite_loss_stops_the_run_at_a_checkpoint_that_trains(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "run" / "checkpoint.pt"
    args = RESUME_RUN + ["--save_every=2", f"--run_dir={tmp_path / 'run'}"]
    with monkeypatch.context() as m:  # step 6 (2 micro-steps each): step 4's checkpoint trained
        m.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(11))
        code, _, err = run_main(args, capsys)
    assert code == 1 and err == (
        f"error: non-finite loss at step 6; no update was applied; last "
        f"good checkpoint: {ckpt} (step 4)\n"
    )
    assert torch.load(ckpt, weights_only=True)["step"] == 4
    assert [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"] == [
        1,
        2,
        3,
        4,
        5,
    ]
    # no step from the newest checkpoint (step 6's, as if its update had exploded) is finite: the
    # one before it comes back, and the run goes on from it as if it had never stopped
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'whole'}"], capsys)
    assert code == 0, err
    for call in (5, 1):  # step 7: in the job that saved step 6, then in a job resumed from it
        if call == 1:
            code, _, err = run_main([f"--resume={ckpt.parent}", "--stop_step=6"], capsys)
            assert code == 0 and torch.load(ckpt, weights_only=True)["step"] == 6, err
        with monkeypatch.context() as m:
            m.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(call))
            code, _, err = run_main([f"--resume={ckpt.parent}"], capsys)
        assert code == 1 and err == (
            f"error: non-finite loss at step 7; no update was applied; last "
            f"good checkpoint: {ckpt} (step 4, put back: no step from the "
            f"newer {ckpt} (step 6) had a finite loss)\n"
        ), err
        assert torch.load(ckpt, weights_only=True)["step"] == 4
        assert sorted(p.name for p in ckpt.parent.glob("checkpoint*")) == ["checkpoint.pt"]
    # a save cut after its link leaves checkpoint.prev.pt the same file: nothing to put back
    prev = ckpt.parent / "checkpoint.prev.pt"
    os.link(ckpt, prev)
    with monkeypatch.context() as m:
        m.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(1))
        code, _, err = run_main([f"--resume={ckpt.parent}"], capsys)
    assert code == 1 and err.endswith(  # (the newest stays: no step from it was finite)
        f"last good checkpoint: none: no step from the newest, {ckpt} (step 4), had a finite "
        f"loss, and no earlier checkpoint of this run could be put back\n"
    ), err
    # a fresh start refuses a folder holding either; with only the earlier one it says what to do
    prev.unlink()
    os.replace(ckpt, prev)
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={ckpt.parent}"], capsys)
    assert code == 2 and err.endswith(
        f"(checkpoint.prev.pt); choose another directory, or continue "
        f"it with train_gpt.py --resume={ckpt.parent} once "
        f"checkpoint.prev.pt is renamed checkpoint.pt\n"
    ), err
    os.replace(prev, ckpt)
    code, _, err = run_main([f"--resume={tmp_path / 'run'}"], capsys)
    assert code == 0, err

    def train(d):
        return [(m["step"], m["train_loss"]) for m in read_metrics(d) if m["kind"] == "train"]

    assert train(tmp_path / "run") == train(tmp_path / "whole")

    def weights(d):
        return torch.load(d / "checkpoint.pt", weights_only=True)["model"]

    assert all(
        torch.equal(v, weights(tmp_path / "whole")[k]) for k, v in weights(tmp_path / "run").items()
    )


def test_a_bounded_number_of_bad_steps_can_be_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(9))
    code, out, err = run_main(RESUME_RUN + ["--max_bad_steps=1", f"--run_dir={tmp_path}"], capsys)
    assert code == 0, err
    assert "step:5/8 skipped: non-finite loss (1 of max_bad_steps=1)" in out
    train = [m for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 6, 7, 8]
    assert all(math.isfinite(m["train_loss"]) for m in train)


def test_the_bad_steps_allowed_are_the_runs_not_each_jobs(tmp_path, monkeypatch, capsys):
    # max_bad_steps bounds the run (its checkpoint counts the steps skipped): one that skipped
    # step 2 and stopped at 3 stops at its second, step 5, in the next job, as the run in one
    # job does (2 micro-steps a step: a job's calls 3 and 9 are its steps 2 and 5; the bound is
    # the job's setting, given again)
    args = RESUME_RUN + ["--max_bad_steps=1"]
    for name, calls, stop in (("one", (3, 9), []), ("two", (3,), ["--stop_step=3"])):
        monkeypatch.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(*calls))
        code, out, err = run_main(args + [f"--run_dir={tmp_path / name}", *stop], capsys)
        assert code == (1 if name == "one" else 0), err
        assert "step:2/8 skipped: non-finite loss (1 of max_bad_steps=1)" in out
    monkeypatch.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(3))  # its step 5
    code, _, err = run_main([f"--resume={tmp_path / 'two'}", "--max_bad_steps=1"], capsys)
    assert code == 1 and err.startswith("error: non-finite loss at step 5;"), err


def test_a_non_finite_update_never_replaces_the_checkpoint(tmp_path, monkeypatch, capsys):
    real = torch.optim.AdamW.step
    calls = [0]

    def poisoned(self, *args, **kwargs):  # the 3rd update makes one weight inf; losses stay finite
        out = real(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            self.param_groups[1]["params"][0].data[0, 0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    code, _, err = run_main(RESUME_RUN + ["--save_every=1", f"--run_dir={tmp_path}"], capsys)
    assert code == 1
    ckpt = tmp_path / "checkpoint.pt"
    assert err == (
        f"error: non-finite weights after step 3; the checkpoint was not replaced; "
        f"last good checkpoint: {ckpt} (step 2)\n"
    )
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 2 and all(v.isfinite().all() for v in state["model"].values())
    monkeypatch.setattr(torch.optim.AdamW, "step", real)
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # it loads and trains
    assert code == 0, err
    assert torch.load(ckpt, weights_only=True)["step"] == 8


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    import builtins
    import errno

    saves = [0]

    class FullDisk:  # takes part of the data, then the disk is full
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        if os.path.basename(path).startswith("checkpoint.pt.") and str(path).endswith(".tmp"):
            saves[0] += 1
            if saves[0] == 2:
                return FullDisk(f)
        return f

    monkeypatch.setattr(support, "open", fake_open, raising=False)
    code, _, err = run_main(RESUME_RUN + ["--save_every=2", f"--run_dir={tmp_path}"], capsys)
    assert code == 1
    assert err == (
        f"error: cannot write the checkpoint of step 4 ({tmp_path / 'checkpoint.pt'}: "
        f"No space left on device); "
        f"last good checkpoint: {tmp_path / 'checkpoint.pt'} (step 2)\n"
    )
    assert not glob.glob(str(tmp_path / "checkpoint.pt.*.tmp"))  # the partial file is gone
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2
    monkeypatch.undo()  # space freed
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert code == 0, err
    assert [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"] == list(range(1, 9))


def test_a_bad_shard_met_mid_run_is_status_1_naming_the_last_checkpoint(tmp_path, capsys):
    sample = shards.read_shard(
        sorted(glob.glob(os.path.join(REPO, "data/sample/sample_train_*")))[0]
    )
    write_shard(tmp_path / "t_000001.bin", sample[:1300])  # 5 steps of 8 x 32 tokens
    write_shard(tmp_path / "t_000002.bin", [60000] * 1300)  # outside the vocabulary: found on load
    code, _, err = run_main(
        RESUME_RUN
        + [f"--train_files={tmp_path}/t_*.bin", "--save_every=2", f"--run_dir={tmp_path / 'run'}"],
        capsys,
    )
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: {tmp_path}/t_000002.bin: token id 60000 is outside"
    ) and err.endswith(f"; last checkpoint: {tmp_path / 'run' / 'checkpoint.pt'} (step 4)\n"), err


# ------------------------------------------------------ runs side by side (run_plans)


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
        runs.Plan("bad", [(fail, [])]),
        runs.Plan("two", [(wait, []), (touch, [str(tmp_path / "next")])]),
        runs.Plan("other", [(touch, [str(tmp_path / "other")])]),
    ]
    with pytest.raises(support.RunStopped, match=r"^bad: .*fail\.py exited 1: error: refused$"):
        runs.run_plans(plans, 1, jobs=2)
    assert "no other run starts: waiting for the 1 in flight" in capsys.readouterr().out
    assert not (tmp_path / "next").exists() and not (tmp_path / "other").exists()


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
        runs.run_plans([runs.Plan(str(p), [(tell, [str(p)])]) for p in out], 1, jobs)
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
    made, real = [], runs.tempfile.TemporaryFile

    def temporary_file(*args):  # the second command's files cannot be made
        while len(made) == 2 and not begun.exists():
            time.sleep(0.01)
        if len(made) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(runs.tempfile, "TemporaryFile", temporary_file)
    plans = [runs.Plan("slow", [(slow, [])]), runs.Plan("next", [(slow, [])])]
    t0 = time.monotonic()
    with pytest.raises(OSError, match="No space left"):
        runs.run_plans(plans, 1, jobs=2)
    assert saved.exists() and time.monotonic() - t0 < 30


@pytest.mark.parametrize("name", ["timed_steps", "bad_steps", "val_done"])
def test_each_counter_may_reach_the_step_but_not_pass_it(name):
    # RunState's help: timed_steps is "at most step, as bad_steps and val_done"
    runs.check_run_state(runs.RunState(run_id="ab", step=4, **{name: 4}))
    with pytest.raises(support.UserError, match=f"^{name}=5 exceeds step=4$"):
        runs.check_run_state(runs.RunState(run_id="ab", step=4, **{name: 5}))
    for run_id in ("", "AB", "a/b"):  # not os.urandom(8).hex()'s: it names files
        with pytest.raises(support.UserError, match="is not a run's"):
            runs.check_run_state(runs.RunState(run_id=run_id, step=4))


def resumable(run_dir, step=3, run_id="ab"):
    """A folder as a run that saved step `step` leaves it (no logs: expand.py's new run) ->
    the ckpt that read_checkpoint would give open_run_dir."""
    run_dir.mkdir(exist_ok=True)
    path = run_dir / runs.CHECKPOINT
    torch.save({"run_id": run_id, "step": step}, path)
    return {"run_id": run_id, "step": step, "mtime": os.stat(path).st_mtime_ns}


def test_a_resume_refuses_a_linked_or_changed_checkpoint_and_takes_a_same_step_copy(
    tmp_path, monkeypatch
):
    run = tmp_path / "run"
    try:
        ckpt = resumable(run)
        assert runs.open_run_dir(str(run), "", ckpt) == str(run)  # as read: taken
        support.release_locks()
        # replaced between its read and the lock (another job): the mtime says so
        stale = {**ckpt, "mtime": ckpt["mtime"] - 1}
        with pytest.raises(support.UserError, match="changed while this job started"):
            runs.open_run_dir(str(run), "", stale)
        support.release_locks()
        # replaced while read_checkpoint loaded it: the mtime it gives is the file's it read
        load = torch.load

        def load_then_replaced(path, **kw):
            state = load(path, **kw)
            torch.save({"run_id": "ab", "step": 4}, path)
            os.utime(path, ns=(ckpt["mtime"] + 10**9,) * 2)
            return state

        monkeypatch.setattr(torch, "load", load_then_replaced)
        read = runs.read_checkpoint(str(run), ("run_id", "step"), lambda state: None)
        monkeypatch.undo()
        assert read["step"] == 3
        with pytest.raises(support.UserError, match="changed while this job started"):
            runs.open_run_dir(str(run), "", read)
        support.release_locks()
        ckpt = resumable(run)  # (as it was)
        # a save cut after its copy of the old file (no hard links): PREVIOUS holds the same step
        (run / runs.PREVIOUS).write_bytes((run / runs.CHECKPOINT).read_bytes())
        assert runs.open_run_dir(str(run), "", ckpt) == str(run)
        support.release_locks()
        (run / runs.PREVIOUS).unlink()
        # config.json written meanwhile by another run (checked again under the lock)
        (run / "config.json").write_text('{"run_id": "cd", "job": {}}')
        with pytest.raises(support.UserError, match="belongs to another run"):
            runs.open_run_dir(str(run), "", ckpt)
        support.release_locks()
        (run / "config.json").unlink()
        # checkpoint.pt a link to a checkpoint elsewhere: the run's files are never links
        os.replace(run / runs.CHECKPOINT, tmp_path / "elsewhere.pt")
        (run / runs.CHECKPOINT).symlink_to(tmp_path / "elsewhere.pt")
        ckpt = {**ckpt, "mtime": os.stat(run / runs.CHECKPOINT).st_mtime_ns}
        with pytest.raises(support.UserError, match="checkpoint.pt is a symbolic link to a file"):
            runs.open_run_dir(str(run), "", ckpt)
    finally:
        support.release_locks()


def test_a_run_that_never_saved_is_moved_aside_each_time_beside_the_earlier(tmp_path):
    run = tmp_path / "run"
    try:
        for k in (1, 2):  # two attempts that each died before their first save
            run.mkdir(exist_ok=True)
            (run / "config.json").write_text(f'{{"run_id": "ab{k}", "job": {{}}}}')
            (run / "train.log").write_text(f"attempt {k}\n")
            assert runs.open_run_dir(str(run), "") == str(run)
            support.release_locks()
        assert (run / "aborted_1" / "train.log").read_text() == "attempt 1\n"
        assert (run / "aborted_2" / "train.log").read_text() == "attempt 2\n"
        assert not (run / "train.log").exists() and not (run / "config.json").exists()
    finally:
        support.release_locks()


def test_a_resume_note_names_only_an_earlier_previous(tmp_path):
    d, run = ranks.Dist(), runs.RunState(run_id="ab", step=3)
    torch.save({"run_id": "ab", "step": 3}, tmp_path / runs.CHECKPOINT)
    ledger = runs.Ledger(str(tmp_path), 3)
    assert runs.resume_note(d, ledger, run) == " resumed_at:3"  # none kept
    os.link(tmp_path / runs.CHECKPOINT, tmp_path / runs.PREVIOUS)  # a save cut after its link
    assert runs.resume_note(d, ledger, run) == " resumed_at:3"
    os.remove(tmp_path / runs.PREVIOUS)
    torch.save({"run_id": "ab", "step": 1}, tmp_path / runs.PREVIOUS)
    assert runs.resume_note(d, ledger, run) == (
        " resumed_at:3 (checkpoint.prev.pt, step 1, kept beside it)"
    )


class Lines:
    """A RunLog's print, kept."""

    def __init__(self):
        self.lines = []

    def print(self, text):
        self.lines.append(text)


def test_a_job_that_only_ran_the_owed_validation_says_the_run_is_complete(tmp_path):
    d, log = ranks.Dist(), Lines()
    ledger = runs.Ledger(str(tmp_path), 8)
    done = runs.RunState(run_id="ab", step=8, val_done=8)
    runs.report_end(log, d, ledger, done, 8, 8, 0, False)  # resumed at 8, validated, saved
    assert log.lines == ["the run is complete at step 8"]
    log.lines.clear()
    runs.report_end(log, d, ledger, runs.RunState(run_id="ab", step=8, val_done=4), 8, 8, 15, True)
    assert log.lines[0].startswith("stopped by signal SIGTERM at step 8 (its validation is")


def test_previous_is_a_checkpoint_from_which_a_step_trained(tmp_path, monkeypatch, capsys):
    # step 5's loss is NaN (skipped, max_bad_steps=1): step 5's save keeps no PREVIOUS, so it
    # stays step 3's, the newest from which a step (4) trained with a finite loss
    monkeypatch.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(9))  # step 5 (2 micro-steps)
    args = ["--max_bad_steps=1", "--save_every=1", "--stop_step=5", f"--run_dir={tmp_path}"]
    code, _, err = run_main(RESUME_RUN + args, capsys)
    assert code == 0, err
    trained = [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert trained == [1, 2, 3, 4]  # step 5 skipped
    newest = torch.load(tmp_path / runs.CHECKPOINT, weights_only=True)["step"]
    prev = torch.load(tmp_path / runs.PREVIOUS, weights_only=True)["step"]
    # the newest saved step s with step s + 1 trained, before the newest checkpoint
    assert newest == 5 and prev == max(s for s in range(newest) if s + 1 in trained) == 3


def test_a_checkpoints_temporary_file_is_named_by_its_run(tmp_path, monkeypatch):
    # so that a save killed half-way leaves a file that open_run_dir knows as the run's
    names, real = [], os.replace

    def replace(src, dst):
        names.append(os.path.basename(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    runs.save_checkpoint(str(tmp_path), {"run_id": "ab12", "step": 1})

    def no_links(*_):
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(os, "link", no_links)
    runs.save_checkpoint(str(tmp_path), {"run_id": "ab12", "step": 2}, keep=True)  # a copy
    assert len(names) == 3
    assert fnmatch.fnmatch(names[0], f"{runs.CHECKPOINT}.ab12.????????.tmp")
    assert fnmatch.fnmatch(names[1], f"{runs.PREVIOUS}.ab12.????????.tmp")
    assert fnmatch.fnmatch(names[2], f"{runs.CHECKPOINT}.ab12.????????.tmp")
