"""Runs (runs.py, train_gpt.py's job): run folders, logs and provenance; resume and the
checkpoints that survive a kill: tests/test_resume.py; runs side by side: tests/test_launch.py."""

import ast
import errno
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
from functools import partial

import pytest
import torch

import hub
import ranks
import runlog
import runs
import support
import train_gpt as tg
from conftest import (
    OUT_OF_MEMORY_LINES,
    REPO,
    RESUME_RUN,
    another_job_locks,
    nan_on_call,
    read_metrics,
    run_main,
    run_out_of_memory,
    sha256,
    start_command,
    val_steps,
    wait_for_line,
)

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
    run = tmp_path / "my run"  # (the advice quotes it, to be pasted)
    run.mkdir()
    (run / "train.log").write_text("an earlier run\n")
    (run / "checkpoint.pt").write_bytes(b"its checkpoint")
    code, _, err = run_main(["--preset=smoke", f"--run_dir={run}"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {run} already holds a run")
    assert err.endswith(f"continue it with train_gpt.py --resume={shlex.quote(str(run))}\n"), err
    assert (run / "train.log").read_text() == "an earlier run\n"
    assert (run / "checkpoint.pt").read_bytes() == b"its checkpoint"
    assert not (run / "metrics.jsonl").exists()


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


def test_a_run_whose_checkpoint_vanished_is_not_resumed_or_overwritten(
    tmp_path, monkeypatch, capsys
):
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
    # a log that cannot be moved aside (made immutable, say): those moved before it put back,
    # or named where one cannot go back either; a full disk as the folder is made: status 1
    real, make, aside = os.replace, os.makedirs, tmp_path / "aborted_1"

    def stuck(src, dst, back=False):
        if os.path.basename(src) == "metrics.jsonl" or (
            back and os.path.dirname(src) == str(aside)
        ):
            raise PermissionError(errno.EPERM, "Operation not permitted", src)
        real(src, dst)

    def full(path, *args, **kwargs):
        if os.path.basename(path) == "aborted_1":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        make(path, *args, **kwargs)

    for patch, status, said in (
        (dict(replace=stuck), 2, f"aside ({tmp_path / 'metrics.jsonl'}: Operation not permitted)"),
        (dict(replace=partial(stuck, back=True)), 2, f"; train.log left in {aside}: move them"),
        (dict(makedirs=full), 1, f"error: {aside}: No space left on device\n"),
    ):
        with monkeypatch.context() as m:
            for name, fake in patch.items():
                m.setattr(runs.os, name, fake)
            code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
        assert code == status and err.count("\n") == 1 and said in err, err
        if "left in" in said:  # (the one that could not go back, put back here)
            real(aside / "train.log", tmp_path / "train.log")
            aside.rmdir()
        assert files() == before and not os.path.lexists(aside)
    (tmp_path / "aborted_1").symlink_to(tmp_path / "gone")  # a broken link: that name is taken
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)  # afresh: logs kept
    assert code == 0 and "its files are in" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "aborted_2").iterdir()} == before
    # but a complete run (validated at its last step: a result, a record's folder) is not
    # started again in its folder, its checkpoint gone or not
    (tmp_path / "checkpoint.pt").unlink()
    before = files()
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tmp_path} holds a complete run (validated at its last step) and no" in err, err
    assert files() == before and not (tmp_path / "aborted_3").exists()
    # its newest gone, the one before is no way on: renamed and resumed, it would rewind it
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"an earlier step's")
    before = files()
    code, _, err2 = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert (code, err2) == (2, err) and files() == before


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


def test_memory_run_out_mid_run_or_reading_a_checkpoint_is_the_machines_limit(
    tmp_path, monkeypatch, capsys
):
    # as each of its raisers raises it: mid-run, status 1, its line naming the last checkpoint
    # as other failures' do (the first kind trains to step 4's save, each resumes from it);
    # reading or restoring a sound checkpoint (the AdamW moments moved to a full GPU), status 1
    # too, not "corrupt or incompatible" (status 2, the file blamed); a model's weights alike
    real_step = tg.train_step
    (tmp_path / "model.safetensors").write_bytes(b"")
    run, start = tmp_path / "run", RESUME_RUN + [f"--run_dir={tmp_path / 'run'}", "--save_every=4"]
    for kind, line in OUT_OF_MEMORY_LINES.items():

        def exhausted(*args, kind=kind):
            if args[-1] == 5:  # (step)
                run_out_of_memory(kind)
            return real_step(*args)

        def no_room(*args, kind=kind, **kwargs):
            run_out_of_memory(kind)

        with monkeypatch.context() as m:
            m.setattr(tg, "train_step", exhausted)
            code, _, err = run_main(start if kind == "python" else [f"--resume={run}"], capsys)
        assert code == 1 and err.endswith(
            f"error: {line}; last checkpoint: {run}/checkpoint.pt (step 4)\n"
        ), err
        assert (run / "train.log").read_text().endswith(f"error: {line}\n")  # (as other errors')
        for patched in ((runs, "load_tensors"), (torch.optim.Optimizer, "load_state_dict")):
            with monkeypatch.context() as m:
                m.setattr(*patched, no_room)
                code, _, err = run_main([f"--resume={run}"], capsys)
            assert (code, err[err.index("error: ") :]) == (1, f"error: {line}\n"), err
        with monkeypatch.context() as m:  # (nor is a checkpoint's step then "none")
            m.setattr(runs, "load_tensors", no_room)
            with pytest.raises((MemoryError, RuntimeError)) as raised:
                runs.saved_step(str(run / "checkpoint.pt"), "any run")
        assert support.out_of_memory(raised.value) == line
        with monkeypatch.context() as m:
            m.setattr("safetensors.torch.load_file", no_room)
            with pytest.raises((MemoryError, RuntimeError)) as raised:
                hub.read_weights(str(tmp_path / "model.safetensors"), "model.safetensors")
        assert support.out_of_memory(raised.value) == line


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
    # a RunStopped leaving the log's with: its error line in train.log too, not on stdout
    # (support.cli prints it on stderr: not twice on a terminal), both files closed; another
    # rank's log (inactive) writes and opens nothing
    config = {**runlog.provenance(), "command": "python train_gpt.py"}
    with pytest.raises(support.RunStopped):
        with runlog.RunLog(str(tmp_path), config, True) as log:
            log.record({"kind": "train", "step": 1})
            raise support.RunStopped("disk full; last checkpoint: none")
    said = "\nerror: disk full; last checkpoint: none\n"
    assert (tmp_path / "train.log").read_text().endswith(said)
    assert log.log.closed and log.metrics.closed
    for error, said in (  # a job's other failures mid-run (a bad shard, a full disk) too
        (support.UserError("a bad shard"), "a bad shard"),
        (support.UserError("shard_\udcff.bin: bad\nnews"), "shard_\\udcff.bin: bad\\nnews"),
        (
            OSError(errno.ENOSPC, "No space left on device", "f.bin"),
            "f.bin: No space left on device",
        ),
    ):
        with pytest.raises(type(error)):
            with runlog.RunLog(str(tmp_path / "failed"), config, True):
                raise error
        assert (tmp_path / "failed" / "train.log").read_text().endswith(f"\nerror: {said}\n")

    def full(line):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(support.RunStopped, match="cannot write the checkpoint"):  # as it was
        with runlog.RunLog(str(tmp_path / "full"), config, True) as log:
            log.log.write = full  # (its line cannot be written)
            raise support.RunStopped("cannot write the checkpoint of step 4; last checkpoint: x")
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1}]
    other = tmp_path / "other"
    other.mkdir()
    with runlog.RunLog(str(other), config, False) as quiet:
        quiet.print("a line")
        quiet.record({"kind": "train", "step": 1})
    assert os.listdir(other) == []
    assert capsys.readouterr().out == ""


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
    mine += [b'{"kind": "val", "step": 3.5}\n']  # (no whole step: not ours, runlog.ours)
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


def test_a_saved_step_is_a_whole_number_in_a_checkpoint_of_the_run(tmp_path):
    # (its callers compare steps: a bool is an int to isinstance, and True would be step 1)
    path = tmp_path / "ckpt.pt"
    for step, run_id, read in (
        (3, "ab", 3),
        (True, "ab", None),
        (3.0, "ab", None),
        (3, "cd", None),
    ):
        torch.save({"run_id": run_id, "step": step}, path)
        assert runs.saved_step(str(path), "ab") == read, (step, run_id)
    os.symlink(path, tmp_path / "link.pt")  # never opened through a link
    torch.save({"run_id": "ab", "step": 3}, path)
    assert runs.saved_step(str(tmp_path / "link.pt"), "ab") is None
    path.write_bytes(b"not a checkpoint")
    assert runs.saved_step(str(path), "ab") is None


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
