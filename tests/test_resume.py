"""Resume (train_gpt.py's --resume, read by sources.py; runs.py's checkpoints), and checkpoints
that survive a kill, a non-finite step or a full disk (run folders and logs: tests/test_runs.py)."""

import copy
import errno
import glob
import math
import os
import re
import shutil
import signal
import time
import warnings

import numpy as np
import pytest
import torch

import fileio
import runs
import sources
import train_gpt as tg
from conftest import (
    REPO,
    RESUME_RUN,
    nan_on_call,
    read_metrics,
    run_command,
    run_main,
    start_command,
    timing,
    tiny,
    wait_for_line,
    write_shard,
)
from data import shards

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
    code, out, err = run_main([f"--resume={tmp_path}", "--stop_step=4"], capsys)  # (done)
    assert (code, out, err) == (2, "", "error: stop_step=4 is not after the checkpoint's step 4\n")
    # a step of other tokens would count the schedule's steps and the budget otherwise (a
    # finished run trained on, one half done complete); its sequences may be cut otherwise
    for more in (["--batch_size=32"], ["--seq_len=16"], ["--batch_size=4", "--seq_len=16"]):
        code, out, err = run_main([f"--resume={tmp_path}", *more], capsys)
        assert (code, out) == (2, "") and err == (
            "error: a resume keeps the tokens of a step, batch_size x seq_len = 256 (the "
            "schedule counts steps of them): give a batch_size and seq_len whose product is 256\n"
        ), err
    # other validation tokens: its log's validation losses would be on two sets of tokens
    code, out, err = run_main([f"--resume={tmp_path}", "--val_tokens=512"], capsys)
    assert (code, out, err) == (
        2,
        "",
        "error: a resume keeps the run's val_tokens=256, so that its validation losses are all on "
        f"one set of tokens: drop --val_tokens (other tokens: --init_from={tmp_path} "
        "--eval_only=true --val_tokens=N)\n",
    )
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
    assert sources.load_model(str(run)).hp.n_layers == ckpt["hp"]["n_layers"]
    (run / "checkpoint.pt").chmod(0o600)  # (its user's)
    # resumed from another folder: the relative data path is the repository's
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([f"--resume={run}", "--stop_step=2"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in run.glob("checkpoint*.tmp")) == sorted(others)
    assert {(run / name).read_bytes() for name in others} == {b"not this run's"}
    mask = os.umask(0)
    os.umask(mask)
    # each file replaced as open() would leave it: its own mode (the user's 600), or a new one's
    assert (run / "checkpoint.pt").stat().st_mode & 0o777 == 0o600
    for name in ("config.json", "metrics.jsonl"):
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


def test_edited_counters_and_settings_are_checked_for_value_and_completeness(
    tmp_path, monkeypatch, capsys
):
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
        assert err.count("\n") == 1, err
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
        (lambda c: c["optimizer"]["param_groups"][0].update(maximize=1), "'s maximize=1 is not"),
        (lambda c: c["optimizer"]["param_groups"][-1].update(amsgrad=True), "s amsgrad=True is"),
    ) + tuple(  # AdamW's state of a parameter, as a step reads it (the fused step crashed)
        (lambda c, edit=edit: edit(next(iter(c["optimizer"]["state"].values()))), "optimiser's")
        for edit in (
            lambda s: s.pop("exp_avg_sq"),
            lambda s: s.update(exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3)),
            lambda s: s.update(exp_avg="hello"),
            lambda s: s.update(exp_avg=s["exp_avg"].to_sparse()),
            lambda s: s.update(step=torch.zeros(2, 2)),
            lambda s: s.update(max_exp_avg_sq=s["exp_avg_sq"]),
            lambda s: s["exp_avg_sq"].neg_().sub_(1),  # (a step takes its square root)
            lambda s: s.update(step=torch.tensor(-3.0)),  # (and the bias correction's power)
        )
    ):
        edited = copy.deepcopy(good)
        edit(edited)
        torch.save(edited, tmp_path / "checkpoint.pt")
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        code, _, err = run_main([f"--resume={tmp_path}"], capsys)
        assert code == 2 and message in err and "edited or damaged" in err, err
        assert err.count("\n") == 1, err  # (torch 2.15 warned of the sparse one: three lines)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    # a sparse tensor whose index points past its size: refused as it loads (torch 2.13 loaded
    # it unchecked, for whatever read it to read past its memory)
    edited = copy.deepcopy(good)
    state = next(iter(edited["optimizer"]["state"].values()))
    n = state["exp_avg"].numel()
    with warnings.catch_warnings():  # (torch notes that it is not checked here)
        warnings.simplefilter("ignore")
        state["exp_avg"] = torch.sparse_coo_tensor([[n]], [1.0], (n,), check_invariants=False)
    torch.save(edited, tmp_path / "checkpoint.pt")
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "checkpoint.pt: corrupt or incompatible checkpoint (RuntimeError)" in err, err
    # torch 2.15's note that it checks them is dropped; torch.load's other warnings are not
    load = torch.load

    def noting_load(*args, **kwargs):
        for note in ("Validating sparse tensor invariants because weights_only=True", "other"):
            warnings.warn(note, UserWarning, stacklevel=2)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", noting_load)
    with pytest.warns(UserWarning, match="^other$"):  # (passed on to pytest as well)
        code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # (with its warnings)
    assert code == 2 and "Validating" not in err and "UserWarning: other" in err, err
    assert err.splitlines()[-1].startswith("error: ") and "corrupt or incompatible" in err, err


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
    # nor is a run folder that cannot be searched (patched: root may) called one with none
    access = os.access
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda path, mode: path != str(c) and access(path, mode))
        code, _, err = run_main([f"--resume={c}"], capsys)
    assert (code, err) == (2, f"error: cannot read {c}: Permission denied\n")
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
    # a checkpoint.prev.pt that is not this run's earlier one (the user's file, say): the
    # resume's next save would replace it, so it is refused, nothing written
    prev.write_text("my notes")
    log = (c / "train.log").read_text()
    code, _, err = run_main([f"--resume={c}", "--stop_step=6"], capsys)
    assert (code, err) == (
        2,
        f"error: {prev} is not an earlier checkpoint of this run, and the next save would "
        "replace it: move it\n",
    )
    assert prev.read_text() == "my notes" and (c / "train.log").read_text() == log


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

    monkeypatch.setattr(fileio, "open", fake_open, raising=False)
    code, _, err = run_main(RESUME_RUN + ["--save_every=2", f"--run_dir={tmp_path}"], capsys)
    assert code == 1
    assert err == (
        f"error: cannot write the checkpoint of step 4 ({tmp_path / 'checkpoint.pt'}: "
        f"No space left on device); "
        f"last good checkpoint: {tmp_path / 'checkpoint.pt'} (step 2)\n"
    )
    assert not glob.glob(str(tmp_path / "checkpoint.pt.*.tmp"))  # the partial file is gone
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2
    # (step 0's, no longer needed, given up before the write: step 2's under both names)
    assert os.path.samefile(tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt")
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
