"""Files that are not ours: never rewritten, replaced, moved or read without bound; a full disk
leaves what was there."""

import builtins
import csv
import errno
import glob
import hashlib
import io
import json
import os
import re
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import fileio
import ranks
import runlog
import runs
import support
from conftest import (
    AUTHORS_TINY,
    REPO,
    RESUME_RUN,
    TINY_RUN,
    TRAIN_ON_SAMPLE,
    another_job_locks,
    authors_copy,
    disk_nearly_full,
    load_command,
    note_syncs,
    run_command,
    run_main,
    sha256,
)

# ------------------------------------------------------- run folders and their logs


@pytest.mark.slow
def test_a_folder_that_is_not_a_runs_is_refused_as_run_dir_nothing_moved(tmp_path, capsys):
    # a new run moves aside only the logs of a run of ours that never saved (its config.json
    # has its run_id and job); an export folder (a model), a user's config.json, logs with no
    # config.json: one line, exit 2, every file where and as it was (issue 58)
    folders = {
        "export": {"model.safetensors": b"", "config.json": b'{"format": "train_gpt"}'},
        "users": {"config.json": b'{"lr": 1}', "notes.txt": b"mine"},
        "logs_only": {"train.log": b"my log", "checkpoint.pt.abcdefgh.tmp": b"mine"},
        "not_json": {"config.json": b"{not json", "metrics.jsonl": b"{}"},
        "run_id_only": {  # (not its kill's leftover either: not removed)
            "config.json": b'{"run_id": "ab12"}',
            "train.log": b"x",
            "checkpoint.pt.ab12.abcdefgh.tmp": b"mine",
        },
    }
    said = {}
    for name, files in folders.items():
        folder = tmp_path / name
        folder.mkdir()
        for file, data in files.items():
            (folder / file).write_bytes(data)
        code, out, said[name] = run_main(TINY_RUN + [f"--run_dir={folder}"], capsys)
        assert code == 2 and said[name].count("\n") == 1, (name, said[name])
        assert "nothing was moved" in said[name], (name, said[name])
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files, name
    # why not a run's: said of the config.json that is there, or of the one that is not
    users, logs = said["users"], said["logs_only"]
    assert "users holds config.json, not a run's of this project (its config.json lacks a" in users
    assert "logs_only holds train.log, not a run's of this project (no config.json" in logs
    model = Path(authors_copy(tmp_path, "model"))  # a run from a model, into its own folder
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    code, _, err = run_main(
        [f"--init_from={model}", f"--run_dir={model}", *TRAIN_ON_SAMPLE], capsys
    )
    assert code == 2 and "holds a model (model.safetensors), not a run" in err, err
    code, out, err = run_main([f"--resume={model}"], capsys)  # (resumed: what is there instead)
    said = f"error: {model}: no checkpoint (checkpoint.pt) in it; it holds a model"
    assert (code, out, err) == (2, "", f"{said} (model.safetensors), not a run\n")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_a_linked_log_is_refused_before_anything_is_written(tmp_path):
    theirs = tmp_path / "elsewhere.jsonl"
    theirs.write_text('{"kind": "note"}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(theirs)
    with pytest.raises(support.UserError, match="metrics.jsonl is a symbolic link to a file, not"):
        runs.open_run_dir(str(run), "x")
    assert os.listdir(run) == ["metrics.jsonl"] and (run / "metrics.jsonl").is_symlink()
    assert theirs.read_text() == '{"kind": "note"}\n'


def test_a_resume_keeps_a_users_lines_whatever_their_step(tmp_path):
    ours = [
        {"kind": "train", "step": 9},
        {"kind": "val", "step": 10},
        {"kind": "checkpoint", "step": 10},
        {"kind": "train", "step": 15},  # past the checkpoint: dropped
    ]
    users = [{"kind": "note", "step": 15}, {"step": 99}, [1, 2], "just text"]
    lines = [json.dumps(m) for m in ours[:2] + users[:2] + ours[2:] + users[2:]]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n" + "[" * 100000 + "\n")
    kept = runlog.kept_metrics(str(tmp_path / "m.jsonl"), 10, 10).decode().splitlines()
    assert kept[-1] == "[" * 100000  # a user's line too deep to parse: kept, no traceback
    assert [json.loads(line) for line in kept[:-1]] == ours[:2] + users[:2] + [ours[2]] + users[2:]


def test_a_resume_drops_a_validation_and_a_warm_up_its_checkpoint_did_not_see(tmp_path):
    # saved at step 4 before its validation there (val_done 0): that validation goes with the
    # records past step 4, a warm-up's among them; a user's line that is no JSON stays whole
    saw = [
        {"kind": "val", "step": 0},
        {"kind": "warmup", "step": 1},
        {"kind": "train", "step": 4},
    ]
    not_seen = [
        {"kind": "val", "step": 4},
        {"kind": "warmup", "step": 6},
        {"kind": "train", "step": 5},
    ]
    mine = '{"kind": my own note}'
    lines = [json.dumps(m) for m in saw] + [mine] + [json.dumps(m) for m in not_seen]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    kept = runlog.kept_metrics(str(tmp_path / "m.jsonl"), 4, 0).decode().splitlines()
    assert kept == [json.dumps(m) for m in saw] + [mine, '{"kind": "checkpoint", "step": 4}']


def test_metrics_are_read_up_to_their_bound_and_none_is_a_first_record(tmp_path, monkeypatch):
    # MAX_METRICS_BYTES (64 here): a file of that size is read, one byte more refused; no
    # metrics.jsonl yet (expand.py's new run): the checkpoint's record alone
    monkeypatch.setattr(runlog, "MAX_METRICS_BYTES", 64)
    path = str(tmp_path / "metrics.jsonl")
    record = b'{"kind": "checkpoint", "step": 3}\n'
    assert runlog.kept_metrics(path, 3, 3) == record
    note = b"x" * 63 + b"\n"
    (tmp_path / "metrics.jsonl").write_bytes(note)
    assert runlog.kept_metrics(path, 3, 3) == note + record
    (tmp_path / "metrics.jsonl").write_bytes(b"x" + note)
    with pytest.raises(support.UserError, match="more than a run's metrics"):
        runlog.kept_metrics(path, 3, 3)


@pytest.mark.slow
def test_a_resume_refuses_metrics_beyond_any_runs_before_it_writes(tmp_path, capsys):
    # metrics.jsonl is read whole on a resume: past runlog.MAX_METRICS_BYTES (a sparse file
    # here) it is not a run's, refused in one line before config.json or train.log changes
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=1"], capsys)
    assert code == 0, err
    before = {n: (tmp_path / n).read_bytes() for n in ("config.json", "train.log")}
    os.truncate(tmp_path / "metrics.jsonl", runlog.MAX_METRICS_BYTES + 1)
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert (code, err) == (
        2,
        f"error: {tmp_path / 'metrics.jsonl'} is over 1 GiB, more than a run's metrics: not "
        f"this run's to rewrite (move it away to resume; nothing was written)\n",
    )
    assert {n: (tmp_path / n).read_bytes() for n in before} == before


def test_the_put_back_takes_only_an_older_checkpoint_of_the_same_run(tmp_path):
    d = ranks.Dist(device="cpu")
    newest = {"run_id": "aa", "step": 10}
    cases = [  # (what checkpoint.prev.pt is, whether it is put back)
        ({"run_id": "bb", "step": 5}, False),  # another run's
        ({"run_id": "aa", "step": 12}, False),  # newer than the newest
        ("fifo", False),  # a named pipe: never opened (no hang)
        ({"run_id": "aa", "step": 5}, True),
    ]
    for i, (prev, put_back) in enumerate(cases):
        run = tmp_path / str(i)
        run.mkdir()
        torch.save(newest, run / runs.CHECKPOINT)
        if prev == "fifo":
            os.mkfifo(run / runs.PREVIOUS)
        else:
            torch.save(prev, run / runs.PREVIOUS)
        said = runs.last_good(d, runs.Ledger(str(run), 10), "aa")
        step = torch.load(run / runs.CHECKPOINT, weights_only=True)["step"]
        if put_back:
            assert step == 5 and not (run / runs.PREVIOUS).exists() and "(step 5, put back" in said
        else:
            assert step == 10 and os.path.lexists(run / runs.PREVIOUS), prev
            newest_named = f"{run / runs.CHECKPOINT} (step 10)"
            assert said.startswith(f"none: no step from the newest, {newest_named}, had a finite")


# -------------------------------------------------------------------------- outputs


def test_an_outputs_record_that_is_not_ours_is_refused_before_any_work(tmp_path, capsys):
    bench = load_command("bench.py")
    (tmp_path / "mine.json").write_text('{"bench.md": "' + "0" * 64 + '"}')
    variants = {
        "a user's JSON object": lambda p: p.write_text('{"note": "my own record"}'),
        "a link to a user's file": lambda p: p.symlink_to(tmp_path / "mine.json"),
        "a folder": lambda p: p.mkdir(),
        "a link to a device": lambda p: p.symlink_to("/dev/zero"),  # (never read: no bound)
        "a named pipe": lambda p: os.mkfifo(p),
        "too large": lambda p: p.write_text('{"a": "' + "0" * (2 << 20) + '"}'),
    }
    for i, (what, make) in enumerate(variants.items()):
        out = tmp_path / f"out{i}"
        out.mkdir()
        make(out / fileio.OUTPUTS)
        before = sorted(os.listdir(out))
        code, _, err = run_main([f"--out={out}"], capsys, bench.main)
        assert code == 2 and err.count("\n") == 1, (what, err)
        assert "is not a record this project wrote" in err, (what, err)
        assert sorted(os.listdir(out)) == before, what
    assert json.loads((tmp_path / "mine.json").read_text()) == {"bench.md": "0" * 64}


@pytest.mark.slow
def test_an_output_name_taken_by_what_bench_did_not_write_is_refused_before_the_work(tmp_path):
    (tmp_path / "b" / "bench.md").mkdir(parents=True)
    (tmp_path / "b" / "bench.json").write_text("{}")  # a user's, though .outputs.json says ours
    (tmp_path / "b" / ".outputs.json").write_text('{"bench.json": "%s"}' % sha256(b"{ }"))
    for taken, kind in (("bench.md", "a folder"), ("bench.json", "a file")):
        r = run_command("bench.py", f"--out={tmp_path / 'b'}", timeout=120)
        assert (
            r.returncode == 2
            and r.stdout == ""
            and r.stderr
            == (
                f"error: {tmp_path / 'b' / taken} is there ({kind}) and this command did not write "
                "it, or it changed since: move it or write elsewhere; nothing was written\n"
            )
        ), r.stderr
        if taken == "bench.md":
            (tmp_path / "b" / "bench.md").rmdir()
    (tmp_path / "c").mkdir()  # a user's own file of the record's name is not replaced either
    (tmp_path / "c" / ".outputs.json").write_text("my notes")
    r = run_command("bench.py", f"--out={tmp_path / 'c'}", timeout=120)
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and "is not a record this project wrote: move it" in r.stderr
        and (tmp_path / "c" / ".outputs.json").read_text() == "my notes"
    ), r.stderr
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".outputs.json"]
    (tmp_path / "d").mkdir()  # nor a user's profile.md by --profile's
    (tmp_path / "d" / "profile.md").write_text("my profile")
    r = run_command("bench.py", "--profile=1", f"--out={tmp_path / 'd'}", timeout=120)
    assert r.returncode == 2 and r.stderr == (
        f"error: {tmp_path / 'd' / 'profile.md'} is there (a file) and this command did not "
        "write it, or it changed since: move it or write elsewhere; nothing was written\n"
    )
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["profile.md"]


def test_remove_output_removes_only_an_unchanged_file_of_ours(tmp_path):
    # an output a rerun does not make again (bench.py's profile.md without --profile): removed
    # while unchanged, its digest then dropped; edited since, or a link, it stays; a digest whose
    # file is gone (a cut between the two) is dropped
    def link(p):
        p.unlink()
        p.symlink_to(tmp_path / "x.md")

    cases = {
        "ours, unchanged": (lambda p: None, False),
        "ours, edited since": (lambda p: p.write_text("my edit"), True),
        "a link in its place": (link, True),
        "gone already": (lambda p: p.unlink(), False),
    }
    (tmp_path / "x.md").write_text("ours")  # (the link's target)
    for i, (what, (change, kept)) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        fileio.write_output(str(out), "profile.md", b"ours", by="bench.py")
        fileio.write_output(str(out), "bench.md", b"table", by="bench.py")
        change(out / "profile.md")
        fileio.remove_output(str(out), "profile.md", by="bench.py")
        assert os.path.lexists(out / "profile.md") == kept, what
        assert (out / "bench.md").read_bytes() == b"table"  # (and its digest kept)
        entry = fileio.written_outputs(str(out)).get("bench.md")
        assert entry == {"by": "bench.py", "sha256": sha256(b"table")}, what
        # (a digest kept matches no file there: a later run refuses the file, as a user's)
        assert ("profile.md" in fileio.written_outputs(str(out))) == kept, what
    assert (tmp_path / "x.md").read_text() == "ours"


def test_a_command_replaces_or_removes_only_the_outputs_it_wrote_itself(tmp_path):
    # OUTPUTS names the command that wrote each file: to another command, one of the same name
    # is a user's (skipview.py --out= an export's weights, bench.py's profile.md where skipview.py
    # wrote one): refused, at the start and at the write, never replaced nor removed. A command is
    # named by its file's name; an older version's record named none: its files are no command's
    out = str(tmp_path / "out")
    fileio.write_output(out, "profile.md", b"a page", by="skipview.py")
    fileio.write_output(out, "bench.md", b"a table", by=os.path.join(REPO, "bench.py"))
    with pytest.raises(support.UserError, match="profile.md is there .a file. and this command"):
        fileio.writable_dir(out, ("bench.md", "profile.md"), by="bench.py")
    fileio.remove_output(out, "profile.md", by="bench.py")
    assert (tmp_path / "out" / "profile.md").read_bytes() == b"a page"
    fileio.writable_dir(out, ("profile.md",), by="skipview.py")  # each its own
    fileio.writable_dir(out, ("bench.md",), by="bench.py")
    fileio.write_output(out, "bench.md", b"another table", by="bench.py")
    fileio.remove_output(out, "profile.md", by="skipview.py")
    assert sorted(os.listdir(out)) == [fileio.OUTPUTS, "bench.md"]
    assert fileio.written_outputs(out) == {
        "bench.md": {"by": "bench.py", "sha256": sha256(b"another table")}
    }
    late = str(tmp_path / "late")  # checked at a long run's start, another's by its end
    fileio.writable_dir(late, ("table.md",), by="sweep.py")
    fileio.write_output(late, "table.md", b"a page", by="skipview.py")
    with pytest.raises(support.UserError, match="did not write it, or it changed since: not repl"):
        fileio.write_output(late, "table.md", b"a table", by="sweep.py")
    assert (tmp_path / "late" / "table.md").read_bytes() == b"a page"
    old = tmp_path / "old"  # as an older version left it
    old.mkdir()
    (old / "bench.md").write_text("a table")
    (old / fileio.OUTPUTS).write_text(json.dumps({"bench.md": sha256(b"a table")}))
    with pytest.raises(support.UserError, match="is an older version's, which names no command"):
        fileio.writable_dir(str(old), ("bench.md",), by="bench.py")
    fileio.remove_output(str(old), "bench.md", by="bench.py")
    assert (old / "bench.md").read_text() == "a table"


def test_one_command_at_a_time_writes_a_folder_of_outputs(tmp_path, monkeypatch, capsys):
    # the folder's lock held by another job: a command's check of the folder before its work
    # (writable_dir, where the folder is there), or its first write (write_output,
    # remove_output) is refused before anything is written; its own first takes the lock and
    # keeps it to the command's end; where the file system takes no lock, a note, and the write
    # goes on
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    fileio.writable_dir(str(out / "new"), ("bench.md",), by="bench.py")  # (none there to lock)
    other = another_job_locks(out)
    calls = {
        "check": lambda: fileio.writable_dir(str(out), ("bench.md",), by="bench.py"),
        "write": lambda: fileio.write_output(str(out), "bench.md", b"table", by="bench.py"),
        "remove": lambda: fileio.remove_output(str(out), "mine.txt", by="bench.py"),
    }
    try:
        for when, call in calls.items():
            with pytest.raises(support.UserError, match=f"{out} is in use by another job"):
                call()
            assert os.listdir(out) == ["mine.txt"], when
    finally:
        os.close(other)
    fileio.writable_dir(str(out), ("bench.md",), by="bench.py")
    assert another_job_locks(out) is None  # held by this job till it is over
    fileio.write_output(str(out), "bench.md", b"table", by="bench.py")
    fileio.write_output(str(out), "bench.json", b"{}", by="bench.py")  # (its own: no refusal)
    support.release_locks()
    os.close(another_job_locks(out))

    def no_locks(fd, operation):  # (a file system without them)
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(support.fcntl, "flock", no_locks)
    fileio.write_output(str(out), "bench.md", b"another table", by="bench.py")
    fileio.write_output(str(out), "bench.json", b"[]", by="bench.py")
    assert (out / "bench.md").read_bytes() == b"another table"
    assert capsys.readouterr().err == (  # (once)
        f"note: {out} cannot be locked (No locks available): nothing keeps another job from "
        f"writing there meanwhile\n"
    )


def test_two_threads_of_one_command_take_its_folder_once(tmp_path, monkeypatch):
    # (the fetch's downloads): the second finds the folder held by the first, not by another job
    flock, errors = support.fcntl.flock, []

    def slow(fd, operation):  # both threads past the look before either takes it
        time.sleep(0.1)
        flock(fd, operation)

    def lock():
        try:
            support.lock_folder(str(tmp_path))
        except support.UserError as e:
            errors.append(e)

    monkeypatch.setattr(support.fcntl, "flock", slow)
    threads = [threading.Thread(target=lock) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(support.held_locks) == 1


@pytest.mark.slow
def test_what_a_command_did_not_write_stays_as_it_is(tmp_path, capsys, monkeypatch):
    # a resume leaves a checkpoint.prev.pt that is not an earlier one of its run where it is:
    # another run's, or a later step's of this run (the checkpoint put back by hand, say)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('\ufeff{"run_id": "aa"}')  # (a BOM, as an editor saves it)
    ckpt = {"run_id": "aa", "step": 10}
    torch.save(ckpt, run / runs.CHECKPOINT)
    runs.check_previous(str(run), ckpt)  # none there: fine
    for prev, fine in (
        ({"run_id": "aa", "step": 4}, True),
        ({"run_id": "aa", "step": 10}, True),
        ({"run_id": "bb", "step": 4}, False),
        ({"run_id": "aa", "step": 11}, False),
    ):
        torch.save(prev, run / runs.PREVIOUS)
        if fine:
            runs.check_previous(str(run), ckpt)
        else:
            with pytest.raises(support.UserError, match="not an earlier checkpoint of this run"):
                runs.check_previous(str(run), ckpt)
    (run / runs.PREVIOUS).write_text("my notes")
    with pytest.raises(support.UserError, match="not an earlier checkpoint of this run"):
        runs.check_previous(str(run), ckpt)
    # a linked checkpoint is not the run's own file: a resume refuses it
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / runs.CHECKPOINT).symlink_to(run / runs.CHECKPOINT)
    with pytest.raises(support.UserError, match="checkpoint.pt is a symbolic link to a file"):
        runs.open_run_dir(str(tmp_path / "new"), "x", {**ckpt, "mtime": 0})
    # export.py reads a run's logs only as files (a named pipe would block it): refused
    os.mkfifo(tmp_path / "fifo_run_metrics")
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "metrics.jsonl").symlink_to(tmp_path / "fifo_run_metrics")
    with pytest.raises(OSError, match="not a regular file: a symbolic link to a named pipe"):
        load_command("export.py").last_validation(str(tmp_path / "r2"), 0)
    # skipview.py --out never replaces a user's file of that name
    skipview = load_command("skipview.py")
    (tmp_path / "notes.html").write_text("mine")
    argv = [f"--init_from={AUTHORS_TINY}", "--text=a few words", f"--out={tmp_path}/notes.html"]
    code, _, err = run_main(argv, capsys, skipview.main)
    assert code == 2 and "did not write it" in err, err
    assert (tmp_path / "notes.html").read_text() == "mine"
    fileio.write_output(str(tmp_path / "e"), "model.safetensors", b"weights", by="export.py")
    argv[-1] = f"--out={tmp_path}/e/model.safetensors"  # nor another command's (an export's)
    code, _, err = run_main(argv, capsys, skipview.main)
    assert code == 2 and "did not write it" in err, err
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == b"weights"
    for folder in ("pages/", "pages/."):  # a folder's name is no page's
        argv[-1] = f"--out={tmp_path}/{folder}"
        code, _, err = run_main(argv, capsys, skipview.main)
        assert code == 2 and "is a folder's name; give a file name" in err, err
        assert not (tmp_path / "pages").exists()
    argv[-1] = f"--out={tmp_path}/page/{fileio.OUTPUTS}"  # nor the record of what it wrote
    code, _, err = run_main(argv, capsys, skipview.main)
    assert code == 2 and "that name is the folder's record" in err, err
    assert not (tmp_path / "page").exists()
    # a runs.csv saved with a BOM (as a spreadsheet does) is read as it is
    csv_path = sorted(glob.glob(os.path.join(REPO, "records", "*", "runs.csv")))[-1]
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "runs.csv").write_bytes(b"\xef\xbb\xbf" + Path(csv_path).read_bytes())
    sweep = load_command("sweep.py")
    code, _, err = run_main([f"--report={tmp_path / 'report' / 'runs.csv'}"], capsys, sweep.main)
    assert code == 0, err
    # a runs.csv cut short, too large to be one, or with values no run has, is refused naming
    # what is wrong (issue 58), before anything is written
    whole = Path(csv_path).read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[0]  # (without its last row)

    def edited(key, change, first=None):
        # the record's runs.csv, change applied to each row's key (or to the first rows' only)
        rows = list(csv.DictReader(io.StringIO(whole.decode())))
        text = io.StringIO()
        w = csv.DictWriter(text, list(rows[0]), lineterminator="\n")
        w.writeheader()
        changed = rows[:first] if first else rows
        w.writerows([{**r, key: change(r[key])} for r in changed] + rows[len(changed) :])
        return text.getvalue().encode()

    shares = "gate_zero and target_zero: a share in [0, 1] per gated block each"
    for i, (data, message) in enumerate(
        [
            (whole[:-40], "its last row is not ended: the file was cut short"),
            (last + b"\n" + b"dense,1,2\n", "not as many fields as the header: cut short?"),
            (None, "over 64 MiB: not a runs.csv of sweep.py"),
            (whole.split(b"\n", 1)[0] + b"\n", "runs.csv: a runs.csv with no run in it"),
            (b"name,seed\n", "not a runs.csv of sweep.py (columns: name, seed, val_loss"),
            (edited("target_zero", lambda v: " ".join(v.split()[:2])), shares),
            (edited("gate_zero", lambda v: v.replace("0.", "x.", 1)), shares),
            (edited("gate_zero", lambda v: v.replace("0.", "2.", 1)), shares),
            (edited("params", lambda v: "1" + "0" * 400), "0000 must lie in [0, 1e100)"),
            (edited("val_loss", lambda v: "1e308"), "val_loss=1e+308 must lie in [0, 1e100)"),
            (edited("sparsity", lambda v: "1.5"), "sparsity=1.5 must lie in [0, 1]"),
            (edited("ms_per_token_masked", lambda v: "-1"), "=-1.0 must lie in [0, 1e100)"),
            (edited("flops_per_token", lambda v: "0"), "=0.0 must lie in (0, 1e100)"),
            (edited("corpus_sha256", lambda v: "0" * 64, 1), "runs differ in corpus_sha256"),
            (edited("encoding", lambda v: "gpt2", 1), "its runs differ in encoding: one study's"),
        ]
    ):
        (tmp_path / f"cut{i}").mkdir()
        path = tmp_path / f"cut{i}" / "runs.csv"
        if data is None:  # sparse: no disk used
            with open(path, "wb") as f:
                f.truncate(65 << 20)
        else:
            path.write_bytes(data)
        code, _, err = run_main([f"--report={path}"], capsys, sweep.main)
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert os.listdir(path.parent) == ["runs.csv"]
    # the report's figure is drawn before anything is written: a failure there writes nothing
    monkeypatch.setattr(sweep, "figure", lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sweep.write_report(str(tmp_path / "cut0"), sweep.read_runs(csv_path))
    assert os.listdir(tmp_path / "cut0") == ["runs.csv"]


def test_a_runs_csv_s_edge_values_are_read_and_its_faults_refused(tmp_path):
    # a record's runs.csv: a zero share of exactly 1 and a block with no target (none) are read,
    # the block without a target has no gap; an empty val_loss, a row longer than the header
    # and a run twice are refused, naming what is wrong
    sweep = load_command("sweep.py")
    csv_path = sorted(glob.glob(os.path.join(REPO, "records", "*", "runs.csv")))[-1]
    rows = list(csv.DictReader(io.StringIO(Path(csv_path).read_text())))
    i = next(i for i, r in enumerate(rows) if r["gate_zero"])
    zero, target = rows[i]["gate_zero"].split(), rows[i]["target_zero"].split()

    def written(rows, tail=""):
        text = io.StringIO()
        w = csv.DictWriter(text, list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        (tmp_path / "runs.csv").write_text(text.getvalue().removesuffix("\n") + tail + "\n")
        return str(tmp_path / "runs.csv")

    edge = dict(rows[i], gate_zero=" ".join(["1.0000", *zero[1:]]))
    edge["target_zero"] = " ".join(["none", *target[1:]])
    read = sweep.read_runs(written(rows[:i] + [edge] + rows[i + 1 :]))
    assert read[i]["gate_zero"] == edge["gate_zero"]
    gaps = [abs(float(z) - float(t)) for z, t in zip(zero[1:], target[1:], strict=True)]
    assert sweep.off_target(read[i]) == f"{max(gaps):.4f}"
    for bad, tail, message in (
        ([dict(rows[0], val_loss="")] + rows[1:], "", ":2: val_loss is empty"),
        (rows, ",1", f":{len(rows) + 1}: not as many fields as the header"),
        (rows + rows[:1], "", "a (name, seed) appears twice; one row per run"),
        (rows + [dict(rows[0], val_loss="9.5")], "", "a (name, seed) appears twice; one row"),
        ([dict(rows[0], val_loss="1_0.4")] + rows[1:], "", ":2: val_loss='1_0.4' is not a num"),
        ([dict(rows[0], seed="1_0")] + rows[1:], "", ":2: seed='1_0' is not a number"),
        ([dict(rows[0], val_se=" 0.01")] + rows[1:], "", ":2: val_se=' 0.01' is not a number"),
        ([dict(rows[0], seed="\u0663")] + rows[1:], "", ":2: seed='\u0663' is not a number"),
        ([dict(rows[0], val_loss="nan")] + rows[1:], "", ":2: val_loss='nan' is not a number"),
        ([dict(rows[0], name=" ")] + rows[1:], "", ":2: a run with no name"),
    ):
        with pytest.raises(support.UserError, match=re.escape(message)):
            sweep.read_runs(written(bad, tail))


@pytest.mark.slow
def test_counts_have_bounds_and_messages_name_what_the_user_has(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("thirty short lines\n" * 30)
    r = run_command(  # a worker per CPU at most: never thousands of processes
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        f"--out={tmp_path / 's'}",
        "--workers=100000",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--workers" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()
    sweep = load_command("sweep.py")  # an empty range of seeds: refused, no folder made
    argv = ["--seeds=2", "--first_seed=2", f"--runs={tmp_path / 'r'}", f"--out={tmp_path / 'o'}"]
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 2 and err.startswith("error: "), err
    assert not (tmp_path / "r").exists() and not (tmp_path / "o").exists()
    # debian_docs.py names its own options (it has --out, no --name)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "docs_train_000001.bin").write_bytes(b"a user's file")
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'd'}", "--unpinned")
    assert r.returncode == 2 and "choose another --out; nothing" in r.stderr, r.stderr
    assert "--name" not in r.stderr and r.stderr.count("\n") == 1
    # a symbolic link is called one
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    assert fileio.kind_of(str(tmp_path / "link")) == "a symbolic link to a file"
    # an error writing a file names it, never the temporary file beside it (deleted by then)
    (tmp_path / "target").mkdir()
    with pytest.raises(OSError) as e:
        fileio.write_atomically(str(tmp_path / "target"), b"data")
    assert e.value.filename == str(tmp_path / "target") and ".tmp" not in str(e.value)
    assert not glob.glob(str(tmp_path / "target.*.tmp"))
    # a named pipe where debian_docs.py's manifest would be: refused at once, never opened
    (tmp_path / "p").mkdir()
    os.mkfifo(tmp_path / "p" / "docs.manifest.json")
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'p'}", "--unpinned")
    assert r.returncode == 2 and "docs.manifest.json is the manifest" in r.stderr, r.stderr
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text("[" * 100000)
    assert runs.logged(str(tmp_path / "deep")) is None  # too deep: no run_id, no traceback


# ----------------------------------------------------------------------- full disks


@pytest.mark.slow
def test_a_full_disk_is_found_before_the_work_and_leaves_nothing(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'run'}", "--stop_step=1"], capsys)
    assert code == 0, err
    (tmp_path / "t.txt").write_text("some text " * 50)
    out = tmp_path / "out" / "deeper"
    for cmd in (
        ["train_gpt.py", *RESUME_RUN, f"--run_dir={out}"],
        ["bench.py", f"--out={out}"],
        ["sweep.py", "--grid=cpu", f"--out={out}"],
        ["skipview.py", str(tmp_path / "run"), f"--out={out}/page.html"],
        ["data/tokenize_corpus.py", str(tmp_path / "t.txt"), f"--out={out}"],
        [os.path.join("data", "cached_fineweb10B.py"), "1", f"--out={out}"],
    ):
        r = run_command(*cmd, timeout=300, preexec_fn=disk_nearly_full, env={"HF_HUB_OFFLINE": "1"})
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert r.stderr.startswith(f"error: {out}") and "File too large" in r.stderr, (
            cmd,
            r.stderr,
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "t.txt"], cmd  # nothing left


def test_a_disk_that_fills_mid_write_names_the_file_and_keeps_what_was_there(tmp_path):
    big = tmp_path / "big.txt"  # 1.2M tokens: shards of 1M tokens are 2 MB, over the limit
    big.write_text(" word" * 1_200_000)
    tokenize = ("data/tokenize_corpus.py", str(big), f"--out={tmp_path / 's'}", "--workers=1")
    r = run_command(*tokenize, "--shard_tokens=1000000")
    assert r.returncode == 0, r.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    r = run_command(
        *tokenize,
        "--shard_tokens=1000000",
        timeout=300,
        preexec_fn=lambda: disk_nearly_full(3 << 19),
    )
    assert r.returncode == 1, r.stderr
    assert (
        r.stderr.splitlines()[-1]
        == f"error: {tmp_path / 's' / 'corpus_val_000000.bin'}: File too large"
    )
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before


# ------------------------------------------------------------ reading without bound


@pytest.mark.slow
def test_sha256_of_streams_a_large_file_in_bounded_memory(tmp_path):
    # a 3 GiB file, sparse (no disk used), with bytes at both ends: the peak of what Python
    # allocates while hashing it (tracemalloc) must stay far below the file's size
    path = tmp_path / "big.bin"
    size = 3 << 30
    with open(path, "wb") as f:
        f.write(b"head")
        f.truncate(size - 4)
        f.seek(size - 4)
        f.write(b"tail")
    tracemalloc.start()
    try:
        digest = fileio.sha256_of(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    reference, zeros = hashlib.sha256(b"head"), bytes(1 << 20)
    left = size - 8
    while left:
        reference.update(zeros[: min(left, len(zeros))])
        left -= min(left, len(zeros))
    reference.update(b"tail")
    assert digest == reference.hexdigest()
    assert peak < 64 << 20, peak  # under 64 MiB for 3 GiB


def test_a_write_cut_by_a_signal_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    class Signalled:  # a source that a second signal cuts (KeyboardInterrupt, not an Exception)
        def __init__(self):
            self.calls = 0

        def read(self, n=-1):
            self.calls += 1
            if self.calls > 1:
                raise KeyboardInterrupt
            return b"new part"

    with pytest.raises(KeyboardInterrupt):
        fileio.write_atomically(str(target), Signalled())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    assert target.read_bytes() == b"old"


def test_a_file_written_atomically_is_on_disk_before_its_name_and_its_name_after(
    tmp_path, monkeypatch
):
    # after a power cut a checkpoint is the old one or all of the new: the new file's data, all
    # of it, is synced before the rename gives it the name, and the folder (the rename) after
    # it; each file known by its inode and size, as the OS gives them
    events, replace = [], os.replace

    def renamed(src, dst):
        events.append(("rename", os.stat(src).st_ino))
        replace(src, dst)

    note_syncs(monkeypatch, events)
    monkeypatch.setattr(os, "replace", renamed)
    (tmp_path / "out.bin").write_bytes(b"old")
    fileio.write_atomically(str(tmp_path / "out.bin"), b"new")
    monkeypatch.undo()
    new, folder = (tmp_path / "out.bin").stat().st_ino, tmp_path.stat().st_ino
    assert events == [(new, 3), ("rename", new), (folder, None)]
    assert (tmp_path / "out.bin").read_bytes() == b"new"


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_what_open_gives(tmp_path, monkeypatch):
    # as open(path, "wb") leaves them: a user's chmod 600 on a checkpoint or a config stays
    # (setuid and the like not); a read-only file is replaced too: its temporary file is written
    # at mkstemp's 0o600, then given the mode
    mask = os.umask(0)
    os.umask(mask)
    kept, new, opened = tmp_path / "kept.json", tmp_path / "new.json", []

    def noting_open(path, *args, **kwargs):  # the temporary file's mode as it is opened
        opened.append(os.stat(path).st_mode & 0o777)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(fileio, "open", noting_open, raising=False)
    kept.write_bytes(b"old")
    for mode, left in ((0o600, 0o600), (0o640, 0o640), (0o444, 0o444), (0o4755, 0o755)):
        kept.chmod(mode)
        for path in (kept, new):
            fileio.write_atomically(str(path), b"new")
        assert kept.stat().st_mode & 0o7777 == left and kept.read_bytes() == b"new"
        assert new.stat().st_mode & 0o7777 == 0o666 & ~mask
        new.unlink()
    assert set(opened) == {0o600}  # (writable as it is written, by whoever runs it)
    # the previous checkpoint, copied where the file system has no hard links, keeps it too
    monkeypatch.undo()
    runs.save_checkpoint(str(tmp_path), {"run_id": "ab12", "step": 1})
    (tmp_path / runs.CHECKPOINT).chmod(0o600)

    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(runs.os, "link", no_links)
    runs.save_checkpoint(str(tmp_path), {"run_id": "ab12", "step": 2}, keep=True)
    for name, step in ((runs.PREVIOUS, 1), (runs.CHECKPOINT, 2)):
        assert torch.load(tmp_path / name, weights_only=True)["step"] == step, name
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name


def test_the_put_back_moves_nothing_when_the_newest_does_not_load(tmp_path):
    # (beside test_the_put_back_takes_only_an_older_checkpoint_of_the_same_run)
    torch.save({"run_id": "aa", "step": 5}, tmp_path / runs.PREVIOUS)
    (tmp_path / runs.CHECKPOINT).write_bytes(b"damaged since it was written")
    said = runs.last_good(ranks.Dist(), runs.Ledger(str(tmp_path), 10), "aa")
    assert said.startswith("none: no step from the newest")
    assert (tmp_path / runs.CHECKPOINT).read_bytes() == b"damaged since it was written"
    assert torch.load(tmp_path / runs.PREVIOUS, weights_only=True)["step"] == 5
