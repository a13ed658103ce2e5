"""Command lines: the settings' facts and checks, bad input to train_gpt.py, and the other
commands' options and errors (one line, status 2)."""

import argparse
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from unittest import mock

import pytest
import torch

import ranks
import runs
import support
import train_gpt as tg
from conftest import (
    COMMANDS,
    OUT_OF_MEMORY_LINES,
    REPO,
    RESUME_RUN,
    TINY_RUN,
    load_command,
    run_command,
    run_main,
    run_out_of_memory,
    tiny,
    write_shard,
)

# ------------------------------------------------------------------------- settings


def test_every_fields_facts_are_well_formed():
    # the facts are code (support.setting): each default lies in its own range or choices,
    # every number has a range, and a router named as a field's owner is one that exists
    for cls in (tg.Hyperparameters, tg.Job, runs.RunState):
        for f in tg.fields(cls):
            facts = f.metadata
            assert set(facts) == {"spec", "help", "fixed", "router", "use"}, f.name
            spec, default = facts["spec"], f.default
            if isinstance(spec, tuple):
                assert default in spec and all(type(c) is str for c in spec), f.name
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                low, high, closed_low, closed_high = support.interval(spec)
                assert low <= default <= high, f.name
                assert (low, high) == tuple(map(float, spec[1:-1].split(","))), f.name
                if type(default) is int:  # its bounds said as ints ("[1, 8]", not "[1.0, 8.0]")
                    assert all(type(b) is int or math.isinf(b) for b in (low, high)), f.name
            else:
                assert spec == "", f.name  # a text or a boolean: checked where it is used
            assert facts["router"] in ("", *tg.ROUTERS), f.name
            assert not facts["fixed"] or cls is tg.Hyperparameters, f.name
            assert facts["use"] in ("", "train", "init"), f.name
            assert not facts["use"] or cls is tg.Hyperparameters and not facts["fixed"], f.name
            support.check_fields(cls())  # the defaults pass their own checks


def test_every_range_takes_its_closed_bounds_and_refuses_its_open_ones():
    # each field's finite bounds as check_fields sees them ("[0, 1)": 0 taken, 1 refused), and
    # each command's numeric option at both its bounds (cached_fineweb10B.py's 103: all of
    # FineWeb's training shards)
    for cls in (tg.Hyperparameters, tg.Job, runs.RunState):
        for f in tg.fields(cls):
            spec = f.metadata["spec"]
            if not isinstance(spec, str) or not spec:
                continue
            low, high, closed_low, closed_high = support.interval(spec)
            for bound, closed in ((low, closed_low), (high, closed_high)):
                if math.isinf(bound):
                    continue
                at = replace(cls(), **{f.name: type(f.default)(bound)})
                if closed:
                    support.check_fields(at)
                else:
                    with pytest.raises(tg.UserError, match=rf"{f.name}=\S+ must lie in"):
                        support.check_fields(at)
    checked = 0
    for path in COMMANDS:
        for action in load_command(path).parser()._actions:
            kind = action.type
            for bound in (getattr(kind, "low", math.inf), getattr(kind, "high", math.inf)):
                if not math.isinf(bound):
                    value = kind(str(bound))
                    assert value == bound and type(value) is kind.kind, (path, action.dest)
                    checked += 1
    assert checked > 20


def test_help_lists_every_field_with_its_default_and_facts(capsys):
    code, out, err = run_main(["--help"], capsys)
    assert code == 0 and err == ""
    lines = {
        line.split()[0].split("=")[0]: line for line in out.splitlines() if line.startswith("  --")
    }
    for f in tg.fields(tg.Hyperparameters) + tg.fields(tg.Job):
        default = getattr((tg.Job if f.name in tg.JOB else tg.Hyperparameters)(), f.name)
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        line = lines[f"--{f.name}"]
        assert line.split()[0] == f"--{f.name}={shown}", line
        spec, router = f.metadata["spec"], f.metadata["router"]
        spec = "{" + "|".join(spec) + "}" if isinstance(spec, tuple) else spec
        assert spec in line and f.metadata["help"] in line, line
        assert (f"(router={router}" in line) == bool(router), line
        assert ("fixed)" in line) == f.metadata["fixed"], line  # what a resume may not change
        use = f.metadata["use"]  # what evaluation does not read, or only initial weights do
        assert any(f"{u} only)" in line for u in ("train", "init")) == bool(use), line
        assert f"{use} only)" in line or not use, line
    assert "{none|skip_middle|dlo|mod|mor}" in lines["--router"]  # the registry's names


def field_of(name):
    return {f.name: f for f in tg.fields(tg.Hyperparameters) + tg.fields(tg.Job)}[name]


def choices(name) -> list:
    spec = field_of(name).metadata["spec"]
    return list(spec) if isinstance(spec, tuple) else []


def routers_fields(router) -> list:
    """The fields of Hyperparameters marked router=NAME: read by that router alone."""
    return [f.name for f in tg.fields(tg.Hyperparameters) if f.metadata["router"] == router]


def owner_flags(name) -> list:
    """The flags that make the smoke preset read the field: its router, its controller."""
    owner = [f"--router={r}" for r in tg.ROUTERS if name in routers_fields(r)]
    # the smoke's 4: too few for N_r = 3
    owner += ["--n_layers=8"] if owner == ["--router=mor"] else []
    owner += [f"--controller={c}" for c, knobs in tg.CONTROLLERS.items() if name in knobs.split()][
        :1
    ]
    return owner


def accepts(name, value) -> bool:
    """Whether --name=value on the smoke preset, with the router or controller that reads
    the field, passes every check before a run starts."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    owner = owner_flags(name)
    try:
        given = [f"--{name}={text}"] if text else []  # an empty default: the flag left out
        # its vocabulary
        given += ["--vocab_size=256"] if (name, text) == ("encoding", "bytes") else []
        tg.validate(tg.resolve(tg.parse_overrides(["--preset=smoke", *owner, *given])), 1)
        return True
    except tg.UserError:
        return False


def valid_candidates(name, default, tmp_path) -> list:
    """Values other than the default to try: near it for numbers, the other choices, paths."""
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, 2 * default, default - 1, default // 2]
    if isinstance(default, float):
        return [2 * default, default / 2, default + 0.1, default - 0.1, 0.5]
    paths = {
        "train_files": tg.PRESETS["smoke"]["val_files"],
        "val_files": tg.PRESETS["smoke"]["train_files"],
        "run_dir": str(tmp_path / "new_run"),
    }
    return [paths[name]] if name in paths else [c for c in choices(name) if c != default]


def numeric_range_is_checked(name, default) -> list:
    """Checks that the default and the values at (or just inside) each end of the field's
    declared interval are accepted by the range check; -> values just outside it, as text."""
    cls = tg.Job if name in tg.JOB else tg.Hyperparameters
    interval = field_of(name).metadata["spec"]
    assert interval[:1] in ("[", "("), f"a numeric field {name} without a range"
    low, high = (
        int(t) if t.strip().lstrip("-").isdigit() else float(t)  # (exact past 2^53)
        for t in interval[1:-1].split(",")
    )
    step = 1 if type(default) is int else 1e-3
    inside = [default, low if interval[0] == "[" else low + step]
    inside += [high if interval[-1] == "]" else high - step] if math.isfinite(high) else [1e30]
    for value in inside:
        support.check_fields(replace(cls(), **{name: type(default)(value)}))  # raises if refused
    outside = [low - step if interval[0] == "[" else low]
    return [
        str(type(default)(v))
        for v in outside
        + ([high + step if interval[-1] == "]" else high] if math.isfinite(high) else [])
    ]


def test_every_field_has_a_checked_range(tmp_path):
    # generated from the dataclass: a new numeric field without a range check fails here
    strings = {
        "train_files",
        "val_files",
        "encoding",
        "attn_impl",
        "router",
        "controller",
        "gate_init",
        "gate_axis",
        "embed_dtype",
        "resume",
        "init_from",
        "run_dir",
        "preset",
    }
    bad_values = {
        "train_files": f"{tmp_path}/dir_*.bin",
        "val_files": "/nonexistent/v_*.bin",
        "attn_impl": "tpu",
        "router": "moe",
        "controller": "pid",
        "gate_init": "uniform",
        "gate_axis": "value",
        "encoding": "utf16",
        "embed_dtype": "float16",
        "preset": "huge",
    }  # the paths (resume, init_from, run_dir): bad_inputs and the source tests
    (tmp_path / "dir_000001.bin").mkdir()
    given = tg.parse_overrides(["--preset=smoke"])
    defaults = {**asdict(tg.Hyperparameters()), **asdict(tg.Job())}
    smoke = {**asdict(tg.resolve(given)), **asdict(tg.job_settings(given))}
    for f in tg.fields(tg.Hyperparameters) + tg.fields(tg.Job):
        default = defaults[f.name]
        if isinstance(default, bool):
            candidates = ["maybe"]
        elif isinstance(default, (int, float)):
            candidates = numeric_range_is_checked(f.name, default)
        else:
            assert f.name in strings, f"a new text field {f.name}: add its bad value here"
            candidates = [bad_values[f.name]] if f.name in bad_values else []
        never = ["", "nan", "inf"] + (["1e-50", "1e39"] if type(default) is float else [])
        # with the router or controller that reads the field: else any value of a field that
        # only they read is refused as a knob without effect, whatever its range check does
        owner = ["--preset=smoke", *owner_flags(f.name)]
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        for value in never if numeric else []:
            # refused for every number, whatever its range, by its own checks
            with pytest.raises(tg.UserError, match="expected|must lie in|outside float32"):
                tg.validate(tg.resolve(tg.parse_overrides([*owner, f"--{f.name}={value}"])), 1)
        refused = 0
        for value in candidates:
            try:
                hp = tg.resolve(tg.parse_overrides([*owner, f"--{f.name}={value}"]))
                tg.validate(hp, 1)
                tg.find_shards(hp.train_files), tg.find_shards(hp.val_files)
            except tg.UserError as e:  # any other exception fails: a traceback for the user
                if numeric:  # past its range: refused by the range check, not by another rule
                    assert re.search(rf"{f.name}=\S+ must lie in", str(e)), e
                refused += 1
        assert refused == len(candidates), f"--{f.name}: an out-of-range value is accepted"
        # and its value (the smoke preset's) and some other valid value are accepted, whole
        # (validate); the valid values of resume and init_from are models: their own tests
        value = smoke[f.name]
        others = [v for v in valid_candidates(f.name, value, tmp_path) if v != value]
        assert f.name in ("resume", "init_from") or (
            accepts(f.name, value) and any(accepts(f.name, v) for v in others)
        ), f.name


def test_every_field_that_shapes_the_weights_is_fixed_on_resume(tmp_path):
    # the resume rule reads a field's fixed=True: a field that changes the weights' names or
    # shapes without it would let a resume meet weights that do not fit
    def shapes(hp):  # on the meta device, its init skipped: shapes only (quick)
        with torch.device("meta"), mock.patch.object(torch.nn.init, "normal_", lambda t, **_: t):
            return {k: v.shape for k, v in tg.GPT(hp).state_dict().items()}

    def differ(base, name, value):
        try:
            return shapes(replace(base, **{name: value})) != base_shapes[base.router]
        except Exception:  # settings no model can have, which validation must refuse
            assert not accepts(name, value), (name, value)
            return False

    smoke = tg.resolve(tg.parse_overrides(["--preset=smoke"]))
    base_shapes = {r: shapes(replace(smoke, router=r)) for r in tg.ROUTERS}
    shaping = set()
    for f in tg.fields(tg.Hyperparameters):
        owner = [r for r in tg.ROUTERS if f.name in routers_fields(r)] or [smoke.router]
        base = replace(smoke, router=owner[0])
        for value in valid_candidates(f.name, getattr(base, f.name), tmp_path):
            if (
                value != getattr(base, f.name)
                and differ(base, f.name, value)
                and accepts(f.name, value)
            ):
                shaping.add(f.name)
    assert {"n_layers", "dim", "vocab_size", "router", "mod_every"} <= shaping  # it can see them
    assert shaping <= set(tg.FIXED), shaping - set(tg.FIXED)


def test_a_knob_without_effect_under_the_chosen_settings_is_refused():
    ok = dict(batch_size=32, device_batch_size=32, train_tokens=32 * 16, val_tokens=32 * 16)
    for kw, message in [
        (dict(router="dlo", gamma=0.5), "gamma sets the skip_middle router"),
        (dict(router="none", mod_capacity=0.5), "mod_capacity sets the mod router"),
        (dict(router="mod", dlo_rho=0.5), "dlo_rho sets the dlo router"),
        (dict(router="none", compact=True), "router=none runs every token"),
        (dict(controller="none", mu_end=0.25), "mu_end=0.25 has no effect"),
        (dict(controller="sparsity", gamma=0.5), "gamma=0.5 has no effect"),
        (dict(controller="adaptive", delta=0.5), "delta=0.5 has no effect"),
        (dict(fixed_coef=0.5), "fixed_coef=0.5 has no effect"),
        (dict(router="mod", mod_every=5), "mod_every=5 routes no block"),
        (dict(controller="sparsity", mu_end=0.25), "mu_end=0.25 has no effect"),
        (dict(n_layers=2, mu_end=0.25), "mu_end=0.25 has no effect with n_layers=2: one gated"),
        (dict(n_layers=2, controller="none", mu_end=0.25), "no effect with controller=none"),
        (dict(router="mod", mod_aux_coef=0.0), "mod_aux_coef=0.0 must lie in (0"),
        (dict(router="dlo", dlo_rho=0.0, dlo_anneal_steps=9), "=9 has no effect with dlo_rho=0"),
    ]:
        with pytest.raises(tg.UserError, match=re.escape(message)):
            tg.validate(tiny(**ok, **kw), 1)
    for kw in (
        dict(router="mod", compact=True),
        dict(router="dlo", compact=True),
        dict(controller="sparsity", fixed_coef=0.5),
        dict(controller="proportional", gamma=0.5),
        dict(n_layers=2, mu_start=0.5),
    ):
        tg.validate(tiny(**ok, **kw), 1)


def test_flex_is_refused_for_the_reason_that_applies():
    # each rule named alone: the device (CUDA only), then the head dimension (Inductor's kernels)
    hp = tg.resolve(tg.parse_overrides(["--preset=smoke", "--attn_impl=flex"]))  # head dim 32
    small = replace(hp, dim=32)  # head dim 8
    for settings, device, message in [
        (
            hp,
            "cpu",
            "attn_impl=flex trains on CUDA only (FlexAttention has no CPU backward); "
            "here cpu: use auto or sdpa",
        ),
        (
            small,
            "cpu",
            "attn_impl=flex trains on CUDA only (FlexAttention has no CPU backward); "
            "here cpu: use auto or sdpa",
        ),
        (
            small,
            "cuda",
            "attn_impl=flex needs a head dimension of at least 16; here dim / "
            "n_heads = 8: use auto or sdpa",
        ),
    ]:
        with pytest.raises(tg.UserError) as e:
            tg.check_run(settings, tg.Job(), ranks.Dist(device=device), None)
        assert str(e.value) == message
    tg.check_run(replace(hp, attn_impl="sdpa"), tg.Job(), ranks.Dist(), None)  # the rest is fine


def test_a_size_past_the_machine_is_one_line_before_any_model_is_built(tmp_path, capsys):
    for router in tg.ROUTERS:  # the bound: the built model's count less norms, gates, routers
        hp = tg.Hyperparameters(
            router=router, dim=64, n_heads=4, n_kv_heads=2, n_layers=8, vocab_size=512
        )
        with torch.device("meta"):
            exact = sum(p.numel() for p in tg.GPT(hp).parameters())
        assert 0.99 * exact <= tg.n_weights(hp) <= exact, router
    for size in ("--dim=1e12", "--n_layers=2000000", "--vocab_size=65536"):
        t0 = time.time()
        code, out, err = run_main(
            TINY_RUN
            + [
                size,
                "--dim=1000000" if "vocab" in size else "--seed=1",
                f"--run_dir={tmp_path / 'r'}",
            ],
            capsys,
        )
        assert code == 2 and err.startswith("error: these sizes need at least") and out == "", err
        assert err.count("\n") == 1 and time.time() - t0 < 20 and not (tmp_path / "r").exists()


# -------------------------------------------------------- bad input to train_gpt.py


def bad_inputs(tmp_path):
    """(arguments, expected message) for each kind of bad input; files made here."""
    write_shard(tmp_path / "magic_000001.bin", range(5000), magic=7)
    write_shard(tmp_path / "trunc_000001.bin", range(5000), count=9000)
    write_shard(tmp_path / "oov_000001.bin", [60000] * 5000)
    write_shard(tmp_path / "short_000001.bin", range(50))
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "corrupt_run").mkdir()
    (tmp_path / "corrupt_run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    smoke = ["--preset=smoke"]
    (tmp_path / "dir_000001.bin").mkdir()
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "pipe_run").mkdir()  # where a run's file belongs: a named pipe (open() would wait)
    os.mkfifo(tmp_path / "pipe_run" / "config.json")
    # a read error (Linux)
    unreadable = (
        [(smoke + ["--train_files=/proc/self/mem"], "/proc/self/mem: Input/output error")]
        if os.path.exists("/proc/self/mem")
        else []
    )
    flex_cpu = unreadable + (
        []
        if torch.cuda.is_available()
        else [(smoke + ["--attn_impl=flex"], "attn_impl=flex trains on CUDA only")]
    )
    return flex_cpu + [
        (
            smoke + [f"--train_files={tmp_path}/dir_*.bin"],
            "dir_000001.bin, which is a folder, not a shard",
        ),
        (
            smoke + [f"--train_files={tmp_path}/loop"],
            "which is a symbolic link loop, not a shard file",
        ),
        (smoke + ["--val_files=/dev/null"], "which is a character device, not a shard file"),
        (
            smoke + [f"--train_files={tmp_path}/short_*.bin"],
            "matches holds one batch over the ranks (ranks x sequences x length + 1 = 1 x 8 x "
            "128 + 1 = 1025 tokens): give a smaller batch, or more tokens a shard",
        ),
        (
            smoke + ["--run_dir=/dev/null"],
            "cannot write to /dev/null: /dev/null is a character device",
        ),
        ([f"--resume={tmp_path}/loop"], "loop is a symbolic link loop, not a folder"),
        ([f"--resume={tmp_path}/a_file"], "a_file is a file, not a folder"),
        (["--train_files="], "--train_files=: expected a value"),
        (smoke + ["--lr=1e-50"], "lr=1e-50 is not 0 and outside float32's range"),
        (
            smoke + [f"--run_dir={tmp_path}/a_file"],
            f"cannot write to {tmp_path}/a_file: {tmp_path}/a_file is a file",
        ),
        (
            smoke + [f"--run_dir={tmp_path}/a_file/run"],
            f"{tmp_path}/a_file is a file, not a folder",
        ),
        (  # the sample's validation shard: 9,779 tokens, 19 whole batches of 512 (and 1 more)
            smoke + ["--val_tokens=1048576"],
            "shards hold in whole batches of 4 x 128 x 1 = 512 tokens (9728); validation would",
        ),
        (smoke + ["--lr=inf"], "lr=inf must lie in (0, inf)"),
        (smoke + ["--lr=1e400"], "--lr=1e400: past a float's range (it reads as inf)"),
        (smoke + ["--warmup_frac=-1e-400"], "--warmup_frac=-1e-400: past a float's range (it"),
        (smoke + ["--beta2=1"], "beta2=1.0 must lie in [0, 1)"),
        (smoke + ["--dim=100000"], "these sizes need at least"),
        (smoke + ["--router=moe"], "router='moe'; choose from"),
        (smoke + ["--preset=huge"], "preset='huge'; choose from '', 'smoke'"),
        (["--nope=1"], "unknown field 'nope'; valid fields: train_files"),
        (["--n_layers=three"], "--n_layers=three: expected int"),
        (["--compact=maybe"], "--compact=maybe: expected bool"),
        (smoke + ["--n_layers=3"], "even number of layers"),
        (smoke + ["--mu_end=1.5"], "must lie in [0, 1]"),
        (smoke + ["--mu_start=-0.1"], "must lie in [0, 1]"),
        (smoke + ["--device_batch_size=3", "--val_tokens=3072"], "not divisible"),
        (smoke + ["--seq_len=129"], "seq_len=129 is beyond the RoPE table (max_seq_len=128)"),
        (
            ["--train_files=/nonexistent/x_*.bin"],
            "no shards match /nonexistent/x_*.bin: check the path",
        ),
        (
            ["--train_files=/no/fineweb10B_bytes/f_*.bin", "--encoding=bytes", "--vocab_size=256"],
            "python data/tokenize_corpus.py --from_shards='data/fineweb10B/*.bin' --encoding=bytes "
            "--out=/no/fineweb10B_bytes",
        ),  # a conversion's, not the download's advice
        (smoke + [f"--train_files={tmp_path}/trunc_*.bin"], "trunc_000001.bin: header says 9000"),
        (smoke + [f"--train_files={tmp_path}/magic_*.bin"], "magic_000001.bin: bad magic number 7"),
        (
            smoke + [f"--train_files={tmp_path}/oov_*.bin"],
            "oov_000001.bin: token id 60000 is outside the vocabulary (vocab_size=50257)",
        ),
        ([f"--resume={tmp_path}/empty_run"], "empty_run: no checkpoint (checkpoint.pt) in it"),
        (
            [f"--resume={tmp_path}/corrupt_run"],
            "corrupt_run/checkpoint.pt: corrupt or incompatible",
        ),
        (smoke + ["--val_tokens=100"], "val_tokens=100 is not a whole number of validation"),
        (
            smoke + ["--val_tokens=4100"],
            "batches of device_batch_size x seq_len x world size = 512",
        ),
        (
            smoke + [f"--run_dir={tmp_path}/pipe_run"],
            "pipe_run/config.json is a named pipe, not a file",
        ),
        ([f"--resume={tmp_path}/empty_run", "--preset=smoke"], "--preset starts a new run"),
    ]


def test_every_bad_input_gives_one_error_line_and_status_2(tmp_path, capsys):
    # in-process (the subprocess path is exercised by test_existing_run_is_not_overwritten):
    # a traceback here would surface as an exception instead of status 2
    for args, message in bad_inputs(tmp_path):
        run_dir = tmp_path / "r"
        if not args[0].startswith("--resume") and not any("--run_dir" in a for a in args):
            args = args + [f"--run_dir={run_dir}"]
        code, out, err = run_main(args, capsys)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (args, err)
        assert message in err, (args, err)
        assert out == "" and not run_dir.exists()  # nothing written before the check
    assert (tmp_path / "corrupt_run" / "checkpoint.pt").read_bytes() == b"not a checkpoint"
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_training_refuses_a_malformed_shard_before_starting(tmp_path, capsys):
    write_shard(tmp_path / "s_000001.bin", range(5000))
    write_shard(tmp_path / "s_000002.bin", range(5000), count=6000)  # truncated
    code, _, err = run_main(
        ["--preset=smoke", f"--train_files={tmp_path}/s_*.bin", f"--run_dir={tmp_path / 'run'}"],
        capsys,
    )
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path}/s_000002.bin: header says 6000 tokens")
    assert not (tmp_path / "run").exists()


def test_a_leading_tilde_in_a_path_is_the_home_folder_in_every_command(
    tmp_path, monkeypatch, capsys
):
    # the shell leaves --run_dir=~/r as it is: a folder named ~ made here, which `rm -r ~`
    # would then take the home with. Every command's paths: train_gpt.py's fields, the others'
    # path options (support.path_arg)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # (where a folder named ~ would be made)
    argv = ["--train_files=~/d/*.bin", "--router=~"]  # (a field of choices is no path)
    given = support.parse_fields((tg.Hyperparameters, tg.Job), argv)
    assert given == {"train_files": f"{tmp_path}/d/*.bin", "router": "~"}
    args = load_command("sweep.py").parser().parse_args(["--runs=~/r", "--out=~"])
    assert (args.runs, args.out) == (f"{tmp_path}/r", str(tmp_path))
    code, _, err = run_main(RESUME_RUN + ["--run_dir=~/run", "--stop_step=1"], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "checkpoint.pt").is_file() and not (tmp_path / "~").exists()


# --------------------------------------------------------------- the other commands


@pytest.mark.slow
def test_the_other_commands_refuse_bad_input_with_one_line(tmp_path, capsys):
    # what the generated test above cannot know: files, runs, texts, the options' meaning
    sample, bench = load_command("sample.py"), load_command("bench.py")
    sweep, skipview, expand_ = (
        load_command("sweep.py"),
        load_command("skipview.py"),
        load_command("expand.py"),
    )
    tokenize, fetch = (
        load_command("data/tokenize_corpus.py"),
        load_command("data/cached_fineweb10B.py"),
    )
    run = tmp_path / "run"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    a_file, text, edited = tmp_path / "a_file", tmp_path / "t.txt", tmp_path / "edited"
    a_file.write_text("x")
    text.write_text("some text")
    shutil.copytree(run, edited)  # its checkpoint edited to the other encoding (the same shapes)
    ckpt = torch.load(edited / "checkpoint.pt", weights_only=True)
    torch.save({**ckpt, "hp": {**ckpt["hp"], "encoding": "bytes"}}, edited / "checkpoint.pt")
    dense = tmp_path / "dense"  # its settings a dense model's (expand reads them first)
    shutil.copytree(run, dense)
    torch.save({**ckpt, "hp": {**ckpt["hp"], "router": "none"}}, dense / "checkpoint.pt")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "\xff"}\n')
    cases = [
        (
            sample.main,
            [str(run), "--prompt=" + "word " * 40],
            "context holds 32, so no token could follow",
        ),
        (sample.main, [str(run), "--nope=1"], "unrecognized arguments: --nope=1"),
        (sample.main, [str(tmp_path / "none")], "none: no such folder"),
        (  # (the file whose settings these are named first)
            sample.main,
            [str(edited)],
            f"{edited / 'checkpoint.pt'}: encoding=bytes has 256 token ids: give vocab_size=256",
        ),
        (skipview.main, [str(edited), f"--out={tmp_path}/e.html"], "encoding=bytes has 256"),
        (sample.main, [], "give the model once: RUN_DIR or --init_from=SOURCE"),
        (sample.main, [str(run), f"--init_from={run}"], "give the model once"),
        (bench.main, [f"--out={a_file}"], f"cannot write to {a_file}"),
        (sweep.main, [f"--out={a_file}"], f"cannot write to {a_file}"),
        (sweep.main, [f"--runs={a_file}", f"--out={tmp_path}/record"], f"cannot write to {a_file}"),
        (sweep.main, ["--bogus=1"], "unrecognized arguments: --bogus=1"),
        (sweep.main, ["cpu"], "unrecognized arguments: cpu"),
        (skipview.main, [str(run), f"--out={tmp_path}"], "is a folder; give a file name"),
        (skipview.main, [str(run), f"--out={a_file}/page.html"], f"cannot write to {a_file}"),
        (skipview.main, [str(run), "--text="], "--text is empty"),
        (skipview.main, [str(run), "--nope=1"], "unrecognized arguments: --nope=1"),
        (skipview.main, [str(tmp_path / "none")], "none: no such folder"),
        (skipview.main, [], "give the model once: RUN_DIR or --init_from=SOURCE"),
        (expand_.main, [str(run)], "the following arguments are required: NEW_RUN_DIR"),
        (expand_.main, [str(run), f"{tmp_path}/s", "--stop_step=3"], "field 'stop_step'; valid"),
        (tokenize.main, [str(text), f"--out={a_file}"], f"cannot write to {a_file}"),
        (tokenize.main, [str(tmp_path / "none.txt"), f"--out={tmp_path}/s"], "no such file"),
        (tokenize.main, [str(tmp_path / "bad.jsonl"), f"--out={tmp_path}/s"], "not valid UTF-8"),
        (tokenize.main, [str(text)], "give --out=DIR"),
        (tokenize.main, [f"--check={tmp_path}/none"], "none: no such folder"),
        (tokenize.main, [f"--check={tmp_path}/run"], "no .bin shards"),
        (tokenize.main, ["--bogus=1"], "unrecognized arguments: --bogus=1"),
        (fetch.main, [f"--out={a_file}"], f"cannot write to {a_file}"),
        (fetch.main, ["--bogus"], "unrecognized arguments: --bogus"),
        # an option that the others leave unread, given even at its default (ArgParser.given)
        (sample.main, [str(run), "--temperature=0", "--top_k=0"], "--top_k does nothing with"),
        (sample.main, [str(run), "--temperature=0", "--seed", "0"], "--seed does nothing with"),
        (skipview.main, [str(run), "--text=hi", "--val_tokens=5"], "--val_tokens does nothing"),
        (expand_.main, [str(run), f"{tmp_path}/s", "--tau=2"], "--tau does nothing with --init"),
        (expand_.main, [str(dense), f"{tmp_path}/s", "--per_group=100000000"], "--per_group or"),
        (sweep.main, [f"--report={a_file}", "--jobs=1"], "--jobs does nothing with --report"),
        (tokenize.main, ["--check=data/sample", "--name=corpus"], "--name does not apply"),
        (tokenize.main, ["--val_every=0"], "--val_every does not apply to the embedded"),
    ]
    runner = {tokenize.main: tokenize.run}
    for main, argv, message in cases:
        code = runner.get(main, lambda argv, main=main: support.cli(main, argv))(argv)
        out = capsys.readouterr()
        assert code == 2 and out.err.startswith("error: "), (argv, out.err)
        assert out.err.count("\n") == 1 and message in out.err, (argv, out.err)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").iterdir())
    assert a_file.read_text() == "x"
    # standard output on a full disk: status 1, buffered or not, nothing more at exit
    for cmd, unbuffered in (
        (["sample.py", str(run), "--tokens=3"], "1"),
        (["train_gpt.py", *RESUME_RUN, f"--run_dir={tmp_path / 'r2'}"], ""),
        (["export.py", "--help"], ""),  # (argparse's help dropped a failed write: status 0)
    ):
        with open("/dev/full", "w") as full:
            r = run_command(*cmd, stdout=full, timeout=300, env={"PYTHONUNBUFFERED": unbuffered})
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert r.stderr.startswith("error: No space left on device"), (cmd, r.stderr)
    # a pipe whose reader is gone: status 1 (not bad input), after the work (the report written)
    record = Path(REPO, "records", "2026-11-26_figure2_bytes_core_5seeds_v3_cpu", "runs.csv")
    shutil.copy(record, tmp_path / "runs.csv")
    reader, writer = os.pipe()
    os.close(reader)
    r = run_command("sweep.py", f"--report={tmp_path / 'runs.csv'}", stdout=writer)
    os.close(writer)
    assert r.returncode == 1 and r.stderr == "error: Broken pipe\n", r.stderr
    assert (tmp_path / "table.md").exists()
    # standard output (or error) closed as the command starts: what it says is lost, status 0
    piped = dict(cwd=REPO, capture_output=True, text=True, timeout=300)
    for closed in (">&-", "2>&-"):
        check = [sys.executable, "data/tokenize_corpus.py", "--check=data/sample"]
        r = subprocess.run(["bash", "-c", f'exec "$@" {closed}', "_", *check], **piped)
        assert r.returncode == 0 and not r.stderr, (closed, r)
    # one boolean spelling everywhere, as train_gpt.py's fields: 1/0, true/false, yes/no
    assert [support.parse_bool(v) for v in ("1", "TRUE", "Yes", "0", "false", "NO")] == [
        True
    ] * 3 + [False] * 3
    # --help (and -h): status 0, the usage, and every option's default
    export = load_command("export.py")  # (its one option: --push_to)
    for module in (sample, bench, sweep, skipview, expand_, export, tokenize, fetch):
        for flag in ("--help", "-h"):
            with pytest.raises(SystemExit) as exited:
                module.main([flag])
            out = capsys.readouterr().out
            assert exited.value.code == 0 and out.startswith("usage: python "), (module, out)
            options = re.findall(r"^  (--\w+)", out, re.M)
            assert len(options) >= 2 - (module is export), (module, out)
            assert out.count("(default") >= len(options), (module, out)


def bad_values(action, loop):
    """(value, what the error line must say) for an option, generated from its type: every
    path gets an empty value, a symbolic link loop and a device; every number non-numbers,
    non-finite values, values past each bound, and (floats) values float32 cannot hold."""
    kind = action.type
    if kind is support.path_arg:
        return [
            ("", "expected a non-empty value"),
            (str(loop), "symbolic link loop"),
            ("/dev/null", "character device"),
        ]
    if hasattr(kind, "low"):
        past = [str(kind.low - 1)] + ([] if kind.high == math.inf else [str(kind.high + 1)])
        tiny = ["1e-50", "1e39", "-1e-50"] if kind.kind is float else ["1.5", "1e400"]
        return [(v, "expected") for v in ["", "x", "nan", "inf", "-inf", *past, *tiny]]
    if kind is support.parse_bool:
        return [(v, "expected bool") for v in ("", "2", "maybe")]
    if kind is support.check_device:
        return [("", "not a device name"), ("tpu", "--device=tpu"), ("cuda:99", "--device=cuda:99")]
    if action.choices:
        return [("", "invalid choice"), ("nope", "invalid choice")]
    if kind is support.nonempty:
        return [("", "expected a non-empty value")]
    if getattr(kind, "__name__", "") == "repo_id":  # export.py --push_to
        return [("", "expected OWNER/NAME"), ("a/b/c", "expected OWNER/NAME")]
    if action.nargs == 0:  # a flag
        return [("", "ignored explicit argument"), ("x", "ignored explicit argument")]
    return []  # free text (a prompt)


def test_every_option_of_every_command_refuses_bad_values_with_one_line(tmp_path, capsys):
    # generated from each command's parser: a new option is covered, or this fails
    run = tmp_path / "run"  # dense: expand.py takes it
    code, _, err = run_main(
        TINY_RUN + ["--router=none", f"--run_dir={run}", "--stop_step=1"], capsys
    )
    assert code == 0, err
    (tmp_path / "t.txt").write_text("some text")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    required = {
        "run_dir": str(run),
        "out": str(tmp_path / "new"),
        "out_dir": str(tmp_path / "new"),
        "files": str(tmp_path / "t.txt"),
    }
    checked = 0
    for path in COMMANDS:
        module = load_command(path)
        main = getattr(module, "run", None) or (lambda argv, m=module.main: support.cli(m, argv))
        actions = [a for a in module.parser()._actions if a.dest != "help"]
        assert all(bad_values(a, loop) or a.dest in ("prompt", "text") for a in actions), path
        for action in actions:
            for value, message in bad_values(action, loop):
                argv = [f"--out={tmp_path / 's'}"] if path.endswith("tokenize_corpus.py") else []
                argv += [
                    value if a is action else required[a.dest]
                    for a in actions  # in order
                    if not a.option_strings and (a is action or a.dest in required)
                    if action.dest != "init_from" or a.dest != "run_dir"  # (one or the other)
                ]
                argv += [f"{action.option_strings[0]}={value}"] if action.option_strings else []
                code = main(argv)
                out = capsys.readouterr()
                assert code == 2 and out.err.startswith("error: "), (path, argv, out.err)
                dash = value.startswith("-") and not action.option_strings  # read as an option
                assert out.err.count("\n") == 1 and (message in out.err or dash), (
                    path,
                    argv,
                    out.err,
                )
                checked += 1
    assert checked > 100 and not (tmp_path / "s").exists() and not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "run", "t.txt"]


def test_a_whole_number_written_as_a_float_is_an_int_up_to_2_to_the_53_in_every_command():
    # a field (train_gpt.py's, expand.py's) and an option (the other commands') read alike
    def field(text):
        return support.parse_fields([runs.RunState], [f"--step={text}"])["step"]

    option = support.in_range(int, 0)
    for read, refusal in ((field, support.UserError), (option, argparse.ArgumentTypeError)):
        assert read("1e6") == 10**6 and read("10_000") == 10_000 and read("+7") == 7
        assert read(f"{float(2**53)!r}") == 2**53  # 9007199254740992.0: exact
        for text in ("1.5", "1e-3", f"{float(2**54)!r}", "nan", "inf", "1.0000000000000001"):
            with pytest.raises(refusal, match="expected int"):
                read(text)


def test_saved_fields_take_an_int_for_a_float_but_nothing_else_for_its_type():
    saved = {"run_id": "ab", "step": 4, "tokens": 8, "train_ms": 5, "timed_steps": 1}
    saved.update(bad_steps=0, val_done=4)
    got = support.saved_fields(runs.RunState, saved)
    assert got["train_ms"] == 5.0 and type(got["train_ms"]) is float
    for name, value in (("step", True), ("val_done", 4.0), ("train_ms", "5"), ("run_id", 7)):
        with pytest.raises(support.UserError, match=f"saved {name}=.* is not of type"):
            support.saved_fields(runs.RunState, {**saved, name: value})


def test_an_error_line_is_one_line_and_a_second_signal_exits_128_plus_its_number(capsys):
    def fails(message):
        def main(argv):
            raise support.UserError(message)

        return main

    assert support.cli(fails("no such run: a\nb\tc"), []) == 2
    assert capsys.readouterr().err == "error: no such run: a\\nb\\tc\n"

    def second(argv):
        raise support.Interrupted(signal.SIGTERM)

    assert support.cli(second, []) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ""

    class Flushed:  # a signal handled as stdout is flushed, once the work is done: status 0
        def __init__(self):
            self.signals = 1

        def flush(self):
            while self.signals:
                self.signals -= 1
                support.interrupted(signal.SIGTERM, None)

    with contextlib.redirect_stdout(Flushed()):
        assert support.cli(lambda argv: None, []) == 0
    assert capsys.readouterr().err == ""

    for kind, line in OUT_OF_MEMORY_LINES.items():  # (the machine's limit: 1, as a full disk)
        assert support.cli(lambda argv, kind=kind: run_out_of_memory(kind), []) == 1
        assert capsys.readouterr().err == f"error: {line}\n"

    def failed(argv):  # any other RuntimeError: the traceback, as a bug's
        raise RuntimeError("shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        support.cli(failed, [])


def test_a_field_is_given_only_as_dash_dash_name_equals_value():
    assert support.parse_fields([runs.RunState], ["--step=5"]) == {"step": 5}
    # given twice, the later (--help says so): a script's overrides come last
    assert support.parse_fields([runs.RunState], ["--step=5", "--step=7"]) == {"step": 7}
    for arg in ("step=5", "xxstep=5", "-step=5", "--step"):
        with pytest.raises(support.UserError, match="use --field=value"):
            support.parse_fields([runs.RunState], [arg])


def test_a_hung_test_ends_the_suite_naming_where_it_hung(tmp_path):
    # pyproject.toml's limit on one test, lowered here to 2 s: the session exits, not waits
    hang = tmp_path / "test_hang.py"
    hang.write_text("import time\n\n\ndef test_hang():\n    time.sleep(600)\n")
    limit = ["-c", os.path.join(REPO, "pyproject.toml"), "-o", "faulthandler_timeout=2"]
    start = time.time()
    done = run_command("-m", "pytest", "-q", "-p", "no:cacheprovider", *limit, hang, timeout=120)
    assert done.returncode != 0 and time.time() - start < 60
    assert re.search(r"test_hang\.py\", line 5 in test_hang", done.stderr)


def test_run_as_a_script_train_gpt_is_one_module_to_what_imports_it():
    # sources.py imports train_gpt, and main calls it: without the alias `python train_gpt.py`
    # would load the file a second time for it, with its own classes and registries
    code = (
        "import runpy, sys\n"
        "sys.argv = ['train_gpt.py', '--eval_only=true']\n"
        "try:\n"
        "    runpy.run_path('train_gpt.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(e.code, sys.modules['sources'].tg.__name__)\n"
    )
    done = run_command("-c", code)
    assert "--eval_only validates the model of --init_from" in done.stderr  # (sources' check)
    assert done.stdout.split() == ["2", "__main__"], done.stderr
