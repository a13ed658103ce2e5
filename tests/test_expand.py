"""expand.py: a dense model expanded by new layers (the DLO paper's), then trained on."""

import json
import math
import os
import shlex
import shutil
import signal

import numpy as np
import pytest
import torch

import expand
import fileio
import sources
import support
import train_gpt as tg
from conftest import (
    TINY_RUN,
    disk_nearly_full,
    load_command,
    read_metrics,
    run_command,
    run_main,
    signal_self,
    tiny,
    write_shard,
)


def expanded(init, R=4, P=2, q=1, tau=2):
    torch.manual_seed(0)
    src = tg.GPT(tiny(router="none", n_layers=R))
    state = expand.expand_state(src.state_dict(), R, P, q, init, tau, 0, src.router.layer_modules)
    return src, state


def test_identity_expansion_keeps_the_function():
    src, state = expanded("identity")
    idx = torch.randint(0, 97, (2, 16))
    for router in ("none", "dlo"):
        big = tg.GPT(tiny(router=router, n_layers=6)).eval()
        missing, unexpected = big.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith("router.routers.") for k in missing)
        assert (big(idx).logits - src(idx).logits).abs().max().item() < 1e-5
    # groups of 2 become groups of 3: originals 0, 1 -> 0, 1; new 2; originals 2, 3 -> 3, 4
    assert torch.equal(
        state["blocks.3.attn.wq.weight"], src.state_dict()["blocks.2.attn.wq.weight"]
    )
    assert torch.equal(
        state["blocks.2.attn.wq.weight"], src.state_dict()["blocks.1.attn.wq.weight"]
    )
    assert not state["blocks.2.attn.wo.weight"].any() and not state["blocks.5.ffn.w2.weight"].any()


def test_a_deep_expansion_moves_every_layer_whole():
    # 12 layers in 3 groups of 4 -> 15 (the original i of group p at 5p + i, new ones at 5p + 4):
    # layer 1's keys are not layer 10's or 11's, every original tensor lands once, where it goes
    src, state = expanded("identity", R=12, P=3)
    old = src.state_dict()
    per_layer = [k[len("blocks.0.") :] for k in old if k.startswith("blocks.0.")]
    assert sorted(k for k in state if k.startswith("blocks.")) == sorted(
        f"blocks.{j}.{k}" for j in range(15) for k in per_layer
    )
    for p in range(3):
        for i in range(4):
            for k in per_layer:
                assert torch.equal(state[f"blocks.{5 * p + i}.{k}"], old[f"blocks.{4 * p + i}.{k}"])
        assert not state[f"blocks.{5 * p + 4}.attn.wo.weight"].any()


def test_other_expansion_initialisations():
    src, copy = expanded("copy")
    old = src.state_dict()
    assert all(
        torch.equal(copy[f"blocks.2.{k}"], old[f"blocks.1.{k}"])
        for k in ("attn.wo.weight", "ffn.w2.weight", "attn_in.weight")
    )
    _, linear = expanded("linear")
    w = "attn.wq.weight"
    assert torch.allclose(
        linear[f"blocks.2.{w}"], (old[f"blocks.0.{w}"] + old[f"blocks.1.{w}"]) / 2
    )
    _, slerp = expanded("slerp")
    u, v = old[f"blocks.1.{w}"], old[f"blocks.0.{w}"]
    omega = math.acos((u.flatten() @ v.flatten() / (u.norm() * v.norm())).item())
    ref = math.sin(omega / 2) / math.sin(omega) * (u + v)  # SLERP(u, v, 1/2)
    assert torch.allclose(slerp[f"blocks.2.{w}"], ref, atol=1e-6)
    assert torch.equal(slerp["blocks.2.attn_in.weight"], old["blocks.1.attn_in.weight"])  # parallel
    _, rand = expanded("random")
    bound = math.sqrt(6 / (32 + 32))  # Xavier uniform, fan_in = fan_out = 32
    assert rand[f"blocks.2.{w}"].abs().max() <= bound and rand[f"blocks.2.{w}"].std() > bound / 3
    assert torch.equal(rand["blocks.2.ffn_in.weight"], torch.ones(32))


def test_a_dlo_expansion_moves_each_router_with_its_layer():
    src = tg.GPT(tiny(router="dlo", n_layers=4))
    for i, router in enumerate(src.router.routers):
        torch.nn.init.constant_(router.weight, float(i + 1))
    state = expand.expand_state(
        src.state_dict(), 4, 2, 1, "identity", 2, 0, src.router.layer_modules
    )
    # groups (0, 1), (2, 3) -> (0, 1, new 2), (3, 4, new 5): new layers get no router weights
    moved = {
        j: state[f"router.routers.{j}.weight"].flatten()[0].item()
        for j in range(6)
        if f"router.routers.{j}.weight" in state
    }
    assert moved == {0: 1.0, 1: 2.0, 3: 3.0, 4: 4.0}


def test_random_new_layers_are_xavier_uniform_drawn_from_the_seed():
    # Xavier uniform on [-b, b], b = sqrt(6 / (fan_in + fan_out)): a non-square matrix (the
    # FFN's first, 128 x 32) has standard deviation b / sqrt(3) and reaches both ends; the
    # same seed draws the same layer, another seed another
    src, state = expanded("random")
    w1 = state["blocks.2.ffn.w1.weight"]
    assert w1.shape == (128, 32)
    bound = math.sqrt(6 / (128 + 32))
    assert w1.abs().max() <= bound and w1.max() > 0.95 * bound and w1.min() < -0.95 * bound
    assert w1.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    old = src.state_dict()
    again = expand.expand_state(old, 4, 2, 1, "random", 2, 0, src.router.layer_modules)
    other = expand.expand_state(old, 4, 2, 1, "random", 2, 1, src.router.layer_modules)
    assert torch.equal(again["blocks.2.ffn.w1.weight"], w1)
    assert not torch.equal(other["blocks.2.ffn.w1.weight"], w1)


def test_each_group_merges_its_own_last_tau_layers():
    # 6 layers in 2 groups of 3, tau = 2: groups (0, 1, 2), (3, 4, 5) -> (0, 1, 2, new 3),
    # (4, 5, 6, new 7); each new layer from its own group: linear the mean of its last two
    # layers, slerp halfway between its last and the one before, copy its last
    src, linear = expanded("linear", R=6)  # (the source drawn from seed 0 at each call)
    old, w = src.state_dict(), "attn.wq.weight"
    slerp, copy = (expanded(init, R=6)[1] for init in ("slerp", "copy"))

    def slerp_halfway(u, v):  # SLERP(u, v, 1/2), written out
        omega = math.acos((u.flatten() @ v.flatten() / (u.norm() * v.norm())).item())
        return math.sin(omega / 2) / math.sin(omega) * (u + v)

    for new, (before, last) in ((3, (1, 2)), (7, (4, 5))):
        u, v = old[f"blocks.{last}.{w}"], old[f"blocks.{before}.{w}"]
        assert torch.allclose(linear[f"blocks.{new}.{w}"], (u + v) / 2)
        assert torch.allclose(slerp[f"blocks.{new}.{w}"], slerp_halfway(u, v), atol=1e-6)
        assert torch.equal(copy[f"blocks.{new}.{w}"], u)
    assert torch.equal(copy[f"blocks.6.{w}"], old[f"blocks.5.{w}"])  # the originals moved on


def test_slerp_of_parallel_or_zero_tensors_is_their_mean():
    # u and 3u: float32 rounds their cosine above 1 (arccos would give NaN); zero tensors (an
    # identity-expanded layer's output projections, expanded again): no direction at all.
    # Both: the mean, finite
    u = torch.tensor([3.0, 6.0])
    zero = torch.zeros(2)
    layers = [{"a": 3 * u, "b": zero}, {"a": u, "b": zero}]
    new = expand.new_layer(layers, "slerp", 2, torch.Generator())
    assert torch.equal(new["a"], 2 * u) and torch.equal(new["b"], zero)


def test_expanded_settings_derive_the_layer_count_and_refuse_what_cannot_expand():
    dense = tiny(router="none", n_layers=4)
    # P = 2 groups of 2, q = 1: 2 x (2 + 1) = 6 layers; n_layers given as that and a shape
    # field given at the checkpoint's value change nothing
    hp = expand.expanded_settings(dense, {"n_layers": 6, "dim": 32}, 2, 1, "identity", 2)
    assert (hp.n_layers, hp.dim) == (6, 32)
    # tau may be a whole group (2), not more (the model's 4 layers: a merge of 3 would read the
    # group's 2 and divide by 3); identity reads no tau: groups of one layer take the default
    for init in ("linear", "slerp"):  # (slerp's merge would index past the group)
        assert expand.expanded_settings(dense, {}, 2, 1, init, 2).n_layers == 6
        with pytest.raises(support.UserError, match=r"--tau=3 must lie in \[1, 2\] \(layers per"):
            expand.expanded_settings(dense, {}, 2, 1, init, 3)
    # n_layers given as another count; settings that training (the resume) would refuse
    with pytest.raises(support.UserError, match="^n_layers is derived: 6, not 7$"):
        expand.expanded_settings(dense, {"n_layers": 7}, 2, 1, "identity", 2)
    with pytest.raises(support.UserError, match="^train_tokens is less than one global batch$"):
        expand.expanded_settings(dense, {"train_tokens": 1}, 2, 1, "identity", 2)
    assert expand.expanded_settings(dense, {}, 4, 2, "identity", 2).n_layers == 4 * (1 + 2)
    # a checkpoint whose router is tied to the layer count: refused, whatever router it would
    # become (the dense model's weights would not hold its router's)
    tied = tiny(router="skip_middle", n_layers=4)
    for overrides in ({}, {"router": "none"}):
        with pytest.raises(support.UserError, match="expand a dense or DLO checkpoint"):
            expand.expanded_settings(tied, overrides, 2, 1, "identity", 2)


@pytest.mark.slow
def test_an_expansion_records_how_it_was_made_and_a_signal_while_writing_leaves_nothing(
    tmp_path, capsys, monkeypatch
):
    source = TINY_RUN + ["--router=none", "--stop_step=1", f"--run_dir={tmp_path / 'dense'}"]
    code, _, err = run_main(source, capsys)
    assert code == 0, err
    expand_main = load_command("expand.py").main
    new = tmp_path / "new run"  # (a space: the command quoted as a shell takes it)
    dense = os.path.relpath(tmp_path / "dense")  # (from the repository: recorded resolved)
    argv = [dense, str(new), "--groups=2", "--per_group=1", "--init=copy"]
    code, _, err = run_main(argv, capsys, expand_main)
    assert code == 0, err
    record = json.loads((new / "expand.json").read_text())
    how = ("source_step", "groups", "per_group", "init", "tau")
    assert [record[k] for k in how] == [1, 2, 1, "copy", 2]
    assert record["expanded_from"] == str(tmp_path / "dense")
    assert record["hp"]["n_layers"] == 2 * (2 // 2 + 1)  # P (R / P + q)
    assert shlex.split(record["command"]) == ["python", "expand.py", *argv]
    ckpt = sources.load_checkpoint(str(new))
    assert (ckpt["step"], ckpt["world_size"], ckpt["hp"]["n_layers"]) == (0, 1, 4)
    # a folder whose checkpoint is another run's (expand.json would name a folder whose logs
    # describe that other run): refused, as export and a resume refuse it; nothing written
    shutil.copytree(tmp_path / "dense", tmp_path / "mixed")
    foreign = torch.load(tmp_path / "dense" / "checkpoint.pt", weights_only=True)
    torch.save({**foreign, "run_id": "0123456789abcdef"}, tmp_path / "mixed" / "checkpoint.pt")
    code, _, err = run_main([tmp_path / "mixed", tmp_path / "m"], capsys, expand_main)
    assert code == 2 and "checkpoint.pt belongs to another run" in err and err.count("\n") == 1
    assert not (tmp_path / "m").exists()
    # exported before any training, its card says what made it: expand.json's command, commit
    # and source (resolved), not "unknown"
    code, _, err = run_main([new, tmp_path / "card"], capsys, load_command("export.py").main)
    assert code == 0, err
    card = (tmp_path / "card" / "README.md").read_text()
    assert f"from a depth expansion (expand.py) of {tmp_path / 'dense'}\n" in card
    assert f"command: `{record['command']}`" in card
    assert f"- commit: {record['git_commit']}" in card and record["git_commit"] != "unknown"
    assert not json.loads((tmp_path / "card" / "config.json").read_text())["trained"]["logged"]
    # a signal (Ctrl-C) during the last write: what it wrote is taken back, the folder too
    real = fileio.write_atomically

    def interrupted(path, *args, **kwargs):
        if os.path.basename(path) == "train.log":
            raise support.Interrupted(signal.SIGINT)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fileio, "write_atomically", interrupted)
    code, _, err = run_main(argv[:1] + [str(tmp_path / "x" / "y")], capsys, expand_main)
    assert code == 128 + signal.SIGINT and err == "", err
    assert not (tmp_path / "x").exists()
    # and a second Ctrl-C while that is taken back: all of it taken back still
    remove = os.remove

    def remove_and_signal(path):
        remove(path)
        signal_self()

    monkeypatch.setattr(os, "remove", remove_and_signal)
    code, _, err = run_main(argv[:1] + [str(tmp_path / "x" / "y")], capsys, expand_main)
    assert code == 128 + signal.SIGINT and err == "", err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_an_expansion_onto_other_shards_starts_at_their_first_global_batch(tmp_path, capsys):
    # their first shard holds no global batch (the loader passes over it): the new run starts
    # where a run of its own would, and trains (its position at shard 0 was refused)
    tokens = np.random.default_rng(0).integers(0, 50257, 3000)
    write_shard(tmp_path / "o_0.bin", tokens[:100])
    write_shard(tmp_path / "o_1.bin", tokens)
    source = TINY_RUN + ["--router=none", "--batch_size=4", "--device_batch_size=4"]
    source += ["--train_tokens=512", "--val_tokens=256", f"--run_dir={tmp_path / 'dense'}"]
    code, _, err = run_main(source, capsys)
    assert code == 0, err
    code, _, err = run_main(
        [tmp_path / "dense", tmp_path / "new", "--train_files=" + str(tmp_path / "o_*.bin")],
        capsys,
        load_command("expand.py").main,
    )
    assert code == 0, err
    loader = sources.load_checkpoint(str(tmp_path / "new"))["loader"]
    assert (loader["shard"], loader["pos"], loader["laps"]) == (1, 0, 0)
    assert json.loads((tmp_path / "new" / "expand.json").read_text())["data_position"] == loader
    code, _, err = run_main([f"--resume={tmp_path / 'new'}"], capsys)
    assert code == 0, err


def test_train_dense_expand_and_continue_with_dlo(tmp_path, capsys):
    base = [
        "--preset=smoke",
        "--max_seq_len=32",
        "--seq_len=32",
        "--batch_size=8",
        "--device_batch_size=4",
        "--val_tokens=512",
        "--val_every=10",
    ]
    shape = ["--n_layers=2", "--dim=32", "--n_heads=4", "--n_kv_heads=2"]
    code, _, err = run_main(
        base + shape + ["--router=none", "--train_tokens=5120", f"--run_dir={tmp_path / 'dense'}"],
        capsys,
    )
    assert code == 0, err
    expand_main = load_command("expand.py").main

    def expand_cli(*args):  # in this process, as its __main__ runs it -> (status, out, err)
        return run_main(args, capsys, expand_main)

    # the shape comes from the checkpoint: P = 1 group of 2 layers, q = 2 new ones
    code, out, err = expand_cli(
        tmp_path / "dense",
        tmp_path / "my dlo",
        "--per_group=2",
        "--router=dlo",
        "--dlo_rho=0.5",
        "--dlo_anneal_steps=10",
        "--train_tokens=7680",
    )
    assert code == 0 and f"--resume={shlex.quote(str(tmp_path / 'my dlo'))}\n" in out, err
    expanded = sources.load_checkpoint(str(tmp_path / "my dlo"))
    assert expanded["step"] == 0  # it reads on where the source stopped: the tokens it has not seen
    source = sources.load_checkpoint(str(tmp_path / "dense"))["loader"]
    assert expanded["loader"] == source
    # where the source stopped, by hand: 5120 tokens in steps of 8 x 32, within the sample's
    # one training shard
    assert (source["shard"], source["pos"], source["laps"]) == (0, 5120, 0)
    assert json.loads((tmp_path / "my dlo" / "expand.json").read_text())["data_position"] == source
    code, _, err = run_main([f"--resume={tmp_path / 'my dlo'}"], capsys)
    assert code == 0, err
    dense = [m for m in read_metrics(tmp_path / "dense") if m["kind"] == "val"]
    dlo = [m for m in read_metrics(tmp_path / "my dlo") if m["kind"] == "val"]
    assert json.loads((tmp_path / "my dlo" / "config.json").read_text())["n_layers"] == 4
    assert "def train(" in (tmp_path / "my dlo" / "train.log").read_text()  # the source, once
    # identity expansion: the expanded model starts exactly where the dense one ended
    assert dlo[0]["step"] == 0 and dlo[0]["val_loss"] == pytest.approx(
        dense[-1]["val_loss"], abs=1e-4
    )
    assert dlo[-1]["val_loss"] < dlo[0]["val_loss"]
    assert len(dlo[-1]["mlp_active"]) == 4 and min(dlo[-1]["mlp_active"]) < 1.0
    assert dlo[-1]["fwd_flops_per_token"] < dlo[-1]["fwd_flops_per_token_dense"]
    # refused, with one error line and nothing written: a DLO checkpoint's routers fit no other
    # router; a router tied to the layer count; a shape field; a setting of initial weights
    # that the checkpoint's replace (the seed but for --init=random); a checkpoint already there
    for args, message in (
        (
            (tmp_path / "my dlo", tmp_path / "x", "--router=mod"),
            "expands into a dlo model, not router=mod",
        ),
        (
            (tmp_path / "dense", tmp_path / "x", "--router=skip_middle"),
            "router=skip_middle is tied to the layer count",
        ),
        ((tmp_path / "dense", tmp_path / "x", "--dim=64"), "keeps the checkpoint's shape"),
        ((tmp_path / "dense", tmp_path / "x", "--groups=3"), "cannot make 3 groups of 2"),
        ((tmp_path / "dense", tmp_path / "x", "--init=linear", "--tau=3"), "--tau=3"),
        ((tmp_path / "dense", tmp_path / "x", "--init=slerp", "--tau=3"), "--tau=3"),
        (
            (tmp_path / "dense", tmp_path / "x", "--train_tokens=1"),
            "train_tokens is less than one global batch",
        ),
        ((tmp_path / "dense", tmp_path / "x", "--init=magic"), "--init: invalid choice"),
        ((tmp_path / "dense", tmp_path / "x", "--seed=3"), "--seed sets a new model's initial"),
        (
            (tmp_path / "dense", tmp_path / "x", "--init=copy", "--init_std=0.1"),
            "--init_std sets a new model's initial",
        ),
        ((tmp_path / "dense", tmp_path / "x", "--nope=1"), "unknown field 'nope'"),
        ((tmp_path / "nowhere", tmp_path / "x"), "nowhere: no such folder"),
        (
            (tmp_path / "dense", tmp_path / "x", "--val_tokens=1e8"),
            "more than the validation shards hold",
        ),
        (
            (tmp_path / "dense", tmp_path / "my dlo"),
            "dlo already holds checkpoint.pt, expand.json, "
            "train.log, checkpoint.prev.pt, metrics.jsonl, config.json: expand into a folder",
        ),
    ):
        code, _, err = expand_cli(*args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, (args, err)
        assert not (tmp_path / "x").exists()
    # --init=random's new layers are drawn from --seed: two seeds, two layers, the originals kept
    new = {}
    for seed in (3, 4):
        code, _, err = expand_cli(
            tmp_path / "dense", tmp_path / f"r{seed}", "--init=random", f"--seed={seed}"
        )
        assert code == 0, err
        new[seed] = sources.load_checkpoint(str(tmp_path / f"r{seed}"))["model"]
    assert torch.equal(new[3]["blocks.0.attn.wq.weight"], new[4]["blocks.0.attn.wq.weight"])
    assert not torch.equal(new[3]["blocks.2.attn.wq.weight"], new[4]["blocks.2.attn.wq.weight"])
    # nor onto an aborted run's logs, or a file (or a link) of that name of the user's: neither
    # moved nor replaced
    for name in ("train.log", "expand.json"):
        (tmp_path / "mine").mkdir(exist_ok=True)
        (tmp_path / "mine" / name).write_text("mine")
        code, _, err = expand_cli(tmp_path / "dense", tmp_path / "mine")
        assert code == 2 and f"mine already holds {name}: " in err and err.count("\n") == 1, err
        assert [p.name for p in (tmp_path / "mine").iterdir()] == [name]
        (tmp_path / "mine" / name).unlink()
    (tmp_path / "mine" / "train.log").symlink_to(tmp_path / "missing")  # a link, dangling
    code, _, err = expand_cli(tmp_path / "dense", tmp_path / "mine")
    assert code == 2 and "mine already holds train.log: " in err and err.count("\n") == 1, err
    assert os.readlink(tmp_path / "mine" / "train.log") == str(tmp_path / "missing")
    assert os.listdir(tmp_path / "mine") == ["train.log"]
    # a disk that fills while the new checkpoint is written: named, status 1, nothing left
    # over the 1 MiB probe
    r = run_command(
        "expand.py",
        tmp_path / "dense",
        tmp_path / "x" / "y",
        timeout=300,
        preexec_fn=lambda: disk_nearly_full(2 << 20),
    )
    assert (
        r.returncode == 1
        and r.stderr == f"error: {tmp_path / 'x' / 'y' / 'checkpoint.pt'}: File too large\n"
    )
    assert not (tmp_path / "x").exists()
