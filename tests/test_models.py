"""Models as files: the authors' released format, --init_from (a folder or the hub's cache),
--eval_only, and export.py."""

import argparse
import json
import math
import os
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import fileio
import hub
import sources
import support
import train_gpt as tg
from conftest import (
    AUTHORS_TINY,
    EVAL_ON_SAMPLE,
    REPO,
    RESUME_RUN,
    TINY_RUN,
    TRAIN_ON_SAMPLE,
    another_job_locks,
    authors_copy,
    deny_reading,
    load_command,
    read_metrics,
    run_command,
    run_main,
    signal_at_each_write,
    tiny,
)

# ----------------------------------------------------- the authors' released format


def test_eval_only_prints_the_cross_entropy_written_here(capsys):
    # the authors' model validated with settings other than its own (4 x 64 tokens, 1,536 of
    # them): the printed loss is the mean -log softmax of each target, the shard laid out as
    # the loader reads it (each batch's 4 x 64 inputs and the next token of each); 64 with no
    # --seq_len: their config has none, and ours (1024) is cut to their RoPE table's length
    B, T, N = 4, 64, 1536
    assert json.loads((AUTHORS_TINY / "config.json").read_text())["max_seq_len"] == T
    given = ["--val_files=data/sample/sample_val_*.bin", f"--val_tokens={N}"]
    code, out, err = run_main(
        [f"--init_from={AUTHORS_TINY}", "--eval_only=true", *given, f"--device_batch_size={B}"],
        capsys,
    )
    assert code == 0, err
    files = tg.find_shards("data/sample/sample_val_*.bin")
    tokens = torch.from_numpy(tg.read_shard(files[0], 50257)[: N + 1].astype("int64"))
    model, nll = sources.load_model(str(AUTHORS_TINY)).eval(), []
    with torch.no_grad():
        for i in range(N // (B * T)):
            batch = tokens[i * B * T : (i + 1) * B * T + 1]
            logits = model(batch[:-1].view(B, T)).logits.double()
            logp = logits - logits.exp().sum(-1, keepdim=True).log()
            nll.append(-logp.gather(-1, batch[1:].view(B, T, 1)).flatten())
    printed = float(re.search(r"val_loss:([0-9.]+)", out).group(1))
    assert printed == pytest.approx(torch.cat(nll).mean().item(), abs=1e-4)


def test_the_authors_released_model_reproduces_their_logits():
    expected = torch.load(AUTHORS_TINY / "expected.pt", weights_only=True)
    ids = expected["input_ids"]
    model = sources.load_model(str(AUTHORS_TINY)).eval()
    config = json.loads((AUTHORS_TINY / "config.json").read_text())
    hp = model.hp  # sizes, RoPE base and eps from their config; their code's gate axis
    assert (hp.dim, hp.n_layers, hp.n_heads, hp.n_kv_heads) == (32, 4, 4, 2)
    assert (hp.rope_theta, hp.norm_eps) == (config["rope_theta"], config["norm_eps"])
    assert (hp.router, hp.gate_axis, hp.embed_dtype) == ("skip_middle", "query", "bfloat16")
    with torch.no_grad():
        out = model(ids)
        nll = model(ids[:, :-1], targets=ids[:, 1:], per_token=True).loss
    assert (out.logits[..., :1024] - expected["logits_first_1024"]).abs().max() < 1e-4
    assert (nll - expected["next_token_nll"]).abs().max() < 1e-4
    assert (out.route["gates"] - expected["gates"]).abs().max() < 1e-4
    # the one rounding decides it (their README): without it the logits are 0.1 away
    unrounded = sources.load_model(str(AUTHORS_TINY), embed_dtype="float32").eval()
    with torch.no_grad():
        assert (
            unrounded(ids).logits[..., :1024] - expected["logits_first_1024"]
        ).abs().max() > 1e-2


def test_the_authors_zero_init_masks_is_our_gate_init_zero_both_ways(tmp_path):
    # their mask linears start at 0 (every gate 1) where zero_init_masks is true: our
    # gate_init=zero, read from their config and written into it
    export = load_command("export.py")
    for flag, ours in ((True, "zero"), (False, "normal")):
        source = authors_copy(tmp_path, ours, config=lambda c, f=flag: {**c, "zero_init_masks": f})
        hp = sources.read_source(source)[0]
        assert hp.gate_init == ours and export.authors_config(hp)["zero_init_masks"] is flag


def test_the_authors_config_class_and_tensor_names_are_read_as_their_code_reads_them():
    # their SkipMiddleConfig's class defaults (projects/skip_middle/model/huggingface.py),
    # written out: a config that gives no field is read as their class supplies each one
    settings = hub.authors_settings({"architectures": ["SkipMiddleModel"]})
    theirs = {
        "dim": 768,
        "n_layers": 12,
        "n_heads": 12,
        "n_kv_heads": 12,  # (None: n_heads)
        "vocab_size": 50257,
        "norm_eps": 1e-5,
        "rope_theta": 500000,
        "rope_scaling": True,
        "max_seq_len": 1024,
        "init_std": 0.02,
        "gate_init": "zero",
    }
    assert {k: settings[k] for k in theirs} == theirs
    # their code tests use_scaled_rope and zero_init_masks for truth (any JSON value); a null
    # n_kv_heads is n_heads; a null initializer_range leaves ours at its default
    given = {"use_scaled_rope": 1, "zero_init_masks": 0, "n_heads": 8, "n_kv_heads": None}
    settings = hub.authors_settings({**given, "initializer_range": None})
    assert settings["rope_scaling"] is True and settings["gate_init"] == "normal"
    assert settings["n_kv_heads"] == 8 and "init_std" not in settings
    # tensor names: any layer (their released models have 12), whole names only
    for name, ours in (
        ("model.layers.11.attention.wq.weight", "blocks.11.attn.wq.weight"),
        ("model.layers.10.feed_forward.w3.weight", "blocks.10.ffn.w3.weight"),
        ("model.masks.5.linear.bias", "router.gates.5.bias"),
    ):
        assert hub.renamed(name, hub.AUTHORS_NAMES) == ours
    for name in (
        "model.output.weights",
        "model.layers.1.attention.wq.weight.0",
        "xmodel.output.weight",
        "model.layers.1.attention.wqq.weight",  # (a projection of no such name)
    ):
        assert hub.renamed(name, hub.AUTHORS_NAMES) is None
        with pytest.raises(support.UserError, match=f"{re.escape(name)} has no place"):
            hub.authors_weights({name: torch.zeros(1)}, "here")


def test_a_model_folder_whose_config_is_not_a_models_is_one_user_error(tmp_path):
    # read before anything is built: ours without its settings, a config.json too large to be
    # one (not read), JSON nested past Python's recursion limit
    for name, text, message in (
        ("no_settings", '{"format": "train_gpt", "trained": {}}', 'has no "settings" object'),
        ("null_settings", '{"format": "train_gpt", "settings": null}', 'has no "settings" object'),
        ("list_settings", '{"format": "train_gpt", "settings": []}', 'has no "settings" object'),
        ("large", "{" + " " * (1 << 20) + "}", f"is over {1 << 20} bytes: not a model's config"),
        ("deep", "[" * 100_000, "is not readable JSON (RecursionError)"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        shutil.copy(AUTHORS_TINY / "model.safetensors", folder)
        with pytest.raises(support.UserError, match=re.escape(f"{folder}/config.json {message}")):
            hub.read(str(folder), {})


AUTHORS_CASES = Path(REPO) / "data" / "fixtures" / "authors_cases"  # made by their code: README


@pytest.mark.parametrize(  # (a __pycache__ of make.py's is no case)
    "case", sorted(p.name for p in AUTHORS_CASES.iterdir() if p.is_dir() and p.name[0] not in "_.")
)
def test_the_authors_layout_loads_as_their_code_reads_it(case):
    # each case written and read back by their code (make.py): a FFN multiplier their code
    # ignores (4 x dim whatever it says), Llama 3.1's scaled RoPE, an embedding stored in fp32
    # (their bf16 module rounds it), fields their config class supplies; our logits and gates
    # within 1e-4 of their forward's, and off where what the case is about is not followed
    folder = AUTHORS_CASES / case
    expected = torch.load(folder / "expected.pt", weights_only=True)
    ids = expected["input_ids"]

    def outputs(**changes):
        model = sources.load_model(str(folder), **changes).eval()
        with torch.no_grad():
            out = model(ids)
        return model.hp, out.logits, out.route["gates"]

    hp, logits, gates = outputs()
    assert (logits - expected["logits"]).abs().max() < 1e-4
    assert (gates - expected["gates"]).abs().max() < 1e-4
    assert (hp.ffn_mult, hp.embed_dtype, hp.sandwich_norm) == (4, "bfloat16", True)
    assert (hp.router, hp.gate_axis, hp.gate_eps, hp.encoding) == (
        "skip_middle",
        "query",
        1e-6,
        "gpt2",
    )
    config = json.loads((folder / "config.json").read_text())
    scaled = config.get("use_scaled_rope", True)  # (their class's default)
    # zero_init_masks: their mask linears start at 0, every gate 1, as our gate_init=zero
    assert hp.gate_init == ("zero" if config["zero_init_masks"] else "normal")
    assert (hp.rope_scaling, hp.rope_theta) == (scaled, config.get("rope_theta", 500000))
    if scaled:  # what the case is about, undone: the logits move
        assert (outputs(rope_scaling=False)[1] - expected["logits"]).abs().max() > 1e-3
    if case == "fp32_embedding":
        assert load_file_dtype(folder, "model.tok_embeddings.weight") == torch.float32
        assert (outputs(embed_dtype="float32")[1] - expected["logits"]).abs().max() > 1e-2
    if case.startswith("ffn"):
        assert config["ffn_dim_multiplier"] != 4


def load_file_dtype(folder, name):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")[name].dtype


def test_llama31_rope_frequencies_follow_meta_s_rule():
    # written out per frequency as Llama 3.1's apply_scaling: wavelengths over 8192 divided by
    # 8, under 2048 kept, between: interpolated with smooth = (8192 / wavelength - 1) / 3
    inv_freq = 1.0 / 500000 ** (torch.arange(0, 128, 2).float() / 128)
    want = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        smooth = (8192 / wavelen - 1) / 3
        if wavelen < 2048:
            want.append(f)
        elif wavelen > 8192:
            want.append(f / 8)
        else:
            want.append((1 - smooth) * f / 8 + smooth * f)
    got = tg.llama31_frequencies(inv_freq)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6)
    assert (got < inv_freq).sum() > 0 and (got == inv_freq).sum() > 0  # some scaled, some not


def test_rmsnorm_rounds_to_its_input_dtype_before_its_weight():
    # Llama's (and the authors') order, written out: normalise in fp32, cast back, then scale
    norm = tg.RMSNorm(16, eps=1e-3)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x = torch.randn(3, 16).bfloat16()
    xf = x.float()
    expect = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-3)).bfloat16() * norm.weight
    assert torch.equal(norm(x), expect) and norm(x).dtype == torch.float32
    assert torch.allclose(norm(xf), expect.float(), rtol=1e-2, atol=1e-2)  # fp32 in: no rounding
    assert not torch.equal(norm(xf), expect)


# ------------------------------------------------------ --init_from and --eval_only


@pytest.mark.slow
def test_a_source_that_cannot_be_represented_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    good = (AUTHORS_TINY / "model.safetensors").read_bytes()

    def drop(name):
        return lambda t: {k: v for k, v in t.items() if k != name}

    def spoil(name, value):  # one value of a tensor, as float64, or (None) the tensor as int64
        def change(t):
            t[name] = t[name].long() if value is None else t[name].double().index_fill(0, t0, value)
            return t

        return change

    wq, t0 = "model.layers.1.attention.wq.weight", torch.tensor([0])

    cases = [
        (dict(config=lambda c: {**c, "architectures": ["LlamaForCausalLM"]}), "LlamaForCausalLM"),
        (dict(config=lambda c: {**c, "n_kv_heads": 4}), "attention.wk.weight is (16, 32)"),
        (dict(config=lambda c: {**c, "architectures": 5}), "it says architectures 5"),
        (dict(config=lambda c: {**c, "dim": "32"}), "dim='32'"),
        (dict(raw="{not json"), "config.json is not readable JSON"),
        (dict(raw="[1, 2]"), "not a JSON object"),
        (
            dict(weights=lambda t: {**t, "model.extra.weight": torch.zeros(2)}),
            "model.extra.weight has no place",
        ),
        (
            dict(weights=drop("model.layers.3.feed_forward.w2.weight")),
            "(model.layers.3.feed_forward.w2.weight is missing)",
        ),
        (dict(weights=good[: len(good) // 2]), "not a complete safetensors file"),
        (dict(weights=b"\xff" * 64), "not a complete safetensors file"),
        # settings checked against the tensors (and the machine) before a model is built
        (dict(config=lambda c: {**c, "dim": 65536}), "GiB on one device to build the model"),
        (dict(config=lambda c: {**c, "max_seq_len": 10**12}), "to build the model"),
        (dict(config=lambda c: {**c, "dim": 64}), "embeddings.weight is (50257, 32), the settings"),
        (dict(weights=spoil(wq, math.nan)), f"{wq} holds NaN or Inf"),
        (dict(weights=spoil(wq, -math.inf)), f"{wq} holds NaN or Inf"),
        (dict(weights=spoil(wq, None)), f"{wq} is torch.int64 (torch.strided); a weight is one"),
        (dict(weights=spoil(wq, 1e300)), f"{wq} holds NaN or Inf"),  # (in float32: the model's)
    ]
    for i, (change, message) in enumerate(cases):
        source = authors_copy(tmp_path, f"src{i}", **change)
        for args in (EVAL_ON_SAMPLE, [f"--run_dir={tmp_path / 'run'}", *TRAIN_ON_SAMPLE]):
            code, out, err = run_main([f"--init_from={source}", *args], capsys)
            assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
            assert message in err, (message, err)
            assert not (tmp_path / "run").exists() and out == ""
    (tmp_path / "neither").mkdir()
    both = Path(authors_copy(tmp_path, "both"))
    (both / "checkpoint.pt").write_bytes(b"")
    for argv, message in (
        ([f"--init_from={tmp_path}/nothing_here"], "nothing_here"),
        ([f"--init_from={tmp_path}/neither"], "neither a model folder (model.safetensors) nor a"),
        ([f"--init_from={both}"], "holds both model.safetensors (a model folder) and checkpoint"),
        ([f"--init_from={AUTHORS_TINY}", "--resume=x"], "drop --resume"),
        ([f"--init_from={AUTHORS_TINY}", "--preset=smoke"], "and --preset"),
        (
            [f"--init_from={AUTHORS_TINY}", "--eval_only=true", "--stop_step=3"],
            "trains nothing: drop --",
        ),
        (["--eval_only=true", "--preset=smoke"], "--eval_only validates the model of --init_from"),
        ([f"--init_from={AUTHORS_TINY}", "--init_std=0.02"], "--init_std sets a new model's"),
        ([f"--init_from={AUTHORS_TINY}", "--seed=0"], "and --init_from takes the source's: drop"),
        (
            [f"--init_from={AUTHORS_TINY}", "--n_layers=6"],
            "layers.4.attention.wq.weight is missing",
        ),
    ):
        code, out, err = run_main(
            argv + [f"--run_dir={tmp_path / 'run'}", *TRAIN_ON_SAMPLE], capsys
        )
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()
    # --eval_only: a setting that training alone reads would do nothing (at its default too)
    for given in ("--lr=0.5", "--train_files=nowhere/*.bin", "--mu_end=0.5", "--seed=0"):
        code, out, err = run_main([f"--init_from={AUTHORS_TINY}", *EVAL_ON_SAMPLE, given], capsys)
        drop = given.split("=")[0]
        assert (code, out, err) == (2, "", f"error: --eval_only trains nothing: drop {drop}\n")
    bench = load_command("bench.py")  # the gate on the query axis has no compact path
    argv = [f"--init_from={AUTHORS_TINY}", f"--out={tmp_path}/b"]
    code, out, err = run_main(argv, capsys, bench.main)
    assert code == 2 and "needs the gate on the key axis; this model's is on the query axis" in err
    assert err.count("\n") == 1 and out == "" and not (tmp_path / "b").exists()
    # a folder whose files cannot be reached (no search permission; patched: root has it) or
    # weights that cannot be read: said so, not "neither a model folder nor ..." or "not a
    # complete safetensors file" (told so, a user would look for, or delete, what is there)
    source, access = authors_copy(tmp_path, "closed"), os.access
    weights = os.path.join(source, "model.safetensors")
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda path, mode: path != source and access(path, mode))
        code, _, err = run_main([f"--init_from={source}", *EVAL_ON_SAMPLE], capsys)
    assert (code, err) == (2, f"error: cannot read {source}: Permission denied\n")
    with monkeypatch.context() as m:
        deny_reading(m, weights)
        code, _, err = run_main([f"--init_from={source}", *EVAL_ON_SAMPLE], capsys)
    assert (code, err) == (2, f"error: cannot read {weights}: Permission denied\n")
    # a newline in the source's name: the printed validation is still one line
    odd = authors_copy(tmp_path, "a\nb")
    code, out, err = run_main([f"--init_from={odd}", *EVAL_ON_SAMPLE], capsys)
    assert code == 0 and out.startswith(f"eval_only {tmp_path}/a\\nb val_loss:"), err


def fake_model_repo(root, folder, repo="someone/tiny", commit="89abcdef" * 5) -> str:
    """A Hugging Face cache holding `folder`'s config and weights as repo's main revision."""
    cached = root / f"models--{repo.replace('/', '--')}"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(commit)
    snap = cached / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(folder) / name, snap / name)
    return commit


def test_a_hub_source_s_errors_name_its_files_as_the_user_named_them(tmp_path, monkeypatch):
    # hf:OWNER/NAME's files are read from the cache, named for messages as hf:OWNER/NAME@COMMIT/
    # (where the weights came from), never as the cache's path
    from huggingface_hub import constants

    commit = fake_model_repo(tmp_path / "hub", AUTHORS_TINY)
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / commit
    (snapshot / "config.json").write_text("[1, 2]")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(support.UserError) as e:
        hub.read("hf:someone/tiny", {})
    assert str(e.value) == f"hf:someone/tiny@{commit}/config.json holds list, not a JSON object"


@pytest.mark.slow
def test_a_hub_source_is_read_from_the_cache_offline_with_one_line_errors(tmp_path, capsys):
    commit = fake_model_repo(tmp_path / "hub", AUTHORS_TINY)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code, local, err = run_main([f"--init_from={AUTHORS_TINY}", *EVAL_ON_SAMPLE], capsys)
    assert code == 0 and local.startswith(f"eval_only {AUTHORS_TINY} val_loss:"), err
    assert "\n  gate_mean:" in local and "alpha:" not in local  # (no controller: not trained here)

    def evaluate(source):
        return run_command(
            os.path.join(REPO, "train_gpt.py"),
            f"--init_from={source}",
            *EVAL_ON_SAMPLE,
            cwd=tmp_path,  # (nothing written: none of the folder's files change)
            env=env,  # (and this process's thread count: the same floats as in it)
            timeout=300,
        )

    shutil.copytree(Path(REPO) / "data" / "sample", tmp_path / "data" / "sample")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    r = evaluate("hf:someone/tiny")
    assert r.returncode == 0, r.stderr
    assert r.stdout == local.replace(str(AUTHORS_TINY), f"hf:someone/tiny@{commit}")
    for source, message in (
        ("hf:someone/absent", "not in the local cache"),
        ("hf:someone/tiny@v2", "not in the local cache"),
        ("hf:not a repo", "give hf:OWNER/NAME"),
        ("hf:someone/tiny@", "give hf:OWNER/NAME"),
        ("hf:some\none/tiny", "hf:some\\none/tiny"),  # one line: the newline written \\n
    ):
        r = evaluate(source)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


# ------------------------------------------------------------------------ export.py


@pytest.mark.slow
def test_an_export_cut_at_any_write_is_finished_by_its_rerun(tmp_path, monkeypatch, capsys):
    # a signal (or a full disk) at any of export's writes: each of its three files is recorded in
    # .outputs.json before and after it is written, so the rerun takes every file there as its
    # own and writes what an export never cut writes; a temporary file SIGKILL left is accepted
    run = tmp_path / "run"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    export, real = load_command("export.py"), fileio.write_atomically
    code, _, err = run_main([str(run), str(tmp_path / "whole")], capsys, export.main)
    assert code == 0, err
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    assert sorted(whole) == [".outputs.json", "README.md", "config.json", "model.safetensors"]
    for cut in range(1, 10):  # three files: the record, the file, the record again
        out, calls = tmp_path / f"cut{cut}", []

        def write(path, data, calls=calls, cut=cut):
            calls.append(path)
            if len(calls) == cut:
                raise KeyboardInterrupt  # the signal, as support.cli's handler raises it
            real(path, data)

        with monkeypatch.context() as m:
            m.setattr(fileio, "write_atomically", write)
            code, _, err = run_main([str(run), str(out)], capsys, export.main)
            assert code == 130, err
        if out.exists():
            (out / "model.safetensors.k2j5x_0q.tmp").write_bytes(b"cut")  # (SIGKILL's leftover)
        code, _, err = run_main([str(run), str(out)], capsys, export.main)
        assert code == 0, (cut, err)
        done = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".tmp")}
        assert done == whole, cut


@pytest.mark.slow
def test_a_signal_during_an_export_over_another_leaves_the_new_one_whole(
    tmp_path, monkeypatch, capsys
):
    # Ctrl-C as each file is written over an earlier export (step 1's): held till the last is
    # written, then the command stops (130), the folder the new export whole (step 2's), never
    # new weights beside the old card
    run, out = tmp_path / "run", tmp_path / "out"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    export = load_command("export.py")
    code, _, err = run_main([str(run), str(out)], capsys, export.main)
    assert code == 0, err
    code, _, err = run_main([f"--resume={run}", "--stop_step=2"], capsys)
    assert code == 0, err
    code, _, err = run_main([str(run), str(tmp_path / "whole")], capsys, export.main)
    assert code == 0, err
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    signal_at_each_write(monkeypatch)
    code, _, err = run_main([str(run), str(out)], capsys, export.main)
    assert code == 130, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == whole


@pytest.mark.slow
def test_an_export_into_a_folder_another_export_is_writing_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    # two exports into one new folder: the other makes it and holds it (its lock) while this one
    # builds its model; this one then writes no file (one line, status 2), and once the other is
    # over it writes all three: the folder never holds one run's weights beside another's card
    run, out = tmp_path / "run", tmp_path / "out"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    export, others = load_command("export.py"), []
    built = export.tg.built

    def meanwhile(*args, **kwargs):  # (after this export's check of the folder)
        out.mkdir(exist_ok=True)
        others.append(another_job_locks(out))
        return built(*args, **kwargs)

    monkeypatch.setattr(export.tg, "built", meanwhile)
    code, _, err = run_main([run, out], capsys, export.main)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {out} is in use by another job"), err
    assert others[0] is not None and os.listdir(out) == []
    os.close(others[0])
    monkeypatch.undo()
    code, _, err = run_main([run, out], capsys, export.main)
    assert code == 0 and sorted(os.listdir(out)) == sorted([*export.FILES, fileio.OUTPUTS]), err
    os.close(another_job_locks(out))  # free once the command is over (support.cli)


@pytest.mark.slow
def test_export_round_trips_and_a_new_run_starts_from_the_weights(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    base = TINY_RUN + ["--train_tokens=10240", "--val_every=0", "--val_tokens=1024"]
    code, _, err = run_main(base + [f"--run_dir={run}"], capsys)
    assert code == 0, err[-2000:]
    export = load_command("export.py")
    code, _, err = run_main([str(run), str(out)], capsys, export.main)
    assert code == 0, err
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # bit for bit, the settings as well
        exported, trained = sources.load_model(str(out)).eval(), sources.load_model(str(run)).eval()
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    assert exported.hp == trained.hp
    config = json.loads((out / "config.json").read_text())
    logged = json.loads((run / "config.json").read_text())
    val = [m for m in read_metrics(run) if m["kind"] == "val"][-1]
    shared = {"train_files": tg.PRESETS["smoke"]["train_files"]}  # inside the repository
    shared["val_files"] = tg.PRESETS["smoke"]["val_files"]  # (relative, as the defaults are)
    assert config["settings"] == {**asdict(trained.hp), **shared}
    assert config["trained"]["git_commit"] == logged["git_commit"]
    # its settings are checked as its file's: a sequence past its RoPE table names config.json
    long = Path(shutil.copytree(out, tmp_path / "long"))
    seq_len = 2 * trained.hp.max_seq_len
    config["settings"]["seq_len"] = seq_len
    (long / "config.json").write_text(json.dumps(config))
    said = f"{long}/config.json: seq_len={seq_len} is beyond the RoPE table"
    with pytest.raises(support.UserError, match=re.escape(said)):
        sources.read_source(str(long))
    config["settings"]["seq_len"] = trained.hp.seq_len
    card = (out / "README.md").read_text()
    assert logged["command"] in card and f"loss {val['val_loss']:.4f}" in card
    assert f"sparsity {val['sparsity']:.4f}" in card
    # a checkpoint of an older version (no embed_dtype) loads as a float32 embedding
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    del ckpt["hp"]["embed_dtype"]
    (tmp_path / "old").mkdir()
    torch.save(ckpt, tmp_path / "old" / "checkpoint.pt")
    assert sources.load_model(str(tmp_path / "old")).hp == trained.hp
    # again into its own folder: accepted; a folder with a user's file: refused, untouched
    code, _, err = run_main([str(run), str(out)], capsys, export.main)
    assert code == 0, err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    code, _, err = run_main([str(run), str(tmp_path / "mine")], capsys, export.main)
    assert (
        code == 2 and "holds files export did not write (notes.txt)" in err and err.count("\n") == 1
    )
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # the run's config.json values of another type are not known: neither shown nor passed on
    odd = {"command": ["python", "x"], "git_commit": 7, "git_dirty": "no", "init_from": 1}
    (run / "config.json").write_text(json.dumps({**logged, **odd}))
    odd_out = tmp_path / "odd\nfolder"  # (a newline in its name: its stdout line is one line)
    code, printed, err = run_main([str(run), str(odd_out)], capsys, export.main)
    assert code == 0, err
    said = f"written to {tmp_path}/odd\\nfolder: model.safetensors, config.json, README.md\n"
    assert printed == said
    passed = json.loads((odd_out / "config.json").read_text())["trained"]
    assert {k: passed[k] for k in odd} == dict.fromkeys(odd)
    card = (odd_out / "README.md").read_text()
    assert "command: `unknown`" in card and "- commit: unknown\n" in card
    assert "from a random initialisation" in card
    (run / "config.json").write_text(json.dumps(logged))
    # a checkpoint copied in from another run (the card would name this run's command and
    # loss), and settings no model is built on: refused, one line, nothing written
    shutil.copytree(run, tmp_path / "copy")
    good = torch.load(run / "checkpoint.pt", weights_only=True)
    for edit, message in (
        ({"run_id": "0123456789abcdef"}, "checkpoint.pt belongs to another run"),
        ({"hp": {**good["hp"], "compact": True, "gate_axis": "query"}}, "compact=true needs"),
    ):
        torch.save({**good, **edit}, tmp_path / "copy" / "checkpoint.pt")
        code, _, err = run_main([tmp_path / "copy", tmp_path / "x"], capsys, export.main)
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()
    # a checkpoint.prev.pt that is not the run's (a resume refuses it: its next save would
    # replace it) is no concern of an export, which reads checkpoint.pt alone
    torch.save(good, tmp_path / "copy" / "checkpoint.pt")
    (tmp_path / "copy" / "checkpoint.prev.pt").write_text("my notes")
    code, _, err = run_main([tmp_path / "copy", tmp_path / "x"], capsys, export.main)
    assert code == 0, err
    # the tools read the exported folder as they read the run
    sampler, texts = load_command("sample.py"), []
    for source in ([str(run)], [f"--init_from={out}"]):
        code, printed, err = run_main([*source, "--tokens=8", "--seed=3"], capsys, sampler.main)
        assert code == 0, err
        texts.append(printed)
    assert texts[0] == texts[1] and len(texts[0]) > 8  # the same text sampled
    # a new run from the weights: at step 0 it validates as --eval_only does the source
    sample_val = ["--val_files=data/sample/sample_val_*.bin", "--val_tokens=1024"]
    code, evaluated, err = run_main([f"--init_from={out}", "--eval_only=true", *sample_val], capsys)
    assert code == 0, err
    new, given = tmp_path / "new", os.path.relpath(out)  # (from the repository: a relative path)
    code, _, err = run_main(
        [f"--init_from={given}", f"--run_dir={new}", "--train_tokens=5120", "--val_every=5"]
        + sample_val,
        capsys,
    )
    assert code == 0, err[-2000:]
    first = [m for m in read_metrics(new) if m["kind"] == "val"][0]
    assert first["step"] == 0
    assert f"val_loss:{first['val_loss']:.4f}" in evaluated.splitlines()[0]
    config = json.loads((new / "config.json").read_text())  # the source as given, and resolved
    assert (config["job"]["init_from"], config["init_from"]) == (given, str(out))
    # a push without a network: one line, after the files are written
    r = run_command(
        "export.py",
        run,
        tmp_path / "pushed",
        "--push_to=me/tiny",
        env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_none"},
        timeout=300,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not pushed" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "pushed")) == [".outputs.json", *sorted(export.FILES)]


@pytest.mark.slow
def test_export_in_the_authors_layout_reads_back_as_their_model(tmp_path, capsys):
    # a run their model can express (gate on the query axis, a bfloat16 embedding), written in
    # their layout: their config fields and tensor names, read back by our reader of their
    # layout (which reproduces their code's logits: the authors_cases fixtures) to the same
    # logits; a run theirs cannot express: one line, nothing written; the card says what is
    # true of the weights written
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "out"
    base = TINY_RUN + ["--train_tokens=10240", "--val_every=0", "--val_tokens=1024"]
    query = base + ["--gate_axis=query", "--embed_dtype=bfloat16"]
    code, _, err = run_main(query + [f"--run_dir={run}", "--stop_step=3"], capsys)
    assert code == 0, err[-2000:]
    export = load_command("export.py")
    code, _, err = run_main([str(run), str(out), "--format=authors"], capsys, export.main)
    assert code == 0 and err == "", err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SkipMiddleModel"] and config["use_scaled_rope"] is False
    assert (config["dim"], config["n_layers"], config["ffn_dim_multiplier"]) == (64, 2, 4)
    tensors = load_file(out / "model.safetensors")
    assert all(k.startswith("model.") for k in tensors) and len(tensors) == 2 * 11 + 4 + 2
    assert tensors["model.tok_embeddings.weight"].dtype == torch.bfloat16
    with safe_open(out / "model.safetensors", "pt") as f:  # (transformers reads its "format")
        assert f.metadata() == {"format": "pt"}
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported, trained = sources.load_model(str(out)).eval(), sources.load_model(str(run)).eval()
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    card = (out / "README.md").read_text()
    logged = json.loads((run / "config.json").read_text())
    assert "trained here 3 steps" in card and "from a random initialisation" in card
    assert "no validation of these weights (step 3) recorded" in card
    assert f" {sum(t.numel() for t in tensors.values()):,} parameters" in card  # the file's
    assert ("with changes not committed" in card) == bool(logged["git_dirty"])
    # a checkpoint alone (no config.json): what is not known is said so
    (tmp_path / "only").mkdir()
    shutil.copy(run / "checkpoint.pt", tmp_path / "only")
    code, _, err = run_main(
        [str(tmp_path / "only"), str(tmp_path / "only_out")], capsys, export.main
    )
    assert code == 0, err
    card = (tmp_path / "only_out" / "README.md").read_text()
    assert "from unknown (no config.json)" in card and "command: `unknown`" in card, card
    (tmp_path / "only" / "expand.json").write_text("{}")  # (expand.py's record of its weights)
    code, _, err = run_main(
        [str(tmp_path / "only"), str(tmp_path / "only_out")], capsys, export.main
    )
    assert code == 0, err
    card = (tmp_path / "only_out" / "README.md").read_text()
    assert "from a depth expansion (expand.py) of another run\n" in card  # (its source not said)
    # a run theirs cannot express: refused, naming the setting, nothing written; settings no
    # model has (an edited checkpoint's): refused, named as the checkpoint's
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    for change, message in (
        (dict(gate_axis="key"), "gate_axis=key: the authors' model has gate_axis=query only"),
        (dict(embed_dtype="float32"), "embed_dtype=float32"),
        (dict(n_heads=3), f"error: {run / 'checkpoint.pt'}: need dim (64) divisible by n_heads"),
    ):
        torch.save({**ckpt, "hp": {**ckpt["hp"], **change}}, run / "checkpoint.pt")
        argv = [str(run), str(tmp_path / "no"), "--format=authors"]
        code, _, err = run_main(argv, capsys, export.main)
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "no").exists()
    # a new run from the export: its card names where it started, and its last validation
    new = tmp_path / "new"
    code, _, err = run_main(
        [f"--init_from={out}", f"--run_dir={new}", "--train_tokens=5120", "--val_every=0"]
        + ["--seq_len=64", "--batch_size=8", "--device_batch_size=4", "--val_tokens=1024"]
        + ["--train_files=data/sample/sample_train_*.bin", "--stop_step=4"]
        + ["--val_files=data/sample/sample_val_*.bin"],
        capsys,
    )
    assert code == 0, err[-2000:]
    code, _, err = run_main([f"--resume={new}"], capsys)  # (its config.json rewritten)
    assert code == 0, err[-2000:]
    code, _, err = run_main([str(new), str(tmp_path / "new_out")], capsys, export.main)
    assert code == 0, err
    card = (tmp_path / "new_out" / "README.md").read_text()
    val = [m for m in read_metrics(new) if m["kind"] == "val"][-1]
    assert f"from the weights of {out}" in card and f"loss {val['val_loss']:.4f}" in card
    # the export of the authors' own model is their file: each tensor bit for bit, each field of
    # their config (transformers' own aside); norm_eps, whose value in their files is our
    # default, is written and read back at another value under its name
    theirs, model = (
        load_file(AUTHORS_TINY / "model.safetensors"),
        sources.load_model(str(AUTHORS_TINY)),
    )
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    for hp, name in ((model.hp, "theirs"), (replace(model.hp, norm_eps=1e-3), "eps")):
        torch.save({**ckpt, "hp": asdict(hp), "model": model.state_dict()}, run / "checkpoint.pt")
        code, _, err = run_main(
            [str(run), str(tmp_path / name), "--format=authors"], capsys, export.main
        )
        assert code == 0, err
    mine = load_file(tmp_path / "theirs" / "model.safetensors")
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    config, their_config = (
        json.loads((d / "config.json").read_text()) for d in (tmp_path / "theirs", AUTHORS_TINY)
    )
    for key in set(their_config) - {"dtype", "torch_dtype", "transformers_version"}:
        assert config.get(key) == their_config[key], key
    assert sources.load_model(str(tmp_path / "eps")).hp.norm_eps == 1e-3


def test_export_accepts_only_its_own_files_in_out_dir_and_touches_none(tmp_path):
    # OUT_DIR may hold export's three files (recorded in .outputs.json as its own) and what a
    # write cut by SIGKILL left (NAME.<8 of a-z0-9_>.tmp); any other file, or a file of one of
    # those names that export did not write, is refused before anything is written
    export = load_command("export.py")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.k2j5x_0q.tmp").write_bytes(b"cut")
    (out / f"{fileio.OUTPUTS}.k2j5x_0q.tmp").write_bytes(b"cut")  # (the record's)
    export.check_out_dir(str(out))
    for mine, message in (
        ("notes.txt", "holds files export did not write (notes.txt)"),
        ("config.json.mine.tmp", "holds files export did not write (config.json.mine.tmp)"),
        ("README.md.k2j5x_0q.tmp.old", "holds files export did not write (README.md.k2j5x_0q"),
        ("config.json", "config.json is there (a file) and this command did not write it"),
    ):
        (out / mine).write_text("mine")
        with pytest.raises(support.UserError, match=re.escape(message)):
            export.check_out_dir(str(out))
        assert (out / mine).read_text() == "mine"
        (out / mine).unlink()
    for names, said in (("abc", "(a, b, c)"), ("abcde", "(a, b, c and 2 more)")):  # three named
        for name in names:
            (out / name).write_text("mine")
        with pytest.raises(support.UserError, match=re.escape(f"did not write {said}: ")):
            export.check_out_dir(str(out))
        for name in names:
            (out / name).unlink()
    cut = [f"{fileio.OUTPUTS}.k2j5x_0q.tmp", "model.safetensors.k2j5x_0q.tmp"]
    assert sorted(os.listdir(out)) == cut
    for bad in ("a--b/c", "a/b..c", "-a/b", "a/b.", "a/b/c"):  # the Hub's rule for --push_to
        with pytest.raises(argparse.ArgumentTypeError, match="expected OWNER/NAME"):
            export.repo_id(bad)
    assert export.repo_id("Some-one/tiny.v2_b") == "Some-one/tiny.v2_b"


def test_a_push_uploads_exports_three_files_to_a_repository_made_or_already_there(
    tmp_path, monkeypatch, capsys
):
    # (the Hub as a stand-in that records each call) the repository made only if absent: a
    # second push, more training later, goes to the same one; nothing but the three files (not
    # the record, nor what a cut write left)
    import huggingface_hub

    repos, uploads = set(), []

    class Hub:
        def create_repo(self, repo, exist_ok=False):
            if repo in repos and not exist_ok:
                raise RuntimeError("409 Conflict: the repository exists")
            repos.add(repo)

        def upload_folder(self, **kwargs):
            uploads.append(kwargs)

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    export = load_command("export.py")
    for _ in range(2):
        export.push(str(tmp_path), "me/tiny")
        assert capsys.readouterr().out == "pushed to https://huggingface.co/me/tiny\n"
    three = ["model.safetensors", "config.json", "README.md"]
    upload = {"repo_id": "me/tiny", "folder_path": str(tmp_path), "allow_patterns": three}
    assert repos == {"me/tiny"} and uploads == [upload, upload]


def test_export_s_card_shows_the_validation_of_the_step_written(tmp_path, monkeypatch):
    # the last validation record of the checkpoint's step (a resumed job may validate it again);
    # other steps, other kinds and lines that are no record left out
    export = load_command("export.py")
    lines = [
        {"kind": "val", "step": 5, "val_loss": 2.0},
        [1, 2],
        {"kind": "val", "step": 5, "val_loss": 1.5, "val_se": 0.01, "val_docs": 7},
        {"kind": "train", "step": 5, "loss": 9.0},
        {"kind": "val", "step": 6, "val_loss": 1.0},
    ]
    text = "\n".join(json.dumps(line) for line in lines).replace("[1, 2]", "{broken")
    (tmp_path / "metrics.jsonl").write_text(text + "\n")
    val = export.last_validation(str(tmp_path), 5)
    assert val == lines[2] and export.last_validation(str(tmp_path), 4) == {}
    assert export.last_validation(str(tmp_path), 7) == {}  # (not step 6's: other weights)
    # records that cannot be read are not "none" (the card would say no validation was made)
    with monkeypatch.context() as m:
        deny_reading(m, tmp_path / "metrics.jsonl")
        with pytest.raises(PermissionError):
            export.last_validation(str(tmp_path), 5)
    trained = {"run_id": "r1", "step": 5, "tokens": 640, "logged": True, "command": "python x"}
    figures = {"sparsity": 0.25, "fwd_flops_per_token": 12345678, "fwd_flops_per_token_dense": 2e7}
    trained |= {"git_commit": "abc123", "git_dirty": False, "validation": {**val, **figures}}
    card = export.model_card(tiny(), trained, 1234, "LAYOUT.")
    assert "validation at step 5: loss 1.5000 (SE 0.0100 over 7 documents), sparsity 0.2500" in card
    assert "forward FLOPs per token 1.235e+07 (dense 2e+07)" in card and "1,234 parameters" in card
    assert "- commit: abc123\n" in card and "from a random initialisation" in card
    dirty = {
        **trained,
        "git_dirty": True,
        "validation": {"step": 5, "val_loss": True, "val_docs": 3},
    }
    card = export.model_card(tiny(), dirty, 1234, "LAYOUT.")
    assert "- commit: abc123, with changes not committed (the run's train.log" in card
    assert "loss n/a (SE n/a over 3 documents), sparsity n/a" in card  # (a bool: no figure)
    # what a user (or a folder's name) put in the records: each where it belongs, one line
    edited = {**dirty, "validation": {"step": 5, "val_docs": "many\n# a heading"}}
    edited |= {k: f"{k}\n# a heading" for k in ("command", "git_commit", "init_from")}
    card = export.model_card(tiny(), edited, 1234, "LAYOUT.")
    assert "(SE n/a over n/a documents)" in card and "\n#" not in card.split("\n## Use")[0][1:]
    assert "command: `command\\n# a heading`" in card and "commit: git_commit\\n# a" in card
    assert "from the weights of init_from\\n# a heading" in card
    card = export.model_card(tiny(), {**trained, "logged": False, "validation": {}}, 1, "")
    assert (
        "from unknown (no config.json)" in card
        and "no validation of these weights (step 5)" in card
    )
