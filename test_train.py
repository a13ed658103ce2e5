"""Tests for train_gpt.py. CPU only; run with `python -m pytest -q test_train.py`.

Each test checks a property against a reference written here: a plain softmax attention,
hand-computed controller steps, FlopCounterMode, shards written by the test, a one-process
run against a two-process one.
"""

import contextlib
import copy
import errno
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import expand
import routers
import runs
import sample
import support
import train_gpt as tg
from data import shards

HERE = os.path.dirname(os.path.abspath(__file__))


def sha256(data):
    return hashlib.sha256(data).hexdigest()


# the GPT-2 BPE offline, as .ci/run sets it; online, tiktoken downloads it instead
_BPE_CACHE = os.path.join(HERE, "..", "shared", "tiktoken")
if os.path.isdir(_BPE_CACHE):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.abspath(_BPE_CACHE))
warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager Flex on CPU warns


def tiny(**kw) -> tg.Hyperparameters:
    base = dict(
        vocab_size=97,
        n_layers=4,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=16,
        seq_len=16,
        attn_impl="sdpa",
    )
    return replace(tg.Hyperparameters(), **{**base, **kw})


def reference_attention(q, k, v, log_g):
    """Plain causal softmax with ln g added on the key axis, GQA by repeating kv heads."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.size(2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if log_g is not None:
        scores = scores + log_g[:, None, None, :]  # key j gets ln g_j
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def logits_gates(model, idx, **kw):
    """-> (logits, the skip_middle gates g (L, B, T), or None without them)."""
    out = model(idx, **kw)
    return out.logits, out.route.get("gates")


def random_qkv_logg(B=2, H=4, Hkv=2, T=24, hd=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, hd, generator=gen) for h in (H, Hkv, Hkv))
    g = torch.rand(B, T, generator=gen)
    g[:, ::5] = 0.0  # some fully gated keys
    g[:, 1::7] = 1.0
    return q, k, v, torch.log(g.clamp(min=1e-6))


# ---------------------------------------------------------------------------- model


def test_zero_gate_parameters_give_the_dense_model():
    torch.manual_seed(0)
    dense = tg.GPT(tiny(router="none"))
    gated = tg.GPT(tiny(router="skip_middle", gate_init="zero"))
    missing, unexpected = gated.load_state_dict(dense.state_dict(), strict=False)
    assert unexpected == [] and all(k.startswith("router.gates.") for k in missing) and missing
    assert all((p == 0).all() for p in gated.router.gates.parameters())
    idx = torch.randint(0, 97, (3, 16))
    ld, gd = logits_gates(dense, idx)
    lg, gg = logits_gates(gated, idx)
    assert gd is None and torch.equal(gg, torch.ones_like(gg))
    assert (ld - lg).abs().max().item() <= 1e-6


def test_paper_gate_init_closes_most_middle_gates_at_step_0():
    # Section 3.1: every weight N(0, 0.02), the gate linears included; at the paper's width
    # w.h has a spread of about 0.02 * sqrt(768) = 0.55, so S often passes 1 by the middle
    torch.manual_seed(0)
    hp = replace(tg.Hyperparameters(), vocab_size=1024, attn_impl="sdpa")
    assert (hp.dim, hp.n_layers, hp.gate_init) == (768, 12, "normal")
    model = tg.GPT(hp).eval()
    assert all(g.weight.std().item() == pytest.approx(0.02, rel=0.1) for g in model.router.gates)
    assert all((g.bias == 0).all() for g in model.router.gates)
    with torch.no_grad():
        gates = logits_gates(model, torch.randint(0, 1024, (4, 128)))[1]  # (L, B, T)
    middle = gates[hp.n_layers // 2 - 1]
    assert (middle == 0).float().mean() > 0.5 and middle.mean() < 0.6  # far from all-ones
    assert (gates[0] > 0).float().mean() > 0.5  # the first block still runs for most tokens


def flex_or_sdpa(impl, q):
    """What the model passes for each path: Flex's causal block mask for q's length, or None."""
    return tg.causal_block_mask(q.size(2), str(q.device)) if impl == "flex" else None


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_attention_matches_reference_softmax(impl):
    q, k, v, log_g = random_qkv_logg()
    ref = reference_attention(q, k, v, log_g)
    out = tg.gated_attention(q, k, v, log_g, flex_or_sdpa(impl, q))
    assert (out - ref).abs().max().item() < 1e-5
    dense = tg.gated_attention(q, k, v, None, flex_or_sdpa(impl, q))
    assert (dense - reference_attention(q, k, v, None)).abs().max().item() < 1e-5
    assert (dense - out).abs().max().item() > 1e-2  # the gate term really changes the output


def test_sdpa_and_flex_paths_agree():
    q, k, v, log_g = random_qkv_logg(T=40, seed=3)
    a = tg.gated_attention(q, k, v, log_g, None)
    b = tg.gated_attention(q, k, v, log_g, flex_or_sdpa("flex", q))
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_query_axis_gate_is_cancelled_by_softmax(impl):
    # the authors' released indexing: ln g_i on every logit of query row i, a constant per row
    q, k, v, log_g = random_qkv_logg(seed=4)
    ungated = reference_attention(q, k, v, None)
    on_query = tg.gated_attention(q, k, v, log_g, flex_or_sdpa(impl, q), axis="query")
    on_key = tg.gated_attention(q, k, v, log_g, flex_or_sdpa(impl, q), axis="key")
    assert (on_query - ungated).abs().max().item() < 1e-5
    assert (on_key - ungated).abs().max().item() > 1e-2


def test_query_axis_block_attends_as_an_ungated_block():
    hp = tiny(gate_axis="query")
    torch.manual_seed(0)
    block = tg.Block(hp)
    x = block.attn_in(torch.randn(4, 12, hp.dim))
    log_g = torch.log(mixed_gates(4, 12).squeeze(-1).clamp(min=1e-6))
    ungated = block.attn(x, None, None)
    assert (block.attn(x, log_g, None) - ungated).abs().max().item() < 1e-5
    block.attn.gate_axis = "key"
    assert (block.attn(x, log_g, None) - ungated).abs().max().item() > 1e-3


def test_gate_settings_that_make_no_sense_are_refused():
    ok = dict(batch_size=32, device_batch_size=32, train_tokens=32 * 16, val_tokens=32 * 16)
    for kw, message in [
        (dict(gate_axis="query", compact=True), "compact=true needs gate_axis=key"),
        (dict(gate_axis="value"), "gate_axis='value'"),
        (dict(gate_init="uniform"), "gate_init='uniform'"),
        (dict(router="none", gate_init="zero"), "router=none has none"),
        (dict(router="dlo", gate_axis="query"), "router=dlo has none"),
    ]:
        with pytest.raises(tg.UserError, match=re.escape(message)):
            tg.validate(tiny(**ok, **kw), 1)
    tg.validate(tiny(**ok, gate_axis="query", gate_init="zero"), 1)


def test_sdpa_gradients_match_reference():
    q, k, v, log_g = random_qkv_logg(seed=1)
    ins = [t.clone().requires_grad_() for t in (q, k, v, log_g)]
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, log_g)]
    w = torch.randn(2, 4, 24, 8)
    (tg.gated_attention(*ins, None) * w).sum().backward()
    (reference_attention(*ref_ins) * w).sum().backward()
    for a, b in zip(ins, ref_ins, strict=True):
        assert (a.grad - b.grad).abs().max().item() < 1e-5
    assert ins[3].grad.abs().sum() > 0  # ln g is differentiable: gates learn from attention


def test_zero_gate_key_has_no_influence_on_other_tokens():
    q, k, v, log_g = random_qkv_logg(B=1, T=12, seed=2)
    j, others = 4, [i for i in range(12) if i != 4]
    k2, v2 = k.clone(), v.clone()
    k2[0, :, j] += 0.5
    v2[0, :, j] += 3.0
    change = {}
    for gate in (0.0, 1.0):
        lg = log_g.clone()
        lg[0, j] = math.log(max(gate, 1e-6))
        before = tg.gated_attention(q, k, v, lg, None)
        after = tg.gated_attention(q, k2, v2, lg, None)
        change[gate] = (after - before)[:, :, others].abs().max().item()
    assert change[1.0] > 1e-2  # an open key does influence later tokens
    # a closed key acts only through the 1e-6 floor on g: about a millionth of the effect
    assert change[0.0] < 1e-4 * change[1.0]


def test_block_leaves_gated_token_untouched():
    hp = tiny()
    torch.manual_seed(0)
    block = tg.Block(hp)
    x = torch.randn(1, 10, hp.dim)
    g = torch.rand(1, 10, 1) * 0.9 + 0.1
    g[0, 3] = 0.0
    y = block(x, g, None)
    assert torch.equal(y[0, 3], x[0, 3])  # g = 0: the residual passes through unchanged
    x2 = x.clone()
    x2[0, 3] += 5.0
    y2 = block(x2, g, None)
    others = [i for i in range(10) if i != 3]
    assert (y2 - y)[0, others].abs().max().item() < 1e-4


def test_gated_block_matches_a_block_written_out_with_fractional_gates():
    # Section 2 written out: x + g Norm(Attn(Norm(x))) with ln max(g, eps) on each key's logit
    # (eq. 3), then + g Norm(FFN(Norm(.))); gates spread over (0, 1), some 0, some below eps
    hp = tiny(gate_eps=1e-3)
    torch.manual_seed(0)
    block, x = tg.Block(hp), torch.randn(2, 12, hp.dim)
    g = torch.rand(2, 12, 1)
    g[:, ::4], g[:, 1::5] = 0.0, 1e-5
    a, B, T = block.attn, 2, 12
    h = block.attn_in(x)
    q, k, v = (w(h).view(B, T, -1, a.head_dim).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
    log_g = torch.log(torch.maximum(g[..., 0], torch.tensor(hp.gate_eps)))
    y = reference_attention(a.rotary(q), a.rotary(k), v, log_g).transpose(1, 2).reshape(B, T, -1)
    mid = x + g * block.attn_out(a.wo(y))
    expected = mid + g * block.ffn_out(block.ffn(block.ffn_in(mid)))
    assert (block(x, g, None) - expected).abs().max().item() < 1e-5


def test_gate_parameters_receive_gradient_inside_the_open_interval():
    torch.manual_seed(0)
    model = tg.GPT(tiny())
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=0.02)
        torch.nn.init.constant_(gate.bias, 0.3)
    idx = torch.randint(0, 97, (2, 16))
    logits, gates = logits_gates(model, idx)
    assert ((gates > 0) & (gates < 1)).float().mean() > 0.9
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    for gate in model.router.gates:
        assert gate.weight.grad.abs().sum() > 0 and gate.bias.grad.abs().sum() > 0


def test_zero_initialised_gates_are_not_stuck():
    # deviation in the docstring: relu'(0) = 0 would leave zero-initialised gates at 1 forever
    torch.manual_seed(0)
    model = tg.GPT(tiny(gate_init="zero"))
    _, gates = logits_gates(model, torch.randint(0, 97, (2, 16)))
    assert torch.equal(gates, torch.ones_like(gates))
    gates.mean().backward()  # what the controller's alpha * mean term differentiates
    assert all(gate.bias.grad.item() != 0 for gate in model.router.gates)


def test_eq1_and_eq2_have_gradient_one_at_their_bounds_on_every_torch():
    # torch 2.15 made clamp's gradient 0 at a bound: with it, zero-initialised gates never move
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0], requires_grad=True)
    y = tg.clamp_keep_grad(x, 0.0, 1.0)
    y.sum().backward()
    assert torch.equal(y, x.detach().clamp(0, 1)) and x.grad.tolist() == [0, 1, 1, 1, 0]
    x.grad = None
    tg.clamp_keep_grad(x, 0.0).sum().backward()  # eq. 1's ReLU
    assert x.grad.tolist() == [0, 1, 1, 1, 1]


def test_the_defaults_are_the_papers_table_2_and_section_3_1():
    hp = tg.Hyperparameters()
    table2 = dict(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        vocab_size=50257,
        ffn_mult=4,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=1024,
        init_std=0.02,
        batch_size=512,
        device_batch_size=32,
        lr=1e-3,
        beta1=0.8,
        beta2=0.95,
        adam_eps=1e-10,
        weight_decay=0.0,
        warmup_frac=0.1,
        warmup_start=0.1,
    )
    # Section 2.4
    section = dict(
        seq_len=1024,
        train_tokens=10_000_000_000,
        sandwich_norm=True,  # 3.1
        gate_init="normal",
        gate_axis="key",
        router="skip_middle",
        gamma=1e-3,
        delta=1e-2,
        mu_start=1.0,
        controller="proportional_tol",
    )
    assert {k: getattr(hp, k) for k in {**table2, **section}} == {**table2, **section}
    assert hp.batch_size * hp.seq_len == 524_288  # Section 3.1's tokens per global batch
    opt = tg.optimizer(tg.GPT(tiny()), tiny())  # AdamW, one learning rate for every parameter
    assert type(opt) is torch.optim.AdamW and {g["lr"] for g in opt.param_groups} == {tiny().lr}
    # linear warm-up over 10% of the steps from 10% of the peak, then cosine decay
    assert [tg.lr_at(hp, s, 1000) / hp.lr for s in (0, 50, 100)] == pytest.approx([0.1, 0.55, 1.0])
    assert tg.lr_at(hp, 550, 1000) / hp.lr == pytest.approx(0.5)


def test_mirrored_blocks_share_a_gate():
    assert [tg.mirror(i, 6) for i in range(6)] == [0, 1, 2, 2, 1, 0]
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=6))
    assert len(model.router.gates) == 3
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=0.1)
        torch.nn.init.constant_(gate.bias, 0.2)
    _, gates = logits_gates(model, torch.randint(0, 97, (2, 16)))
    for layer in range(6):
        assert torch.equal(gates[layer], gates[5 - layer])
    assert not torch.equal(gates[0], gates[1])
    assert (gates[1] <= gates[0]).all() and (gates[2] <= gates[1]).all()  # S only grows


def test_odd_layer_count_is_rejected_when_gated():
    with pytest.raises(tg.UserError, match="even"):
        tg.validate(tiny(n_layers=3), 1)
    tg.validate(
        tiny(
            n_layers=3,
            router="none",
            batch_size=32,
            device_batch_size=32,
            train_tokens=32 * 16,
            val_tokens=32 * 16,
        ),
        1,
    )


# ---------------------------------------------------------------------------- controller


def controller(kind, **kw):
    hp = tiny(
        controller=kind, mu_start=1.0, mu_end=0.5, gamma=0.1, delta=0.05, fixed_coef=0.3, **kw
    )
    return tg.GateController(hp)


def test_mean_and_variance_targets():
    c = controller("proportional_tol", n_layers=6)
    assert c.mu.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.5, 0.75, 1.0])
    assert c.var.tolist() == pytest.approx([0.0, 0.1875, 0.25, 0.25, 0.1875, 0.0])


def test_controller_updates_match_hand_computed_steps():
    mean = torch.tensor([0.98, 0.70, 0.40, 0.40])  # targets 1.0, 0.5, 0.5, 1.0
    var = torch.tensor([0.01, 0.22, 0.32, 0.02])  # targets 0, 0.25, 0.25, 0
    # deviations: mean -0.02, 0.20, -0.10, -0.60; var 0.01, -0.03, 0.07, 0.02
    c = controller("proportional_tol")
    c.update(mean, var)
    assert c.alpha.tolist() == pytest.approx([0.0, 0.02, -0.01, -0.06])  # |dev| > 0.05 only
    assert c.beta.tolist() == pytest.approx([0.0, 0.0, 0.007, 0.0])
    c.update(mean, var)
    assert c.alpha.tolist() == pytest.approx([0.0, 0.04, -0.02, -0.12])
    c = controller("proportional")
    c.update(mean, var)
    assert c.alpha.tolist() == pytest.approx([-0.002, 0.02, -0.01, -0.06])
    assert c.beta.tolist() == pytest.approx([0.001, -0.003, 0.007, 0.002])
    c = controller("adaptive")
    c.update(mean, var)
    assert c.alpha.tolist() == pytest.approx([-0.1, 0.1, -0.1, -0.1])
    assert c.beta.tolist() == pytest.approx([0.1, -0.1, 0.1, 0.1])
    for kind in ("sparsity", "sparsity_variance", "sparsity_variance_l2", "none"):
        c = controller(kind)
        before = (c.alpha.clone(), c.beta.clone())
        c.update(mean, var)
        assert torch.equal(c.alpha, before[0]) and torch.equal(c.beta, before[1])


def test_router_update_feeds_the_controller_the_global_batch_mean_and_variance():
    # SkipMiddle.loss gives sums over each micro-batch, update turns the sums over the global
    # batch into eq. (4)'s statistics: the mean and the population variance of each layer's
    # gates over every token (not the second moment, not a mean of per-micro-batch variances)
    hp = tiny(controller="proportional", mu_start=1.0, mu_end=0.5, gamma=0.1)
    router = tg.GPT(hp).router
    torch.manual_seed(0)
    micro = [torch.rand(4, 2, 8) ** 2, torch.rand(4, 3, 8)]  # (L, B, T): two micro-batches
    sums = sum(router.loss({"gates": g}, 0)[1] for g in micro)
    router.update(sums, sum(g[0].numel() for g in micro), 0)
    every = torch.cat([g.flatten(1) for g in micro], dim=1).double()  # (L, all tokens)
    mean = every.mean(dim=1)
    var = ((every - mean[:, None]) ** 2).mean(dim=1)  # written out: population variance
    ref = controller("proportional")
    ref.update(mean, var)
    assert torch.allclose(router.ctrl.alpha, ref.alpha) and torch.allclose(
        router.ctrl.beta, ref.beta
    )
    assert (ref.beta.abs() > 1e-4).all()  # the variance terms are not vanishing


def test_controller_state_follows_the_model_and_is_used_where_it_lives():
    # on a GPU the loss and the update must not copy the coefficients between host and
    # device every micro-step: they are buffers that move with the model. The meta device
    # stands in for the GPU here (any read or copy to the host raises there)
    model = tg.GPT(tiny(n_layers=4)).to("meta")
    ctrl = model.router.ctrl
    assert {t.device.type for t in (ctrl.alpha, ctrl.beta, ctrl.mu, ctrl.var)} == {"meta"}
    gates = torch.rand(4, 2, 8, device="meta")
    reg, sums = model.router.loss({"gates": gates}, 0)
    model.router.update(sums, 16.0, 0)
    assert reg.device.type == "meta" and ctrl.alpha.device.type == "meta"
    assert "alpha" not in str(list(model.state_dict()))  # routing state, saved on its own
    saved = tg.GPT(tiny(n_layers=4)).router.routing_state()["controller"]
    assert saved["alpha"].device.type == "cpu" and saved["alpha"].dtype == torch.float64


def test_controller_losses_match_hand_computed_values():
    # (L=4, B=2, T=2)
    gates = torch.tensor(
        [
            [[1.0, 1.0], [1.0, 1.0]],
            [[0.0, 1.0], [0.5, 0.5]],
            [[0.0, 1.0], [0.5, 0.5]],
            [[1.0, 1.0], [1.0, 1.0]],
        ]
    )
    # per layer mean 1, .5, .5, 1; population variance 0, .125, .125, 0
    c = controller("sparsity")
    assert c.loss(gates).item() == pytest.approx(0.3 * (1 + 0.5 + 0.5 + 1) / 4)
    c = controller("sparsity_variance")
    assert c.loss(gates).item() == pytest.approx(0.3 * (3 + 0.25) / 4)
    c = controller("sparsity_variance_l2")  # targets mean 1, .5, .5, 1; var 0, .25, .25, 0
    assert c.loss(gates).item() == pytest.approx(0.3 * (2 * 0.125**2) / 4)
    # every gate 0.5: means miss their targets by -0.5, 0, 0, -0.5; variances by 0, -.25, -.25, 0
    assert c.loss(torch.full_like(gates, 0.5)).item() == pytest.approx(
        0.3 * (2 * 0.5**2 + 2 * 0.25**2) / 4
    )
    c = controller("proportional_tol")
    assert c.loss(gates).item() == 0.0  # coefficients start at zero
    c.alpha[:] = torch.tensor([1.0, 2.0, 2.0, 1.0], dtype=torch.float64)
    c.beta[:] = torch.tensor([0.0, -4.0, -4.0, 0.0], dtype=torch.float64)
    assert c.loss(gates).item() == pytest.approx((1 + 1 + 1 + 1 - 0.5 - 0.5) / 4)
    assert controller("none").loss(gates).item() == 0.0


# ---------------------------------------------------------------------------- data


def write_shard(path, tokens, magic=20240520, version=1, count=None):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, version, len(tokens) if count is None else count)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def test_loader_reads_what_the_test_wrote(tmp_path):
    tokens = np.arange(1000) % 50257
    write_shard(tmp_path / "d_000.bin", tokens)
    assert np.array_equal(tg.read_shard(str(tmp_path / "d_000.bin")), tokens)
    # two ranks, 2 sequences of 8 each: rank 1 starts after rank 0's 16 tokens
    loaders = [tg.DistributedLoader(str(tmp_path / "d_*.bin"), 2, 8, r, 2) for r in (0, 1)]
    for step in range(3):
        for r, loader in enumerate(loaders):
            x, y = loader.next_batch()
            start = step * 32 + r * 16
            assert x.flatten().tolist() == list(range(start, start + 16))
            assert y.flatten().tolist() == list(range(start + 1, start + 17))


def test_loader_rejects_bad_magic_and_truncation(tmp_path):
    write_shard(tmp_path / "bad.bin", range(100), magic=1234)
    with pytest.raises(tg.UserError, match="magic"):
        tg.read_shard(str(tmp_path / "bad.bin"))
    write_shard(tmp_path / "short.bin", range(100), count=200)
    with pytest.raises(tg.UserError, match="truncated"):
        tg.read_shard(str(tmp_path / "short.bin"))
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    with pytest.raises(tg.UserError, match="truncated"):
        tg.read_shard(str(tmp_path / "tiny.bin"))
    with pytest.raises(tg.UserError, match="no shards"):
        tg.find_shards(str(tmp_path / "missing_*.bin"))


def test_embedded_sample_is_valid():
    for name in ("sample_train_000001.bin", "sample_val_000000.bin"):
        tokens = tg.read_shard(os.path.join(HERE, "data", "sample", name))
        assert len(tokens) > 5000 and tokens.max() <= 50256 and tokens[0] == 50256


# ---------------------------------------------------------------------------- FLOPs


def math_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """Stand-in for SDPA made of matmuls, so that FlopCounterMode sees the attention."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    T = q.size(2)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def counted_flops(model, B, T, backward=False):
    """FLOPs FlopCounterMode sees for a forward (and backward) pass of a (B, T) batch, with
    the attention charged for the T(T+1)/2 pairs of a causal kernel instead of all T^2."""
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, model.hp.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(backward):
        logits = model(idx).logits
        if backward:
            logits.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in counts.items() if "bmm" in op)
    assert attention > 0.03 * counter.get_total_flops()  # the attention term matters here
    return counter.get_total_flops() - attention + attention * (T + 1) / (2 * T)


@pytest.mark.parametrize("seq_len", [64, 256])
def test_dense_flops_per_token_match_flop_counter_at_the_trained_length(monkeypatch, seq_len):
    hp = tiny(router="none", vocab_size=1000, dim=128, n_layers=2, max_seq_len=256, seq_len=seq_len)
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    reference = counted_flops(tg.GPT(hp), 1, seq_len)
    assert tg.forward_flops(hp) == pytest.approx(reference, rel=0.02)
    assert tg.flops_per_token(hp) == pytest.approx(reference / seq_len, rel=0.02)


def test_auto_attention_is_flex_only_on_cuda_and_where_its_kernels_compile():
    for dim, cuda, impl in ((64, True, "flex"), (32, True, "sdpa"), (64, False, "sdpa")):
        assert tg.attention_impl(tiny(dim=dim, n_heads=4, attn_impl="auto"), cuda) == impl
    assert tg.attention_impl(tiny(dim=32, attn_impl="sdpa"), True) == "sdpa"


def test_flex_block_mask_is_built_once_per_length_outside_the_layer_loop(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    built, real = [], fa.create_block_mask  # each mask built, by its query length
    monkeypatch.setattr(
        fa, "create_block_mask", lambda *a, **k: built.append(a[3]) or real(*a, **k)
    )
    tg.causal_block_mask.cache_clear()
    x = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        sdpa = tg.GPT(tiny(n_layers=6, max_seq_len=32, seq_len=32)).eval()
        model = tg.GPT(replace(sdpa.hp, attn_impl="flex")).eval()
        model.load_state_dict(sdpa.state_dict())
        out = [model(x).logits, model(x).logits, model(x[:, :20]).logits]
        assert built == [32, 20]  # eagerly: one per length for all 6 layers and both calls
        assert (out[0] - sdpa(x).logits).abs().max() < 1e-4  # the mask is the causal one
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x)
        assert built == [32, 20, 32] and explained.graph_break_count == 0  # compiled: once per
        # forward, before the layer loop (dynamo traces through lru_cache)
        block = model.blocks[0]  # compacted: a mask per packed length (5 and 9 tokens rounded
        for keep in (5, 9, 5, 9):  # up to a multiple of 32 / PACKS), each built once
            g = torch.zeros(2, 32, 1)
            g[:, :keep] = 0.5
            block(torch.randn(2, 32, 32), g, tg.causal_block_mask(32, "cpu"), compact=True)
        assert built == [32, 20, 32, 6, 10]


def test_mfu_counts_the_tokens_of_the_step_at_the_trained_length(monkeypatch):
    # a global batch of 3 sequences of 64 tokens with a RoPE table of 256: the old count
    # (a max_seq_len sequence per batch entry) would have overstated the MFU about 4x
    hp = tiny(
        router="none",
        vocab_size=1000,
        dim=128,
        n_layers=2,
        max_seq_len=256,
        seq_len=64,
        batch_size=3,
    )
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    step_flops = counted_flops(tg.GPT(hp), 3, 64, backward=True)  # forward + backward
    step_s = 0.25  # a made-up step time
    assert tg.mfu(hp, step_s, 1, 1e12) == pytest.approx(step_flops / step_s / 1e12, rel=0.02)
    assert tg.mfu(hp, step_s, 2, 1e12) == pytest.approx(tg.mfu(hp, step_s, 1, 1e12) / 2)
    sparse = tg.mfu(replace(hp, router="skip_middle"), step_s, 1, 1e12, active=[0.5, 0.5])
    assert sparse < 0.7 * tg.mfu(hp, step_s, 1, 1e12)  # compact: only the work executed counts
    # the peak follows the device's name (as torch.cuda.get_device_name gives it), or is given
    for name, peak in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("Tesla V100-SXM2-16GB", 0.0),
        ("", 0.0),
    ):
        assert support.peak_flops(name) == peak, name
        assert support.peak_flops(name, given=1e12) == 1e12


class FakeLog:
    """RunLog's print and record, kept."""

    def __init__(self):
        self.lines, self.records = [], []

    def print(self, line):
        self.lines.append(line)

    def record(self, record):
        self.records.append(record)


def test_compile_time_is_counted_apart_from_step_time():
    # runs.compile_ms grows by torch.compile's own timers when a graph compiles (a forward at
    # its call, a backward at its first backward), not when a compiled one runs; the clock
    # leaves a step's compile time out of train_time and reports it apart, as the step line does
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    before = runs.compile_ms()
    loss = f(x)
    forward = runs.compile_ms()
    loss.backward()
    backward = runs.compile_ms()
    f(x).backward()
    assert before < forward < backward == runs.compile_ms()
    log, run = FakeLog(), runs.RunState()
    clock = runs.StepClock(log, 0, 1)
    for step_ms, compile_ms in ((900.0, 800.0), (100.0, 0.0), (350.0, 250.0)):
        run.step += 1
        clock.add(run, step_ms, compile_ms)
    clock.end(run)
    assert (run.train_ms, run.timed_steps) == (200.0, 2)  # 100 + (350 - 250)
    assert log.lines == [
        "warm-up: steps 1-1 of this job untimed, 900ms (compile 800ms)",
        "compile: 1.1s in this job",
    ]
    assert log.records == [
        {"kind": "warmup", "step": 1, "steps": 1, "warmup_ms": 900.0, "compile_ms": 800.0}
    ]
    hp = tiny(router="none", batch_size=8, seq_len=64)
    stats = {
        "tokens": [512.0],
        "lm_loss": [3.0],
        "total_loss": [3.0],
        "block_active": [512.0] * 4,
        "mlp_active": [512.0] * 4,
        "packed": [64.0] * 4,
    }
    router = tg.GPT(hp).router
    tg.log_step(log, router, hp, run, 10, stats, [1e-3] * 5, (350.0, 250.0), 0.0, 1)
    assert log.lines[-1].endswith(" tok/s:5120 compile:250ms")  # 512 tokens in 100 ms
    assert (log.records[-1]["step_ms"], log.records[-1]["compile_ms"]) == (350.0, 250.0)


def test_attention_flops_count_each_sequences_own_active_pairs():
    # two 16-token sequences: at both layers the first runs all 16 tokens, the second 4. Their
    # causal pairs average (16 x 17 / 2 + 4 x 5 / 2) / 2 = 73 per sequence; the square of the
    # mean share, (10 / 16)^2 x 16 x 17 / 2 = 53.125, would undercount the attention
    hp = tiny(n_layers=2)
    block = torch.zeros(2, 2, 16, dtype=torch.bool)  # (L, B, T)
    block[:, 0], block[:, 1, :4] = True, True
    sums = tg.route_sums({"block": block, "mlp": block, "gates": block.float()}, tg.GPT(hp).router)
    assert sums["attn_pairs"].tolist() == [146.0, 146.0]  # summed over the two sequences
    a, per_pair = [10 / 16] * 2, 2 * 2 * hp.n_heads * (hp.dim // hp.n_heads)  # q.k and the sum of v
    exact, squared = tg.forward_flops(hp, a, pairs=[73.0, 73.0]), tg.forward_flops(hp, a)
    assert exact - squared == pytest.approx(2 * per_pair * (73 - 53.125))


def test_query_axis_flops_keep_every_token_as_a_key():
    # a token skipped under the query-axis gate is still attended to: its K/V run
    key, query = tiny(n_layers=4), tiny(n_layers=4, gate_axis="query")
    active, T, kv = [1, 0.5, 0.5, 1], 16, 2 * 8  # kv heads x head dim
    extra_kv = 2 * 0.5 * T * 2 * 2 * 32 * kv  # two blocks, half the tokens, k and v
    extra_attn = 2 * 0.5 * 0.5 * 2 * 2 * 4 * 8 * T * (T + 1) / 2  # a(1 - a) of the pairs
    assert tg.forward_flops(query, active) - tg.forward_flops(key, active) == pytest.approx(
        extra_kv + extra_attn
    )
    assert tg.forward_flops(query) == tg.forward_flops(key)  # all active: the same


def test_sparse_flops_scale_with_active_fraction():
    hp = tiny(n_layers=4)
    full = tg.forward_flops(hp, [1, 1, 1, 1])
    assert full == tg.forward_flops(hp)
    assert tg.forward_flops(hp, [1, 0, 0, 1]) < full
    dense = tg.forward_flops(replace(hp, router="none"))
    assert full - dense == 2 * 16 * 2 * (32 + 1)  # only the two gate linears differ


def test_lr_schedule():
    hp = tiny(lr=1.0, warmup_frac=0.1, warmup_start=0.1)
    assert tg.lr_at(hp, 0, 100) == pytest.approx(0.1)
    assert tg.lr_at(hp, 5, 100) == pytest.approx(0.55)
    assert tg.lr_at(hp, 10, 100) == pytest.approx(1.0)
    assert tg.lr_at(hp, 55, 100) == pytest.approx(0.5)
    assert tg.lr_at(hp, 100, 100) == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------- end to end

TINY_RUN = [
    "--preset=smoke",
    "--n_layers=2",
    "--dim=64",
    "--n_heads=4",
    "--n_kv_heads=2",
    "--max_seq_len=64",
    "--seq_len=64",
]


def run_script(args, nproc=1):
    # one process: the test process's thread count, so that a run begun in-process and resumed
    # here reduces in the same order (bit for bit); two: one thread each, for the 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads() if nproc == 1 else 1)}
    if nproc == 1:
        cmd = [sys.executable, "train_gpt.py", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "train_gpt.py",
            *args,
        ]
    return subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_smoke_run_lowers_the_loss_and_writes_its_files(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = run_main(
        TINY_RUN
        + ["--train_tokens=20480", "--val_every=10", "--val_tokens=1024", f"--run_dir={run_dir}"],
        capsys,
    )
    assert code == 0, err[-2000:]
    for name in ("train.log", "config.json", "metrics.jsonl"):
        assert (run_dir / name).exists()
    log = (run_dir / "train.log").read_text()
    assert "class GPT(nn.Module)" in log and "torch " in log and "step:40/40 val_loss:" in log
    config = json.loads((run_dir / "config.json").read_text())
    assert config["n_layers"] == 2 and config["num_steps"] == 40 and config["grad_accum"] == 2
    metrics = read_metrics(run_dir)
    val = [m for m in metrics if m["kind"] == "val"]
    train = [m for m in metrics if m["kind"] == "train"]
    assert len(train) == 40 and [m["step"] for m in val] == [0, 10, 20, 30, 40]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 2.0
    for key in (
        "sparsity",
        "gate_mean",
        "block_active",
        "mlp_active",
        "resid_norm",
        "fwd_flops_per_token",
        "fwd_flops_per_token_dense",
        "fwd_flops_per_seq",
        "train_time_ms",
    ):
        assert key in val[-1]
    assert val[-1]["train_flops_per_token"] == 3 * val[-1]["fwd_flops_per_token"]
    assert val[-1]["fwd_flops_per_seq"] == 64 * val[-1]["fwd_flops_per_token"]
    assert set(train[0]) == {
        "kind",
        "step",
        "tokens",
        "train_loss",
        "total_loss",
        "lr",
        "layer_lr",
        "step_ms",
        "compile_ms",
        "packed",
        "redone",
        "block_active",
        "mlp_active",
        "gate_mean",
    }
    assert [m["tokens"] for m in train] == [512 * m["step"] for m in train]  # 8 x 64 per step
    assert train[0]["lr"] == pytest.approx(0.1 * 3e-3)  # the first step of the warm-up
    assert all(len(m["gate_mean"]) == len(m["block_active"]) == 2 for m in train)
    assert val[-1]["sparsity"] == pytest.approx(1 - sum(val[-1]["block_active"]) / 2)
    assert all(math.isfinite(m["total_loss"]) for m in train)
    assert all(m["compile_ms"] == 0 for m in train)  # on CPU, train() compiles nothing
    # provenance: command, commit, source hash, then the source itself
    source = (Path(HERE) / "train_gpt.py").read_bytes()
    assert log.startswith(source.decode())
    assert f"---- support.py\n{(Path(HERE) / 'support.py').read_text()}" in log
    assert "\ncommand: python train_gpt.py --preset=smoke --n_layers=2 " in log
    assert "\ngit: " in log and f"\nsource: train_gpt.py sha256 {sha256(source)}\n" in log


@pytest.mark.slow
@pytest.mark.parametrize("router", ["skip_middle", "mor"])
def test_two_processes_match_one(tmp_path, capsys, router):
    args = TINY_RUN + [
        "--dim=32",
        "--max_seq_len=32",
        "--seq_len=32",
        "--batch_size=8",
        "--device_batch_size=2",
        "--train_tokens=768",
        "--val_every=0",
        "--val_tokens=1024",
        f"--router={router}",
    ]
    args += ["--n_layers=5"] if router == "mor" else []
    code, _, err = run_main(args + [f"--run_dir={tmp_path / 'one'}"], capsys)  # one: this process
    two = run_script(args + [f"--run_dir={tmp_path / 'two'}"], nproc=2)
    assert code == 0, err[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    m1, m2 = (
        [m for m in read_metrics(tmp_path / run) if m["kind"] in ("train", "val")]
        for run in ("one", "two")
    )
    assert json.loads((tmp_path / "two" / "config.json").read_text())["grad_accum"] == 2
    assert len(m1) == len(m2) == 4  # 3 train steps and the final validation
    for a, b in zip(m1, m2, strict=True):
        key = "train_loss" if a["kind"] == "train" else "val_loss"
        assert abs(a[key] - b[key]) < 1e-4, (a, b)
    # 3 documents over both ranks' sequences: per-token losses gathered in the loader's order
    assert m1[-1]["val_docs"] == m2[-1]["val_docs"] > 1
    assert m1[-1]["val_se"] == pytest.approx(m2[-1]["val_se"], abs=1e-4)
    key = "gate_mean" if router == "skip_middle" else "block_active"  # the routing, per block
    assert m1[-1][key] == pytest.approx(m2[-1][key], abs=1e-4)


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "train.log").write_text("an earlier run\n")
    (tmp_path / "checkpoint.pt").write_bytes(b"its checkpoint")
    code, _, err = run_main(["--preset=smoke", f"--run_dir={tmp_path}"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path} already holds a run")
    assert (tmp_path / "train.log").read_text() == "an earlier run\n"
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"its checkpoint"
    assert not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- data scripts


def run_data_script(script, args, **env):
    return subprocess.run(
        [sys.executable, os.path.join("data", script), *args],
        cwd=HERE,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def fake_hub_cache(root, files):
    """A Hugging Face cache holding `files` (name -> tokens) for the FineWeb dataset repo."""
    repo = root / "datasets--kjj0--fineweb10B-gpt2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, tokens in files.items():
        write_shard(snap / name, tokens)
    return snap


def test_fetch_uses_the_hub_cache_offline_and_resumes(tmp_path):
    snap = fake_hub_cache(
        tmp_path / "hub",
        {"fineweb_val_000000.bin": range(100), "fineweb_train_000001.bin": range(50, 300)},
    )
    out = tmp_path / "data"
    env = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    r = run_data_script("cached_fineweb10B.py", ["1", f"--out={out}"], **env)
    assert r.returncode == 0, r.stderr
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):
        assert (out / name).read_bytes() == (snap / name).read_bytes()
    assert "250 tokens" in r.stdout
    r = run_data_script("cached_fineweb10B.py", ["1", f"--out={out}"], **env)
    assert r.returncode == 0 and r.stdout.count("present, skipped") == 2
    # a damaged file in the data folder is noticed and fetched again
    # (a new file: the good one may be a hard link to the cache, which must stay intact)
    damaged = (out / "fineweb_train_000001.bin").read_bytes()[:1200]
    (out / "fineweb_train_000001.bin").unlink()
    (out / "fineweb_train_000001.bin").write_bytes(damaged)
    r = run_data_script("cached_fineweb10B.py", ["1", f"--out={out}"], **env)
    assert r.returncode == 0 and "fetching it again" in r.stdout
    assert (out / "fineweb_train_000001.bin").read_bytes() == (
        snap / "fineweb_train_000001.bin"
    ).read_bytes()
    # a file neither online nor cached: one clear line, exit 2, nothing under its name
    r = run_data_script("cached_fineweb10B.py", ["2", f"--out={out}"], **env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: 1 of 3 files missing (fineweb_train_000002.bin")
    assert "Rerun `python data/cached_fineweb10B.py 2`" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "fineweb_train_000001.bin",
        "fineweb_val_000000.bin",
    ]
    # the first file alone is tried first: when it cannot be had, no other is tried (offline,
    # each would wait through the hub's retries), though the cache holds one of them
    fake_hub_cache(tmp_path / "hub2", {"fineweb_train_000001.bin": range(50, 300)})
    r = run_data_script(
        "cached_fineweb10B.py",
        ["1", f"--out={tmp_path / 'data2'}"],
        **{**env, "HF_HUB_CACHE": str(tmp_path / "hub2")},
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "(fineweb_val_000000.bin; " in r.stderr and "; the others were not tried)" in r.stderr
    assert not (tmp_path / "data2").exists()


def gpt2():
    import tiktoken

    return tiktoken.get_encoding("r50k_base")


def test_tokenize_matches_tiktoken_and_the_loader_reads_it_back(tmp_path):
    docs = [
        "The quick brown fox.",
        "Ünïcödé and emoji 🙂 too",
        "",
        "line one\nline two\n",
        "<|endoftext|> is plain text here",
    ]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for d in docs[1:-1]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    (tmp_path / "c.txt").write_text(docs[-1], encoding="utf-8")  # a .txt after a .jsonl
    out = tmp_path / "shards"
    r = run_data_script(
        "tokenize_corpus.py",
        [
            str(tmp_path / "a.txt"),
            str(tmp_path / "b.jsonl"),
            str(tmp_path / "c.txt"),
            f"--out={out}",
            "--name=t",
            "--shard_tokens=7",
            "--workers=2",
        ],
    )
    assert r.returncode == 0, r.stderr
    enc = gpt2()
    expected = [t for d in docs if d for t in [50256] + enc.encode_ordinary(d)]  # "" skipped
    files = sorted(out.glob("*.bin"))
    assert json.loads((out / "t.manifest.json").read_text())["shards"] == {
        f.name: sha256(f.read_bytes()) for f in files
    }
    assert files[-1].name == "t_val_000000.bin"  # sorted: train shards come first
    assert [f.name for f in files[:-1]] == [f"t_train_{i:06d}.bin" for i in range(1, len(files))]
    got = np.concatenate(
        [tg.read_shard(str(out / "t_val_000000.bin"))] + [tg.read_shard(str(f)) for f in files[:-1]]
    )
    assert got.tolist() == expected
    assert all(len(tg.read_shard(str(f))) == 7 for f in files[:-2])
    loader = tg.DistributedLoader(str(out / "t_train_*.bin"), 1, 3, 0, 1)
    x, y = loader.next_batch()
    assert x.flatten().tolist() == expected[7:10] and y.flatten().tolist() == expected[8:11]


def test_byte_shards_round_trip_the_bytes_of_every_document(tmp_path):
    # a .txt file's bytes exactly, invalid UTF-8 included; a JSON text's UTF-8; each document
    # after a NUL byte; every 2nd document to validation; a NUL inside a document is refused
    tokenize = load_command("data/tokenize_corpus.py")
    raw = [b"plain ascii\n", b"caf\xe9 latin-1 and a lone \xff byte", "Ünïcödé 🙂".encode()]
    for i, data in enumerate(raw[:2]):
        (tmp_path / f"{i}.txt").write_bytes(data)
    (tmp_path / "2.jsonl").write_text(json.dumps({"text": raw[2].decode()}) + "\n")
    out = tmp_path / "bytes"
    tokenize.tokenize(
        [str(tmp_path / n) for n in ("0.txt", "1.txt", "2.jsonl")],
        str(out),
        "b",
        1000,
        1,
        "bytes",
        is_val=lambda i: i % 2 == 0,
    )
    val, train = (
        tg.read_shard(str(out / n), 256).tolist()
        for n in ("b_val_000000.bin", "b_train_000001.bin")
    )
    assert bytes(val) == b"\0" + raw[0] + b"\0" + raw[2] and bytes(train) == b"\0" + raw[1]
    assert {shards.shard_encoding(str(p)) for p in out.glob("*.bin")} == {"bytes"}
    assert (
        shards.encoding("bytes").decode(train)
        == "<|endoftext|>caf\ufffd latin-1 and a lone \ufffd byte"
    )
    with pytest.raises(support.UserError, match="all 3 documents went to validation"):
        tokenize.tokenize(
            [str(tmp_path / n) for n in ("0.txt", "1.txt", "2.jsonl")],
            str(tmp_path / "v"),
            "b",
            1000,
            1,
            "bytes",
            is_val=lambda i: True,
        )
    # skipview: a character's bytes show it once, at its first byte; a stray byte as U+FFFD
    pieces = load_command("skipview.py").token_pieces(
        shards.encoding("bytes"), list("aé🙂".encode()) + [0xFF, 98]
    )
    assert pieces == ["a", "é", "", "🙂", "", "", "", "\ufffd", "b"]
    # what a command line that is not UTF-8 holds (surrogateescape) is its bytes; the separator
    # reads as GPT-2's <|endoftext|>
    enc = shards.encoding("bytes")
    assert enc.encode_ordinary("a\udcffb") == [97, 255, 98]
    assert enc.decode([0, 104, 105, 0, 0xC3, 0xA9]) == "<|endoftext|>hi<|endoftext|>\u00e9"
    (tmp_path / "nul.txt").write_bytes(b"a\0b")
    with pytest.raises(support.UserError, match="nul.txt: holds a NUL byte"):
        tokenize.tokenize([str(tmp_path / "nul.txt")], str(tmp_path / "x"), "b", 1000, 1, "bytes")
    assert not (tmp_path / "x").exists()


def test_gpt2_shards_convert_to_the_bytes_of_their_documents(tmp_path):
    # FineWeb-like GPT-2 shards, documents cut across shards: converted one for one, the bytes
    # of all shards together are every document's bytes after a NUL, as a byte corpus of them
    tokenize = load_command("data/tokenize_corpus.py")
    docs = ["First document, with ünïcödé.", "second\none " * 5, "third 🙂 " * 3]
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    tokenize.tokenize([str(tmp_path / "d.jsonl")], str(tmp_path / "g"), "fw", 9, 1)
    converted = tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "y"), "fwb")
    names = sorted(os.path.basename(p) for p in converted)
    assert names == sorted(p.name.replace("fw_", "fwb_") for p in (tmp_path / "g").glob("fw_*.bin"))
    ordered = sorted(converted, key=lambda p: int(p[-10:-4]))  # val_000000, train_000001, ...
    got = b"".join(bytes(tg.read_shard(p, 256).tolist()) for p in ordered)
    assert got == b"".join(b"\0" + d.encode() for d in docs)
    with pytest.raises(support.UserError, match="a byte shard already"):
        tokenize.convert(str(tmp_path / "y" / "fwb_*.bin"), str(tmp_path / "z"), "again")
    before = {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()}
    with pytest.raises(
        support.UserError, match="is an input, and corpus 'fw' in .* would replace it"
    ):
        tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "g"), "fw")  # in place
    assert {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()} == before
    for args, message in (
        (["--encoding=bytes"], "--encoding does not apply to the embedded sample"),
        (
            [
                f"--from_shards={tmp_path}/g/fw_*.bin",
                "--encoding=bytes",
                "--val_every=2",
                f"--out={tmp_path}/w",
            ],
            "--val_every does not apply to --from_shards",
        ),
        ([f"--check={tmp_path}/g", "--encoding=bytes"], "--encoding does not apply to --check"),
    ):
        with pytest.raises(support.UserError, match=message):
            tokenize.main(args)
    assert not (tmp_path / "w").exists()


def test_a_model_refuses_shards_of_the_other_encoding_and_trains_and_samples_bytes(
    tmp_path, capsys
):
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "a.txt").write_bytes((Path(HERE) / "README.md").read_bytes()[:60000])
    (tmp_path / "b.txt").write_bytes((Path(HERE) / "train_gpt.py").read_bytes()[:20000])
    tokenize.tokenize(
        [str(tmp_path / "b.txt"), str(tmp_path / "a.txt")],
        str(tmp_path / "s"),
        "t",
        1 << 20,
        1,
        "bytes",
        is_val=lambda i: i % 2 == 0,
    )
    capsys.readouterr()  # (the tokenizer's progress line)
    files = [f"--train_files={tmp_path}/s/t_train_*.bin", f"--val_files={tmp_path}/s/t_val_*.bin"]
    byte_model = TINY_RUN + [
        "--encoding=bytes",
        "--vocab_size=256",
        "--train_tokens=5120",
        "--val_every=0",
        "--val_tokens=512",
    ]
    for args, message in (
        (byte_model, "sample_train_000001.bin holds gpt2 tokens, but encoding=bytes"),
        (TINY_RUN + files, "t_train_000001.bin holds bytes tokens, but encoding=gpt2"),
        (TINY_RUN + ["--encoding=bytes"], "encoding=bytes has 256 token ids"),
    ):
        code, out, err = run_main(args + [f"--run_dir={tmp_path / 'refused'}"], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "refused").exists()
    code, _, err = run_main(byte_model + files + [f"--run_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err[-2000:]
    val = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "val"]
    assert val[-1]["val_loss"] < math.log(256)  # better than uniform over the bytes
    code = support.cli(
        load_command("sample.py").main,
        [str(tmp_path / "run"), "--prompt=The ", "--tokens=20", "--seed=1"],
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("The ") and len(out.split("\n--- KV")[0].encode()) >= 20


@pytest.mark.slow
def test_every_script_under_records_runs_on_todays_code(tmp_path):
    scripts = sorted(Path(HERE).glob("records/*/*.py"), key=lambda p: p.name)
    names = ["compile_time.py", "memory_step.py", "replay.py", "table.py"]
    assert [p.name for p in scripts] == names  # a new one: run it here
    for script in scripts:  # each answers --help with its docstring
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith("usage: "), (script, r.stderr[-500:])
    r = subprocess.run([sys.executable, str(scripts[3])], capture_output=True, text=True)
    readme = (scripts[3].parent / "README.md").read_text()  # its table, from its runs
    assert r.returncode == 0 and r.stdout.count("\n") == 10 and r.stdout in readme, r.stdout
    r = subprocess.run(  # CPU Inductor, a new cache: a block's graph compiled, then reused
        [sys.executable, str(scripts[0]), HERE, "--compact=0", "--steps=2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    timed = json.loads(r.stdout)
    assert timed["graphs"] == 1 and timed["steps"][0]["compile_s"] > 0, timed
    assert timed["steps"][1]["compile_s"] == 0 < timed["steps"][1]["wall_s"], timed
    r = subprocess.run(  # today's packed_lengths on the recorded counts: the run's own redos
        [sys.executable, str(scripts[2])], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.splitlines()[:2] == [
        "300 steps, 12 redone in the run",
        "packed_lengths: 12 redone, packed / needed 1.285",
    ], r.stdout + r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, str(scripts[1]), HERE, "1", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0 and re.fullmatch(
        r"device_batch=1 x 1024 n_layers=1: peak RSS "
        r"[\d.]+ GiB \(after building the model [\d.]+ GiB\), "
        r"step [\d.]+ s\n",
        r.stdout,
    ), r.stderr[-2000:]


@pytest.mark.slow
def test_gpu_check_dry_runs_every_stage_on_cpu_in_one_call_within_its_budget(tmp_path):
    # GPU_CHECK_DRY_RUN=1: gpu_check.sh on CPU at a tiny size. A call ends within its budget
    # (GPU_CHECK_SECONDS; a stage in flight is cut, its status not taken for a result, and no
    # other starts); the next call runs what is left; with room, one call runs every stage
    out = tmp_path / "check"
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OMP_NUM_THREADS": "2"}

    def call(seconds):
        t0 = time.monotonic()
        r = subprocess.run(
            ["bash", os.path.join(HERE, "gpu_check.sh"), str(out)],
            env={**env, "GPU_CHECK_SECONDS": str(seconds)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        summary = (out / "summary.txt").read_text().splitlines()
        (out / "summary.txt").unlink()
        return r.stdout, summary, time.monotonic() - t0

    stages = ["env", "paper_none", "paper_skip_middle", "paper_compact", "tests", "ddp", "bench"]
    said, first, took = call(8)  # the whole dry run takes far longer
    assert took < 8 + 10 + 5, took  # the budget, timeout's grace after its TERM, a margin
    assert [line.split(":")[0] for line in first] == stages, said
    done = [line.split(":")[0] for line in first if re.match(r"\w+: exit 0, \d+ s", line)]
    left = [line for line in first if line.split(":")[0] not in done]
    assert left and all(re.search(r"cut at \d+ s|not run, the budget of 8 s", ln) for ln in left)
    assert sorted(p.stem for p in out.glob("*.done")) == sorted(done)
    said, second, _ = call(600)
    assert [line.split(":")[0] for line in second] == stages[len(done) :], said
    assert all(re.match(r"\w+: exit 0, \d+ s", line) for line in second), second
    assert said.rstrip().split("\n")[-1].startswith("done in ")
    summary = dict(line.split(":", 1) for line in first[: len(done)] + second)
    assert re.search(r"redone: \d+ of 30 steps", summary["paper_compact"]), summary
    assert summary["bench"].count("(target ") == 3 and "FLOP ideal" in summary["bench"], summary
    learned = (out / "paper_none.txt").read_text().splitlines()[-1].split()
    assert learned[:4] == ["step", "1", "training", "loss"]  # the stage's learning check
    assert float(learned[-1]) < 0.9 * float(learned[4].rstrip(","))
    config = json.loads((out / "paper_compact" / "config.json").read_text())
    assert config["compact"] and config["router"] == "skip_middle"


def test_debian_docs_keeps_a_pages_text_and_drops_its_markup(tmp_path):
    docs = load_command("data/debian_docs.py")
    page = (
        "<html><head><title>T</title><style>p {}</style></head><body><h1>Title</h1>"
        "<p>One  &amp; <b>two</b>\tthree</p><script>var x = 1;</script><ul><li>a</li>"
        "<li>b &lt;c&gt;</li></ul><pre>  kept\n</pre>caf\u00e9</body></html>"
    ).encode()
    assert docs.page_text(page) == "Title\nOne & two three\na\nb <c>\nkept\ncaf\u00e9"


def test_debian_docs_reads_a_package_whose_stream_goes_on_past_its_archive(tmp_path):
    # a damaged .deb: dpkg-deb streams a tar archive, then far more than a pipe holds (64 KiB)
    # after its end, and a reason on stderr; the pages are read, the rest drained (before:
    # stderr read while dpkg-deb waited on a full stdout, for ever)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "dpkg-deb").write_text(
        "#!/usr/bin/env python3\nimport io, sys, tarfile\nbuf = io.BytesIO()\n"
        "with tarfile.open(fileobj=buf, mode='w') as tar:\n"
        "    info = tarfile.TarInfo('./usr/share/doc/x/index.html'); info.size = 11\n"
        "    tar.addfile(info, io.BytesIO(b'<p>page</p>'))\n"
        "sys.stderr.write('warning: trailing data\\n' * 5000)\n"
        "sys.stdout.buffer.write(buf.getvalue() + b'junk' * 100000)\n"
    )
    (bin_ / "dpkg-deb").chmod(0o755)
    code = "from data import debian_docs; print(debian_docs.package_pages('x.deb', 'x.deb'))"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=HERE,
        env={**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == "[b'<p>page</p>']\n", r.stderr[-2000:]


def fake_debian(tmp_path, apt_get: str) -> dict:
    """PATH with an apt-get running apt_get (bash) and a dpkg-deb whose --fsys-tarfile streams
    12 pages of 2,000 characters, each naming its package and number, from any .deb, and pages
    NOT_PAGES drops (translations, Sphinx's source listings and indexes, maxima's single page)
    and a redirect shorter than MIN_TEXT."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "apt-get").write_text("#!/bin/bash\n" + apt_get)
    (bin_ / "dpkg-deb").write_text(
        '#!/bin/bash\nname=$(basename "$2"); name=${name%%_*}; t=$(mktemp -d); mkdir "$t/html"\n'
        'for i in $(seq 0 11); do printf "<p>%.0s$name page $i </p>" $(seq 100) '
        '> "$t/html/$i.html"; done\n'
        'mkdir -p "$t/html/translations/it" "$t/html/_modules" "$t/apache2-doc/manual/it"\n'
        "for p in translations/it/a _modules/m genindex-A search maxima_singlepage \\\n"
        "  ../apache2-doc/manual/it/a; do\n"
        '  printf "<p>%.0snot a page </p>" $(seq 100) > "$t/html/$p.html"; done\n'
        'echo "<p>The node you are looking for is at XREFfft.</p>" > "$t/html/XREFfft.html"\n'
        'tar -cf - -C "$t" .; rm -r "$t"\n'
    )
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_}:{os.environ['PATH']}"}


def test_debian_docs_says_when_a_pin_is_gone_and_records_unpinned_inputs(tmp_path):
    docs = load_command("data/debian_docs.py")
    gone = fake_debian(
        tmp_path / "a", "echo \"E: Version '${2#*=}' for '${2%%=*}' was not found\" >&2; exit 100\n"
    )
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'out'}"], **gone)
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and r.stderr.startswith(
            "error: apt-get "
            "download python3.11-doc=3.11.2-6+deb12u8 failed (E: Version '3.11.2-6+deb12u8' for "
            "'python3.11-doc' was not found): the pinned version is not offered here"
        )
    ), r.stderr
    assert "--debs=DIR" in r.stderr and "--unpinned" in r.stderr and not (tmp_path / "out").exists()
    # today's versions instead: each .deb holds its name; the build says it is not the pinned one
    today = fake_debian(tmp_path / "b", 'printf "%s" "$2" > "$2_9.9_all.deb"\n')
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'out'}", "--unpinned"], **today)
    assert r.returncode == 0 and r.stdout.count("NOT the pinned corpus") == 2, r.stderr
    manifest = json.loads((tmp_path / "out" / "docs.manifest.json").read_text())
    names = [spec.split("=")[0] for spec in docs.PACKAGES]
    assert manifest["inputs"] == {n: hashlib.sha256(n.encode()).hexdigest() for n in names}
    # 12 pages a package, shuffled: all but every TRAIN_EVERY-th held out as an excerpt of its page;
    # neither split in package order, and the first half of the validation split samples every one
    split = {}
    for kind in ("val", "train"):
        tokens = shards.read_shard(str(next((tmp_path / "out").glob(f"docs_{kind}_*.bin"))), 256)
        split[kind] = bytes(tokens.astype(np.uint8)).decode().split("\0")[1:]
    pages = {"\n".join([f"{n} page {i}"] * 100) for n in names for i in range(12)}
    train = -(-len(pages) // docs.TRAIN_EVERY)  # pages 0, TRAIN_EVERY, ...
    assert (len(split["val"]), len(split["train"])) == (len(pages) - train, train)
    assert set(split["train"]) < pages
    assert all(len(t) == docs.EXCERPT and any(t in p for p in pages) for t in split["val"])
    for kind, texts in split.items():  # (the shuffle is seeded: this holds or fails every time)
        order = [next(i for i, n in enumerate(names) if n in t) for t in texts]
        assert order != sorted(order), kind  # not package by package
    assert all(any(n in t for t in split["val"][: len(split["val"]) // 2]) for n in names)
    # the same inputs give the same corpus (a seeded shuffle), into a folder of its own
    shas = dict(manifest["shards"])
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'again'}", "--unpinned"], **today)
    assert (
        r.returncode == 0
        and json.loads((tmp_path / "again" / "docs.manifest.json").read_text())["shards"] == shas
    )
    # a folder holding the pinned corpus is not replaced by an unpinned one
    (tmp_path / "again" / "docs.manifest.json").write_text(
        json.dumps({"written_by": "data/tokenize_corpus.py", "shards": docs.SHA256})
    )
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'again'}", "--unpinned"], **today)
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: {tmp_path / 'again'} holds the pinned corpus, which --unpinned would replace"
    )
    # a shard that is not ours in --out: refused before any download (apt-get would leave a mark)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "docs_train_000001.bin").write_bytes(b"my own")
    marks = fake_debian(tmp_path / "c", f"touch {tmp_path}/downloaded; exit 100\n")
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'mine'}"], **marks)
    assert r.returncode == 2 and "named like a shard of corpus 'docs'" in r.stderr, r.stderr
    assert not (tmp_path / "downloaded").exists() and os.listdir(tmp_path / "mine") == [
        "docs_train_000001.bin"
    ]
    # SIGTERM while a package streams its pages: status 143, and the folder it made is gone
    (tmp_path / "b" / "bin" / "dpkg-deb").write_text("#!/bin/bash\nkill -TERM $PPID; sleep 1\n")
    r = run_data_script(
        "debian_docs.py", [f"--out={tmp_path / 'sig' / 'out'}", "--unpinned"], **today
    )
    assert r.returncode == 143 and r.stderr == "" and not (tmp_path / "sig").exists(), r.stderr
    # a damaged .deb, as dpkg-deb streams it or refuses it: one line naming the package (not a
    # temporary path, deleted by then), dpkg-deb's own reason first, nothing left
    for script, reason in (
        ('printf ""', "empty file"),
        ('printf "cut"', "truncated"),
        (
            "echo \"dpkg-deb: error: '$2' is not a Debian archive\" >&2; echo more >&2; exit 2",
            "not a D",
        ),
    ):
        (tmp_path / "b" / "bin" / "dpkg-deb").write_text(f"#!/bin/bash\n{script}\n")
        r = run_data_script(
            "debian_docs.py", [f"--out={tmp_path / 'bad' / 'out'}", "--unpinned"], **today
        )
        assert (
            r.returncode == 2
            and r.stderr.startswith("error: the .deb apt-get downloaded for ")
            and ": not a readable .deb (" in r.stderr
            and reason in r.stderr
            and ".debian_docs." not in r.stderr  # (the temporary folder, deleted by then)
            and r.stderr.count("\n") == 1
            and not (tmp_path / "bad").exists()
        ), r.stderr


def test_tokenize_names_a_bad_document_and_writes_nothing(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    (tmp_path / "d.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "e.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "f.jsonl").write_text('{"text": "fine"}\n' + "[" * 100000 + "\n")  # too deep
    (tmp_path / "g.jsonl").write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")  # 5,000 digits
    (tmp_path / "h.jsonl").write_text('\ufeff{"text": "a"}\n\ufeff{"text": "b"}\n')  # 2 BOMs
    out = tmp_path / "shards" / "b" / ".." / "deeper"  # makedirs makes shards/b too
    for name, message in (
        ("c.jsonl", 'c.jsonl:2: not a JSON object with a "text" field'),
        ("d.txt", "d.txt: not valid UTF-8"),
        ("e.jsonl", "e.jsonl:2: not valid UTF-8"),
        ("f.jsonl", 'f.jsonl:2: not a JSON object with a "text" field (RecursionError)'),
        ("g.jsonl", 'g.jsonl:1: not a JSON object with a "text" field (ValueError)'),
        ("h.jsonl", "h.jsonl:2: starts with a byte-order mark (U+FEFF)"),  # (line 1's is fine)
    ):
        r = run_data_script(
            "tokenize_corpus.py", [str(tmp_path / name), f"--out={out}", "--shard_tokens=1"]
        )
        assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr
        assert r.stderr.count("\n") == 1
        assert not (tmp_path / "shards").exists()  # not even the folders it made for --out


def test_retokenizing_replaces_only_its_own_corpus_and_only_when_complete(tmp_path):
    big = "many words make many tokens " * 40
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "small.txt").write_text("few words")
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n')
    out = tmp_path / "shards"
    out.mkdir()
    others = {
        "other_train_000001.bin": b"another corpus, kept",  # a name sharing the prefix:
        "corpus_big_train_000001.bin": b"corpus_big is not corpus",
    }
    for name, data in others.items():
        (out / name).write_bytes(data)

    def tokenize(src):
        return run_data_script(
            "tokenize_corpus.py",
            [str(tmp_path / src), f"--out={out}", "--shard_tokens=50", "--workers=1"],
        )

    n_big = -(-(1 + len(gpt2().encode_ordinary(big))) // 50)
    assert n_big > 2
    for src, n_shards in (("big.txt", n_big), ("small.txt", 1)):
        r = tokenize(src)
        assert r.returncode == 0, r.stderr
        assert (
            len([p for p in out.iterdir() if re.fullmatch(r"corpus_(val|train)_\d+\.bin", p.name)])
            == n_shards
        )
    assert f"removed {n_big - 1} shard(s) of the previous corpus 'corpus'" in r.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = tokenize("blank.jsonl")  # no documents: an error, and the corpus stays as it was
    assert r.returncode == 2 and r.stderr == (
        "error: the input holds no documents (no non-empty text); nothing was written\n"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert all((out / n).read_bytes() == data for n, data in others.items())
    assert list(tg.read_shard(str(out / "corpus_val_000000.bin"))) == [
        50256
    ] + gpt2().encode_ordinary("few words")


def test_a_corpus_named_like_shards_it_did_not_write_is_refused(tmp_path):
    # a downloaded FineWeb, or shards an older version wrote: never replaced or removed
    (tmp_path / "a.txt").write_text("some words " * 30)
    out = tmp_path / "fineweb10B"
    out.mkdir()
    download = {
        f"fineweb_{s}_{i:06d}.bin": f"download {i}".encode()
        for i, s in enumerate(["val", "train", "train"])
    }
    for name, data in download.items():
        (out / name).write_bytes(data)
    r = run_data_script(
        "tokenize_corpus.py",
        [
            str(tmp_path / "a.txt"),
            f"--out={out}",
            "--name=fineweb",
            "--shard_tokens=20",
            "--workers=1",
        ],
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (
        "fineweb_train_000001.bin (and 2 more) is named like a shard of corpus 'fineweb' but "
        "was not written by this script" in r.stderr
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == download
    # its own corpus, edited since it was written, is not its own any more
    r = run_data_script(
        "tokenize_corpus.py",
        [
            str(tmp_path / "a.txt"),
            f"--out={out}",
            "--name=mine",
            "--shard_tokens=20",
            "--workers=1",
        ],
    )
    assert r.returncode == 0, r.stderr
    (out / "mine_train_000002.bin").write_bytes(b"edited")
    r = run_data_script(
        "tokenize_corpus.py",
        [str(tmp_path / "a.txt"), f"--out={out}", "--name=mine", "--workers=1"],
    )
    assert r.returncode == 2 and "mine_train_000002.bin (and 0 more)" in r.stderr
    assert (out / "mine_train_000002.bin").read_bytes() == b"edited"
    assert not list(out.glob(".mine.*"))  # no temporary folder left
    os.mkfifo(out / "fifo_val_000000.bin")  # never read (that would wait for a writer)
    (out / "link_val_000000.bin").symlink_to(out / "mine_val_000000.bin")
    for name in ("fifo", "link"):
        r = subprocess.run(
            [
                sys.executable,
                "data/tokenize_corpus.py",
                str(tmp_path / "a.txt"),
                f"--out={out}",
                f"--name={name}",
                "--workers=1",
            ],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and f"{name}_val_000000.bin (and 0 more) is named like" in r.stderr


def test_a_shard_that_appears_while_tokenizing_is_not_replaced(tmp_path, monkeypatch):
    tokenize = load_command("data/tokenize_corpus.py")
    out, real = tmp_path / "s", tokenize.documents

    def documents(paths, raw=False):  # another job writes a shard of the same name meanwhile
        for i, doc in enumerate(real(paths, raw)):
            if i == 1:
                (out / "c_train_000001.bin").write_bytes(b"theirs")
            yield doc

    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(3))
    )
    monkeypatch.setattr(tokenize, "documents", documents)
    with pytest.raises(support.UserError, match="changed while this ran"):
        tokenize.tokenize([str(tmp_path / "a.jsonl")], str(out), "c", 20, 1)
    assert [p.name for p in out.iterdir()] == ["c_train_000001.bin"]
    assert (out / "c_train_000001.bin").read_bytes() == b"theirs"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_tokenizer_takes_back_what_it_wrote(tmp_path, signum):
    # what a scheduler sends (scancel: SIGTERM; Slurm's --signal: SIGUSR1) mid-way through
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": " word" * 20_000}) + "\n") * 300)
    out = tmp_path / "out" / "deeper"
    proc = subprocess.Popen(
        [
            sys.executable,
            "data/tokenize_corpus.py",
            str(tmp_path / "big.jsonl"),
            f"--out={out}",
            "--workers=1",
            "--shard_tokens=10000",
        ],
        cwd=HERE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.time() + 120
    while not list(out.glob(".corpus.*/*.bin")) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # no shard, no temporary folder, no folder it made


def test_a_manifest_it_did_not_write_is_refused_like_a_shard(tmp_path):
    (tmp_path / "a.txt").write_text("some words " * 30)
    (tmp_path / "theirs.json").write_text('{"shards": {}}')
    out = tmp_path / "s"
    out.mkdir()
    for make in (
        lambda m: m.write_text('{"shards": {}}'),  # another tool's
        lambda m: m.write_text("not json"),
        lambda m: m.mkdir(),
        lambda m: m.symlink_to(tmp_path / "theirs.json"),
    ):
        manifest = out / "corpus.manifest.json"
        make(manifest)
        r = run_data_script(
            "tokenize_corpus.py", [str(tmp_path / "a.txt"), f"--out={out}", "--workers=1"]
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{manifest} is the manifest of corpus 'corpus' but was not written" in r.stderr
        assert [p.name for p in out.iterdir()] == ["corpus.manifest.json"]
        manifest.rmdir() if manifest.is_dir() and not manifest.is_symlink() else manifest.unlink()
    assert (tmp_path / "theirs.json").read_text() == '{"shards": {}}'


def test_a_corpus_cut_short_at_either_manifest_write_stays_its_own(tmp_path, monkeypatch):
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words")
    out, real = tmp_path / "s", tokenize.write_atomically

    def corpus():
        return {p.name: p.read_bytes() for p in out.iterdir()}

    for fail_at in (1, 2):  # the manifest written before the shards move, the one after
        tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)
        before, calls = corpus(), []

        def disk_full(path, data, calls=calls, fail_at=fail_at):
            calls.append(path)
            if len(calls) == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device", path)
            real(path, data)

        monkeypatch.setattr(tokenize, "write_atomically", disk_full)
        with pytest.raises(OSError):
            tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
        monkeypatch.undo()
        if fail_at == 1:
            assert corpus() == before  # nothing moved yet
        else:  # the new corpus is in place, the previous one's extra shards are gone
            assert sorted(n for n in corpus() if n.endswith(".bin")) == ["c_val_000000.bin"]
        # either way every file is still known as this corpus's: the next run goes on
        assert len(tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)) == 1
        assert not list(out.glob(".c.*"))
        shutil.rmtree(out)


def test_sample_regenerates_byte_for_byte(tmp_path):
    made_with = "3.11.7"  # data/sample/README.md: pydoc_data.topics changes between versions
    if sys.version.split()[0] != made_with:
        pytest.skip(f"the sample was made with Python {made_with}")
    r = run_data_script("tokenize_corpus.py", [f"--out={tmp_path}"])
    assert r.returncode == 0, r.stderr
    for name in ("sample_train_000001.bin", "sample_val_000000.bin", "sample.manifest.json"):
        assert (tmp_path / name).read_bytes() == (
            Path(HERE) / "data" / "sample" / name
        ).read_bytes()


def test_check_command_counts_and_rejects(tmp_path):
    r = run_data_script("tokenize_corpus.py", ["--check=data/sample"])
    total = sum(len(tg.read_shard(p)) for p in tg.find_shards("data/sample/*.bin"))
    assert r.returncode == 0 and f"2 shards, {total:,} tokens, all valid" in r.stdout
    write_shard(tmp_path / "x_000000.bin", range(10))
    write_shard(tmp_path / "x_000001.bin", [5, 60000])
    r = run_data_script("tokenize_corpus.py", [f"--check={tmp_path}"])
    assert (
        r.returncode == 2 and "x_000001.bin: token id 60000 is outside the vocabulary" in r.stderr
    )


# runs a script as `python SCRIPT ARGS...` would, then fails if torch was imported on the way
NO_TORCH = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    status = e.code
assert "torch" not in sys.modules, "torch was imported"
sys.exit(status)
"""


def test_data_scripts_run_without_importing_torch(tmp_path):
    fake_hub_cache(tmp_path / "hub", {"fineweb_val_000000.bin": range(100)})
    (tmp_path / "a.txt").write_text("a few words")
    env = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    for args, status in (
        (["data/tokenize_corpus.py", "--check=data/sample"], 0),
        (
            [
                "data/tokenize_corpus.py",
                str(tmp_path / "a.txt"),
                f"--out={tmp_path / 's'}",
                "--workers=1",
            ],
            0,
        ),
        (["data/tokenize_corpus.py", "--workers=0"], 2),
        (["data/tokenize_corpus.py", "--help"], 0),
        (["data/cached_fineweb10B.py", "0", f"--out={tmp_path / 'f'}"], 0),
        (["data/cached_fineweb10B.py", "--bogus"], 2),
    ):
        r = subprocess.run(
            [sys.executable, "-c", NO_TORCH, *args],
            cwd=HERE,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == status and "torch was imported" not in r.stderr, (args, r.stderr)
    assert list(tg.read_shard(str(tmp_path / "f" / "fineweb_val_000000.bin"))) == list(range(100))
    assert list(tg.read_shard(str(tmp_path / "s" / "corpus_val_000000.bin"))) == [
        50256
    ] + gpt2().encode_ordinary("a few words")


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


# ---------------------------------------------------------------------------- long runs

RESUME_RUN = TINY_RUN + [
    "--dim=32",
    "--max_seq_len=32",
    "--seq_len=32",
    "--batch_size=8",
    "--device_batch_size=4",
    "--train_tokens=2048",
    "--val_every=4",
    "--val_tokens=256",
    "--save_every=0",
    "--gamma=0.05",
    "--mu_start=0.5",
    "--untimed_steps=1",
]  # 8 steps, an active controller


def timing(m):
    return {k: v for k, v in m.items() if k not in ("step_ms", "compile_ms", "train_time_ms")}


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
        r = run_script([f"--resume={part}", "--untimed_steps=1"])
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
    r = run_script([f"--resume={tmp_path / 'seq'}", "--seq_len=16", "--stop_step=7"])
    assert r.returncode == 0, r.stderr
    assert torch.load(tmp_path / "seq" / "checkpoint.pt", weights_only=True)["step"] == 7


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
    r = run_script([f"--resume={part}", "--untimed_steps=1"])
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
    ca = torch.load(full / "checkpoint.pt", weights_only=True)
    cb = torch.load(part / "checkpoint.pt", weights_only=True)
    assert ca["step"] == cb["step"] == 8
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    assert torch.equal(ca["routing"]["controller"]["alpha"], cb["routing"]["controller"]["alpha"])
    model = tg.GPT(tg.Hyperparameters(**cb["hp"]))
    model.load_state_dict(cb["model"])  # strict: an unwrapped model, loadable on CPU
    assert (part / "train.log").read_text().count("resumed at step 4") == 1


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


def test_each_job_appends_the_sources_it_ran(tmp_path, monkeypatch, capsys):
    # the sources a run records, read from a copy outside any git checkout that changes
    # between the two jobs
    src, run = tmp_path / "src", tmp_path / "run"
    for name in runs.SOURCES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(HERE, name), src / name)
    monkeypatch.setattr(runs, "HERE", str(src))
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


def test_older_checkpoints_and_a_save_killed_half_way(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=1"], capsys)
    assert code == 0, err
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    # what an older version saved: the expand_* fields, data paths relative to the repository
    ckpt["hp"].update(expand_from="", expand_groups=1, train_files="data/sample/sample_train_*.bin")
    torch.save(ckpt, run / "checkpoint.pt")
    (run / "checkpoint.pt.k1ll3d_x.tmp").write_bytes(b"half a save")  # what SIGKILL leaves
    (run / "checkpoint.pt.backup.tmp").write_bytes(b"a user's file")  # not a name we write
    assert tg.load_model(str(run)).hp.n_layers == ckpt["hp"]["n_layers"]
    # resumed from another folder: the relative data path is the repository's
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([f"--resume={run}", "--stop_step=2"], capsys)
    assert code == 0, err
    assert [p.name for p in run.glob("checkpoint.pt.*.tmp")] == ["checkpoint.pt.backup.tmp"]
    mask = os.umask(0)
    os.umask(mask)
    for name in ("checkpoint.pt", "config.json", "metrics.jsonl"):  # as open() would make them
        assert (run / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


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


def test_ctrl_c_while_a_command_loads_torch_is_quiet(tmp_path):
    # The signal lands at several points of torch's import, found in /proc/PID/maps so that a
    # faster machine does not move them: as its libraries map, and once numpy's C extension is
    # in (CI once caught one inside numpy's, which left a half-loaded module behind)
    commands = (
        ["expand.py", str(tmp_path / "a"), str(tmp_path / "b")],
        ["sample.py", str(tmp_path)],
    )
    for command, library in itertools.product(commands, ("libtorch", "_multiarray_umath")):
        proc = subprocess.Popen(
            [sys.executable, *command], cwd=HERE, stderr=subprocess.PIPE, text=True
        )
        when_mapped(proc, library)
        assert proc.poll() is None, "the command ended before the signal: no torch import?"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err, (command, library, err)


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


def process_state(pid):
    """A process's state letter from /proc (Z: ended, not yet reaped), or None if it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_workers_whose_torchrun_died_of_a_signal_save_and_stop(tmp_path):
    # SIGUSR1 ends torchrun at once without passing it on: each worker finds its launcher gone at
    # the next step, and the job stops there with a checkpoint, as on any signal (no orphans)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train_gpt.py",
            *RESUME_RUN,
            "--train_tokens=10000000",
            f"--run_dir={tmp_path}",
        ],
        cwd=HERE,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log, deadline = tmp_path / "train.log", time.time() + 120
    while time.time() < deadline and "step:3/" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    workers = [
        int(p.parent.name)
        for p in Path("/proc").glob("[0-9]*/stat")
        if process_state(p.parent.name)
        and int(p.read_text().rsplit(")", 1)[1].split()[1]) == proc.pid
    ]
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
    launcher = subprocess.Popen(
        [sys.executable, "-c", FAKE_LAUNCHER, world, port, str(log), *args],
        cwd=HERE,
        stdout=subprocess.PIPE,
        text=True,
    )
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
    args += ["--val_files=data/sample/sample_train_*.bin", f"--val_tokens={64 * 2000}"]
    launcher, worker = fake_launch("1", log, args)
    time.sleep(8)  # (torch loaded, the model built, validating)
    assert process_state(worker) not in (None, "Z"), log.read_text()[-2000:]
    assert not kill_and_outlived(launcher, worker, 10), "the worker validates on without it"
    said = log.read_text()
    assert said.endswith("error: the launcher is gone: this worker stops; nothing was written\n")
    assert "val_loss" not in said and said.count("error:") == 1, said[-2000:]


def processes_naming(text: str) -> list:
    """The pids of the live processes whose command line holds text (from /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if text in cmdline.read_text() and process_state(cmdline.parent.name) not in (
                None,
                "Z",
            ):
                pids.append(int(cmdline.parent.name))
    return pids


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
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["--no-python", "bash", "-c", command],
        cwd=HERE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60

    def workers():
        return [pid for pid in processes_naming(f"--run_dir={run}") if pid != launcher.pid]

    while time.time() < deadline and len(workers()) < 2:
        time.sleep(0.05)
    assert len(workers()) == 2, launcher.poll()
    os.kill(launcher.pid, signum)
    try:  # (its workers hold its output till they end)
        said = launcher.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        said = ""
    left = workers()
    for pid in left:  # (a failing test leaves none behind)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlive their launcher"
    gone = "error: the launcher is gone: this worker stops; nothing was written"
    assert said.splitlines().count(gone) == 2 and "c10" not in said, said[-3000:]
    assert not run.exists()


def start_run(args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "train_gpt.py", *args],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc, prefix, timeout=120):
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
        assert time.time() < deadline, f"no line starting {prefix!r}"
    raise AssertionError(f"process ended before {prefix!r}: {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_sigkill_mid_run_resumes_from_the_last_checkpoint(tmp_path, capsys):
    args = RESUME_RUN + ["--train_tokens=10240", "--save_every=3", f"--run_dir={tmp_path}"]
    proc = start_run(args)  # 40 steps
    wait_for_line(proc, "step:7/40 train_loss")
    proc.kill()
    proc.wait()
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    assert step >= 6 and step % 3 == 0
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert code == 0, err
    train = [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert train == list(range(1, 41))  # every step once: lines past the checkpoint were dropped
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 40


@pytest.mark.slow
def test_kill_while_saving_leaves_a_loadable_checkpoint(tmp_path, capsys):
    # a model big enough (~20M parameters, ~230 MB with Adam) that a save takes a while
    args = [
        "--preset=smoke",
        "--n_layers=2",
        "--dim=192",
        "--n_heads=4",
        "--n_kv_heads=4",
        "--seq_len=16",
        "--batch_size=2",
        "--device_batch_size=2",
        "--train_tokens=160",
        "--val_tokens=32",
        "--val_every=0",
        "--save_every=1",
        f"--run_dir={tmp_path}",
    ]
    proc = start_run(args)
    ckpt = tmp_path / "checkpoint.pt"
    deadline = time.time() + 300
    while not (ckpt.exists() and glob.glob(f"{ckpt}.*.tmp")):  # a second save is being written
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    state = torch.load(ckpt, weights_only=True)  # the previous checkpoint, whole
    assert state["step"] >= 1
    code, _, err = run_main([f"--resume={tmp_path}", "--train_tokens=64"], capsys)  # 2 steps in all
    assert code == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])  # SIGUSR1: Slurm's warning
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
    proc = start_run(RESUME_RUN + ["--train_tokens=1024000", f"--run_dir={tmp_path}"])
    wait_for_line(proc, "step:2/4000 train_loss")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    assert f"stopped by signal {signal.Signals(signum).name} at step {step}" in out
    assert f"resume with: python train_gpt.py --resume={tmp_path}" in out


def nan_on_call(n):
    """The model's loss, NaN on its n-th call with gradients enabled (training)."""
    calls, real = [0], tg.LinearCrossEntropy.apply

    def fake(*args, **kwargs):
        loss = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == n:
                return loss * float("nan")
        return loss

    return fake


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
        assert (
            "checkpoint.pt is a broken symbolic link"
            if "--resume" in args[0]
            else "already holds a run that saved a checkpoint"
        ) in err, err
    (tmp_path / "checkpoint.pt").unlink()
    assert files() == before  # a refusal writes nothing
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)  # afresh: logs kept
    assert code == 0 and "its files are in" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "aborted_1").iterdir()} == before


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
    ):
        edited = copy.deepcopy(good)
        edit(edited)
        torch.save(edited, tmp_path / "checkpoint.pt")
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        code, _, err = run_main([f"--resume={tmp_path}"], capsys)
        assert code == 2 and message in err and "edited or damaged" in err, err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def after_exit(*signums):
    """python -c code that runs train_gpt.py as a script and sends itself signums at exit."""
    return (
        f"import atexit, os, runpy, sys; sys.argv[0] = 'train_gpt.py'; "
        f"atexit.register(lambda: [os.kill(os.getpid(), s) for s in {list(map(int, signums))}]); "
        f"runpy.run_path('train_gpt.py', run_name='__main__')"
    )


def test_a_signal_after_the_final_save_leaves_status_0(tmp_path):
    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # each one, one after another
    r = subprocess.run(
        [sys.executable, "-c", after_exit(*signums), *RESUME_RUN, f"--run_dir={tmp_path}"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 8


def test_a_bounded_number_of_bad_steps_can_be_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tg.LinearCrossEntropy, "apply", nan_on_call(9))
    code, out, err = run_main(RESUME_RUN + ["--max_bad_steps=1", f"--run_dir={tmp_path}"], capsys)
    assert code == 0, err
    assert "step:5/8 skipped: non-finite loss (1 of max_bad_steps=1)" in out
    train = [m for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 6, 7, 8]
    assert all(math.isfinite(m["train_loss"]) for m in train)


def bad_inputs(tmp_path):
    """(arguments, expected message) for each kind of bad input; files made here."""
    write_shard(tmp_path / "magic_000001.bin", range(5000), magic=7)
    write_shard(tmp_path / "trunc_000001.bin", range(5000), count=9000)
    write_shard(tmp_path / "oov_000001.bin", [60000] * 5000)
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
        (smoke + ["--val_tokens=1e6"], "more than the validation shards hold"),
        (smoke + ["--lr=inf"], "lr=inf must lie in (0, inf)"),
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
        (smoke + ["--device_batch_size=3"], "not divisible"),
        (smoke + ["--seq_len=256"], "seq_len=256 is beyond the RoPE table (max_seq_len=128)"),
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
        (smoke + ["--val_tokens=100"], "val_tokens=100 is fewer than one validation batch"),
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
        for value in (
            never if isinstance(default, (int, float)) and not isinstance(default, bool) else []
        ):
            with pytest.raises(tg.UserError):  # refused for every number, whatever its range
                tg.validate(
                    tg.resolve(tg.parse_overrides(["--preset=smoke", f"--{f.name}={value}"])), 1
                )
        refused = 0
        for value in candidates:
            try:
                hp = tg.resolve(tg.parse_overrides(["--preset=smoke", f"--{f.name}={value}"]))
                tg.validate(hp, 1)
                tg.find_shards(hp.train_files), tg.find_shards(hp.val_files)
            except tg.UserError:
                refused += 1  # any other exception fails the test: a traceback for the user
        assert refused == len(candidates), f"--{f.name}: an out-of-range value is accepted"
        # and its value (the smoke preset's) and some other valid value are accepted, whole
        # (validate); the valid values of resume and init_from are models: their own tests
        value = smoke[f.name]
        others = [v for v in valid_candidates(f.name, value, tmp_path) if v != value]
        assert f.name in ("resume", "init_from") or (
            accepts(f.name, value) and any(accepts(f.name, v) for v in others)
        ), f.name


def accepts(name, value) -> bool:
    """Whether --name=value on the smoke preset, with the router or controller that reads
    the field, passes every check before a run starts."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    owner = [f"--router={r}" for r in tg.ROUTERS if name in routers_fields(r)]
    # the smoke's 4: too few for N_r = 3
    owner += ["--n_layers=8"] if owner == ["--router=mor"] else []
    owner += [f"--controller={c}" for c, knobs in tg.CONTROLLERS.items() if name in knobs.split()][
        :1
    ]
    try:
        given = [f"--{name}={text}"] if text else []  # an empty default: the flag left out
        # its vocabulary
        given += ["--vocab_size=256"] if (name, text) == ("encoding", "bytes") else []
        tg.validate(tg.resolve(tg.parse_overrides(["--preset=smoke", *owner, *given])), 1)
        return True
    except tg.UserError:
        return False


def routers_fields(router) -> list:
    """The fields of Hyperparameters marked router=NAME: read by that router alone."""
    return [f.name for f in tg.fields(tg.Hyperparameters) if f.metadata["router"] == router]


def field_of(name):
    return {f.name: f for f in tg.fields(tg.Hyperparameters) + tg.fields(tg.Job)}[name]


def choices(name) -> list:
    spec = field_of(name).metadata["spec"]
    return list(spec) if isinstance(spec, tuple) else []


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


def load_command(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem, os.path.join(HERE, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "\xff"}\n')
    cases = [
        (
            sample.main,
            [str(run), "--prompt=" + "word " * 40],
            "context holds 32, so no token could follow",
        ),
        (sample.main, [str(run), "--nope=1"], "unrecognized arguments: --nope=1"),
        (sample.main, [str(tmp_path / "none")], "none: no such folder"),
        (sample.main, [str(edited)], "encoding=bytes has 256 token ids: give vocab_size=256"),
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
        (tokenize.main, [str(text), f"--out={a_file}"], f"cannot write to {a_file}"),
        (tokenize.main, [str(tmp_path / "none.txt"), f"--out={tmp_path}/s"], "no such file"),
        (tokenize.main, [str(tmp_path / "bad.jsonl"), f"--out={tmp_path}/s"], "not valid UTF-8"),
        (tokenize.main, [str(text)], "give --out=DIR"),
        (tokenize.main, [f"--check={tmp_path}/none"], "none: no such folder"),
        (tokenize.main, [f"--check={tmp_path}/run"], "no .bin shards"),
        (tokenize.main, ["--bogus=1"], "unrecognized arguments: --bogus=1"),
        (fetch.main, [f"--out={a_file}"], f"cannot write to {a_file}"),
        (fetch.main, ["--bogus"], "unrecognized arguments: --bogus"),
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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    for cmd, unbuffered in (
        (["sample.py", str(run), "--tokens=3"], "1"),
        (["train_gpt.py", *RESUME_RUN, f"--run_dir={tmp_path / 'r2'}"], ""),
    ):
        with open("/dev/full", "w") as full:
            r = subprocess.run(
                [sys.executable, *cmd],
                cwd=HERE,
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=300,
                env={**env, "PYTHONUNBUFFERED": unbuffered},
            )
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert r.stderr.startswith("error: No space left on device"), (cmd, r.stderr)
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


def disk_nearly_full(limit=256 << 10):
    """For a subprocess: files may not grow past limit bytes (RLIMIT_FSIZE, EFBIG), the way a
    disk with little space left refuses a write (ENOSPC); both are DISK_FULL."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the write kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


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
        r = subprocess.run(
            [sys.executable, *cmd],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=disk_nearly_full,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert r.returncode == 1 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert r.stderr.startswith(f"error: {out}") and "File too large" in r.stderr, (
            cmd,
            r.stderr,
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "t.txt"], cmd  # nothing left


@pytest.mark.slow
def test_an_output_name_taken_by_what_bench_did_not_write_is_refused_before_the_work(tmp_path):
    (tmp_path / "b" / "bench.md").mkdir(parents=True)
    (tmp_path / "b" / "bench.json").write_text("{}")  # a user's, though .outputs.json says ours
    (tmp_path / "b" / ".outputs.json").write_text('{"bench.json": "%s"}' % sha256(b"{ }"))
    for taken, kind in (("bench.md", "a folder"), ("bench.json", "a file")):
        r = subprocess.run(
            [sys.executable, "bench.py", f"--out={tmp_path / 'b'}"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=120,
        )
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
    r = subprocess.run(
        [sys.executable, "bench.py", f"--out={tmp_path / 'c'}"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and "is not a record this project wrote: move it" in r.stderr
        and (tmp_path / "c" / ".outputs.json").read_text() == "my notes"
    ), r.stderr
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".outputs.json"]


def test_a_disk_that_fills_mid_write_names_the_file_and_keeps_what_was_there(tmp_path):
    big = tmp_path / "big.txt"  # 1.2M tokens: shards of 1M tokens are 2 MB, over the limit
    big.write_text(" word" * 1_200_000)
    r = run_data_script(
        "tokenize_corpus.py",
        [str(big), f"--out={tmp_path / 's'}", "--workers=1", "--shard_tokens=1000000"],
    )
    assert r.returncode == 0, r.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    r = subprocess.run(
        [
            sys.executable,
            "data/tokenize_corpus.py",
            str(big),
            f"--out={tmp_path / 's'}",
            "--workers=1",
            "--shard_tokens=1000000",
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: disk_nearly_full(3 << 19),
    )
    assert r.returncode == 1, r.stderr
    assert (
        r.stderr.splitlines()[-1]
        == f"error: {tmp_path / 's' / 'corpus_val_000000.bin'}: File too large"
    )
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before


COMMANDS = (
    "sample.py",
    "bench.py",
    "sweep.py",
    "skipview.py",
    "expand.py",
    "export.py",
    "data/tokenize_corpus.py",
    "data/cached_fineweb10B.py",
    "data/debian_docs.py",
)


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
            env = {**os.environ, "PYTHONPATH": str(tmp_path), "HOOK_SIGNAL": sig, "HOOK_AT": at}
            r = subprocess.run(
                [sys.executable, path, "--help"],
                cwd=HERE,
                env=env,
                timeout=120,
                capture_output=True,
                text=True,
            )
            assert r.returncode == status and r.stderr == "", (
                path,
                sig,
                at,
                r.returncode,
                r.stderr,
            )
            assert (r.stdout != "") == (at != "numpy"), (path, at, r.stdout)


# ---------------------------------------------------------------------------- runs that survive


def run_main(args, capsys):
    """train_gpt.py's job in this process, as its __main__ runs it -> (exit status, stdout,
    stderr)."""
    code = support.cli(tg.main, args)
    out = capsys.readouterr()
    return code, out.out, out.err


def val_steps(run_dir):
    return [m["step"] for m in read_metrics(run_dir) if m["kind"] == "val"]


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


def test_resume_with_fewer_steps_than_done_is_refused(tmp_path, capsys):
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=4"], capsys)
    assert code == 0, err
    before = (tmp_path / "metrics.jsonl").read_bytes()
    for more in (["--train_tokens=512"], ["--batch_size=32"]):  # 2 steps in all, 4 done
        code, out, err = run_main([f"--resume={tmp_path}", *more], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("error: the checkpoint is at step 4 but these settings make 2 steps")
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 4


def test_a_run_directory_is_held_by_one_job(tmp_path):
    (tmp_path / "lock").write_text("a user's own file")
    runs.lock_run_dir(str(tmp_path))
    try:
        with pytest.raises(tg.UserError, match="is in use by another job"):
            runs.lock_run_dir(str(tmp_path))  # a second open file: flock refuses it too
        assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]  # the lock writes no file
        assert (tmp_path / "lock").read_text() == "a user's own file"
    finally:
        runs.release_locks()
    runs.lock_run_dir(str(tmp_path))  # released: free again
    runs.release_locks()
    gone = tmp_path / "moved_away"  # a resumed run's folder moved between its read and its lock
    with pytest.raises(tg.UserError, match="No such file"):
        runs.open_run_dir(str(gone), "", {"mtime": 0, "run_id": "ab"})
    assert not gone.exists()  # not made again, empty


def test_a_second_job_on_a_busy_run_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, capsys):
    args = RESUME_RUN + ["--train_tokens=1024000", "--save_every=1", f"--run_dir={tmp_path}"]
    proc = start_run(args)
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


def test_a_bad_shard_met_mid_run_is_status_1_naming_the_last_checkpoint(tmp_path, capsys):
    sample = shards.read_shard(
        sorted(glob.glob(os.path.join(HERE, "data/sample/sample_train_*")))[0]
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


def test_a_log_write_that_fails_mid_run_is_status_1_naming_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    import errno

    real = runs.RunLog.record

    def record(self, obj):
        if obj.get("kind") == "train" and obj["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, obj)

    monkeypatch.setattr(runs.RunLog, "record", record)
    code, _, err = run_main(RESUME_RUN + ["--save_every=2", f"--run_dir={tmp_path}"], capsys)
    assert (code, err) == (
        1,
        f"error: No space left on device; last checkpoint: {tmp_path / 'checkpoint.pt'} (step 2)\n",
    )
    monkeypatch.undo()
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # it goes on from step 2
    assert code == 0, err
    assert [m["step"] for m in read_metrics(tmp_path) if m["kind"] == "train"] == list(range(1, 9))


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
    assert (code, err) == (2, f"error: {tmp_path / 'metrics.jsonl'} is a folder, not a file\n")
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "m").rename(tmp_path / "metrics.jsonl")
    assert files() == before  # nothing written

    def full(self, run_dir, *args, **kwargs):  # the disk fills as the logs are opened
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(run_dir, "train.log"))

    monkeypatch.setattr(runs.RunLog, "__init__", full)
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)
    assert (code, err) == (
        1,
        f"error: cannot write the run's logs ({tmp_path / 'train.log'}: "
        f"No space left on device); last checkpoint: "
        f"{tmp_path / 'checkpoint.pt'} (step 2)\n",
    )


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
        and f"{b / 'config.json'} is missing or unreadable, so nothing says that" in err
        and err.endswith("is this folder's run: put it back\n")
        and err.count("\n") == 1
    ), err
    assert (b / "metrics.jsonl").read_bytes() == metrics and not (b / "config.json").exists()
    state = torch.load(a / "checkpoint.pt", weights_only=True)
    for change, message in [
        (lambda s: s["hp"].update(dim=64), "weights do not fit"),
        (lambda s: s.pop("optimizer"), "checkpoint lacks optimizer"),
        (lambda s: s.update(step="4"), "saved step='4' is not of type int"),
        (lambda s: s["hp"].update(lr="x"), "saved lr='x' is not of type float"),
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


def test_resuming_with_another_layout_of_routed_blocks_is_refused(tmp_path, capsys):
    mod = RESUME_RUN + [
        "--router=mod",
        "--mod_every=1",
        "--gamma=1e-3",
        "--mu_start=1.0",
        "--stop_step=2",
        f"--run_dir={tmp_path}",
    ]
    code, _, err = run_main(mod, capsys)
    assert code == 0, err
    code, _, err = run_main([f"--resume={tmp_path}", "--mod_every=2"], capsys)
    assert code == 2 and "different model shape: mod_every 1 -> 2" in err, err


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


def test_a_signal_that_reached_another_rank_stops_this_one_with_its_name(
    tmp_path, monkeypatch, capsys
):
    real = runs.all_reduce

    def other_rank_signalled(t, op="sum"):  # what the MAX all-reduce gives when rank 1 got SIGTERM
        return t.fill_(signal.SIGTERM) if op == "max" and t.numel() == 1 else real(t, op)

    monkeypatch.setattr(runs, "all_reduce", other_rank_signalled)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)
    assert code == 0 and err == "", err
    assert "stopped by signal SIGTERM at step 0" in out


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
    code, _, err = run_main([f"--resume={tmp_path}"], capsys)  # nothing to resume from
    assert code == 2 and "no checkpoint (checkpoint.pt) in it" in err, err
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}"], capsys)  # afresh, same folder
    assert code == 0, err
    assert (
        "its files are in" in err and (tmp_path / "aborted_1" / "train.log").read_text() == old_log
    )
    assert val_steps(tmp_path) == [0, 4, 8]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 8


def test_a_first_signal_during_start_up_stops_cleanly(tmp_path, monkeypatch, capsys):
    real_setup, real_log = runs.setup_distributed, runs.open_log

    def signalled():  # Ctrl-C while the job checks its settings: it stops at once, silently
        os.kill(os.getpid(), signal.SIGINT)
        return real_setup()

    monkeypatch.setattr(runs, "setup_distributed", signalled)
    code, out, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path / 'a'}"], capsys)
    assert (code, out, err) == (130, "", "") and not (tmp_path / "a").exists()
    monkeypatch.setattr(runs, "setup_distributed", real_setup)

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


def test_sigint_while_the_trainer_starts_exits_quietly(tmp_path):
    proc = start_run(["--preset=smoke", f"--run_dir={tmp_path / 'r'}"])
    when_mapped(proc, "_multiarray_umath")  # torch is loading
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and err.count("\n") <= 1, err
    assert proc.returncode in (0, 130), err


# ---------------------------------------------------------------------------- compacted path


def mixed_gates(B, T, seed=0):
    """(B, T, 1) gates: about a third exactly 0, a third in (0, 1), a third exactly 1; row 1
    has every token before position 5 skipped, row 2 is all skipped, row 3 none."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(B, T, generator=gen)
    g = torch.where(u < 0.33, 0.0, torch.where(u < 0.66, torch.rand(B, T, generator=gen), 1.0))
    g[1, :5], g[1, 5] = 0.0, 0.7
    g[2] = 0.0
    g[3] = torch.rand(T, generator=gen) * 0.9 + 0.1
    return g[..., None]


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_close_rel(a, b, tol):
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-12)
    assert (a - b).abs().max().item() <= tol * scale


@pytest.mark.parametrize("length", ["read", "fit", "full"])
def test_compact_block_matches_the_dense_masked_block(length):
    # packed to the most active tokens of a sequence: read on the host, or given (the exact
    # fit, or the whole sequence); row 2 has no active token, row 3 (but for the fit) no
    # skipped one
    hp = tiny(dim=48, n_heads=4, n_kv_heads=2, max_seq_len=24, seq_len=24)
    torch.manual_seed(0)
    block = tg.Block(hp)
    x = torch.randn(4, 24, hp.dim)
    g = mixed_gates(4, 24)
    w = torch.randn(4, 24, hp.dim)
    if length == "fit":  # no row without a skipped token: the fit is shorter than the sequence
        g[3] = g[0]
    given = {"read": None, "fit": int((g > 0).sum(1).max()), "full": 24}[length]
    assert length != "fit" or given < 24
    results = []
    for compact in (False, True):
        block.zero_grad()
        xi, gi = x.clone().requires_grad_(), g.clone().requires_grad_()
        y = block(xi, gi, None, compact, length=given)
        (y * w).sum().backward()
        results.append((y.detach(), grads(block), xi.grad, gi.grad))
    (y0, p0, x0, g0), (y1, p1, x1, g1) = results
    assert_close_rel(y0, y1, 1e-4)
    assert p0.keys() == p1.keys()
    for name in p0:
        assert_close_rel(p0[name], p1[name], 1e-4)
    assert_close_rel(x0, x1, 1e-4)
    open_ = g > 0  # at g = 0 the dense path has d/dg = the unused block output; the clamp
    assert_close_rel(g0[open_], g1[open_], 1e-4)  # upstream zeroes it in the model
    assert torch.equal(y1[2], x[2])  # a row with every token skipped is untouched
    if given is not None and given < 24:  # one token fewer: the longest sequence loses its last
        y2 = block(x, g, None, True, length=given - 1)
        assert not torch.allclose(y2, y1, atol=1e-3)


def test_compact_model_matches_dense_logits_and_gradients():
    torch.manual_seed(0)
    hp = tiny(n_layers=6, dim=48, max_seq_len=32, seq_len=32)
    models = [tg.GPT(hp), tg.GPT(replace(hp, compact=True))]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:  # gates spread so that S > 1 (g = 0), 0 < S < 1 and S = 0 (g = 1) all occur
        for gate in m.router.gates:
            torch.manual_seed(1)
            torch.nn.init.normal_(gate.weight, std=0.15)
            torch.nn.init.constant_(gate.bias, 0.1)
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    out = []
    for m in models:
        logits, gates = logits_gates(m, idx)
        (F.cross_entropy(logits.flatten(0, 1), idx.flatten()) + gates.mean()).backward()
        out.append((logits.detach(), gates.detach(), grads(m)))
    (l0, g0, p0), (l1, g1, p1) = out
    zero, mid = (g0 == 0).float().mean().item(), ((g0 > 0) & (g0 < 1)).float().mean().item()
    assert 0.1 < zero < 0.9 and mid > 0.05 and (g0 == 1).any()
    assert torch.equal(g0 == 0, g1 == 0) and (g0 - g1).abs().max().item() < 1e-5
    assert (l0 - l1).abs().max().item() < 1e-4
    for name in p0:
        assert_close_rel(p0[name], p1[name], 1e-4)


def steered_model(hp):
    """A gated model whose token 5 skips every gated block (S > 1) and token 7 none (s = 0), by
    one direction u that its embeddings and every gate share; other tokens vary."""
    torch.manual_seed(0)
    model = tg.GPT(hp)
    u = torch.randn(hp.dim)
    u = u / u.norm()
    with torch.no_grad():
        model.embed.weight[5], model.embed.weight[7] = 3 * u, -3 * u
        for gate in model.router.gates:
            gate.weight.copy_(10 * u[None])
            gate.bias.zero_()
    return model


@pytest.mark.parametrize("given", [None, "fit", "full"])
def test_compact_model_packed_to_given_lengths_matches_masked(given):
    # the gated model at the paper's routing, with a row where every token skips and one where
    # none does: packed lengths read on the host, given as the exact fit, or the whole sequence
    hp = tiny(n_layers=6, dim=48, max_seq_len=32, seq_len=32)
    models = [steered_model(hp), tg.GPT(replace(hp, compact=True))]
    models[1].load_state_dict(models[0].state_dict())
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    idx[0] = 5  # every token skips the middle
    if given != "fit":
        idx[1] = 7  # none does: its blocks pack the whole sequence
    out = []
    for m in models:
        o = m(idx)
        if m is models[0]:
            lengths = tg.packed_counts(o.route).int().tolist()
            m2 = models[1]
            m2.router.lengths = {None: None, "fit": lengths, "full": [32] * 6}[given]
        reg, _ = m.router.loss(o.route, 0)
        (F.cross_entropy(o.logits.flatten(0, 1), idx.flatten()) + reg).backward()
        out.append((o.logits.detach(), o.route["block"], grads(m)))
    (l0, b0, p0), (l1, b1, p1) = out
    assert not b0[1:5, 0].any() and 0 < b0[1:5, 2:].float().mean() < 1
    assert b0[:, 1].all() if given != "fit" else 0 < max(lengths[1:5]) < 32
    assert torch.equal(b0, b1) and (l0 - l1).abs().max().item() < 1e-4
    for name in p0:
        assert_close_rel(p0[name], p1[name], 1e-4)
    if given == "fit":  # the lengths are what packs: a token fewer at one block changes logits
        m2.router.lengths = [*lengths[:2], lengths[2] - 1, *lengths[3:]]
        assert (m2(idx).logits - l0).abs().max().item() > 1e-3


def test_bench_target_lines_compare_each_target_and_give_the_mfu():
    bench = load_command("bench.py")
    rows = [
        dict(target=p, fb_speedup=s, fb_eff=e, fb_mfu_masked=0.3614)
        for p, s, e in ((0.0, 0.96, 0.96), (0.25, 1.1, 0.9), (0.5, 1.3, 0.79), (0.75, 2.0, 0.84))
    ]
    assert bench.target_lines("paper", rows) == [
        "paper at sparsity 0.0: 0.96 compact / masked (target 0.95): met",
        "paper at sparsity 0.5: 0.79 of the FLOP ideal (target 0.8): not met",
        "paper at sparsity 0.75: 0.84 of the FLOP ideal (target 0.8): met",
        "paper: MFU of the masked model at sparsity 0, fwd+bwd: 36.1%",
    ]


def test_packed_lengths_hold_the_most_of_the_last_steps_in_sixteenths():
    # per block the most of the steps seen, rounded up to a multiple of T / 16, at least one
    # such unit (a block no token ran still runs a padding token), at most T
    seen = [[0, 5, 31, 32, 4], [0, 9, 16, 3, 4]]  # T = 32: units of 2
    assert tg.packed_lengths(seen, 32) == [2, 10, 32, 32, 4]
    assert tg.packed_lengths([[17, 64, 65, 1024]], 1024) == [64, 64, 128, 1024]


def test_a_step_that_outgrows_its_packed_lengths_is_redone_at_full_length():
    # lengths too short for this batch: train_step sees the counts exceed them (in its one host
    # read), redoes the step at full length and applies the masked model's update; without the
    # redo the packed step would be another. The next lengths come from the step's counts
    hp = tiny(n_layers=4, dim=48, max_seq_len=32, seq_len=32, vocab_size=50257, batch_size=4)
    hp = replace(hp, device_batch_size=2)
    masked, model = steered_model(hp), tg.GPT(replace(hp, compact=True))
    model.load_state_dict(masked.state_dict())
    short = tg.GPT(replace(hp, compact=True))
    short.load_state_dict(masked.state_dict())
    short.router.lengths = [2] * 4
    shards = f"{HERE}/data/sample/sample_train_*.bin"
    x = torch.tensor(tg.read_shard(tg.find_shards(shards)[0], hp.vocab_size)[:64].astype("int64"))
    x = x.view(2, 32)
    assert (tg.packed_counts(masked(x).route) > 2).any()
    assert (short(x).logits - masked(x).logits).abs().max() > 1e-3  # what the redo prevents
    after = []
    for m, lengths in ((masked, None), (model, [2] * 4)):
        m.router.lengths = lengths
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = torch.optim.SGD(tg.param_groups(m), lr=1.0)  # the update: minus the gradient
        loader = tg.DistributedLoader(shards, 4, hp.seq_len, 0, 1, hp.vocab_size)
        stats = tg.train_step(
            m,
            m.router,
            hp,
            opt,
            loader,
            runs.Dist(),
            contextlib.nullcontext(),
            2,
            [1.0] * len(opt.param_groups),
            0,
        )
        after.append((stats, {n: p.detach() - before[n] for n, p in m.named_parameters()}))
    (s0, p0), (s1, p1) = after
    assert "redone" not in s0 and s1["redone"] == [1]
    assert s1["lm_loss"] == pytest.approx(s0["lm_loss"], rel=1e-5)
    assert (
        model.router.lengths == tg.packed_lengths([s1["packed"]], 32)
        and s1["packed"] == s0["packed"]
    )
    assert p0.keys() == p1.keys()
    for name in p0:
        assert_close_rel(p1[name], p0[name], 1e-4)


@pytest.mark.parametrize("axis", ["key", "query"])
def test_incremental_decoding_matches_a_full_forward_pass(axis):
    torch.manual_seed(0)
    hp = tiny(n_layers=4, dim=48, max_seq_len=24, seq_len=24, compact=axis == "key", gate_axis=axis)
    model = tg.GPT(hp).eval()
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=0.15)
        torch.nn.init.constant_(gate.bias, 0.1)
    idx = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, gates = logits_gates(model, idx)
        dense_masked = tg.GPT(replace(hp, compact=False)).eval()
        dense_masked.load_state_dict(model.state_dict())
        masked = dense_masked(idx).logits
    cache = sample.KVCache(hp, "cpu")
    for pos in range(24):
        with torch.no_grad():
            step = model(idx[:, pos : pos + 1], pos=torch.tensor([[pos]]), cache=cache).logits
        assert (step[0, -1] - full[0, pos]).abs().max().item() < 1e-4
        assert (step[0, -1] - masked[0, pos]).abs().max().item() < 1e-4
    assert (gates == 0).any()
    if axis == "query":  # a skipped token is still attended to: every block keeps its K/V
        assert cache.n == [24] * 4
        return
    # each block keeps K/V only for the tokens whose gate there is non-zero
    assert cache.n == [(gates[layer, 0] > 0).sum().item() for layer in range(4)]
    assert sum(cache.n) < 4 * 24 and min(cache.n) > 0


def test_generate_samples_reproducibly_and_reports_the_cache():
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=2, max_seq_len=16, seq_len=16, gate_init="zero"))
    a, cache = sample.generate(model, [1, 2, 3], 10, temperature=0.8, top_k=20, seed=5)
    b, _ = sample.generate(model, [1, 2, 3], 10, temperature=0.8, top_k=20, seed=5)
    assert a == b and len(a) == 13 and a[:3] == [1, 2, 3] and all(0 <= t < 97 for t in a)
    assert cache.n == [12, 12]  # zero gates: every token runs every block (the last is not fed)
    with pytest.raises(tg.UserError):
        sample.generate(model, [1] * 10, 10)
    # a temperature too small for float32 logits / T: the likeliest token, as greedy decoding
    greedy, _ = sample.generate(model, [1, 2, 3], 10, temperature=0)
    assert sample.generate(model, [1, 2, 3], 10, temperature=1e-40)[0] == greedy


# ---------------------------------------------------------------------------- DLO


def test_zero_router_scores_are_one_and_the_model_is_dense():
    torch.manual_seed(0)
    dense = tg.GPT(tiny(router="none"))
    dlo = tg.GPT(tiny(router="dlo"))
    missing, unexpected = dlo.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and missing == [f"router.routers.{i}.weight" for i in range(4)]
    idx = torch.randint(0, 97, (3, 16))
    ref = dense(idx).logits
    dlo.router.rates = torch.zeros(4, dtype=torch.float64)  # training: skip rate 0 everywhere
    for model in (dlo.eval(), dlo.train()):
        out = model(idx)
        scale = out.route["scale"]
        assert torch.equal(scale, torch.ones_like(scale)) and out.route["mlp"].all()  # r = 1
        assert (out.logits - ref).abs().max().item() <= 1e-6


def test_dlo_training_runs_the_top_tokens_by_score():
    torch.manual_seed(0)
    model = tg.GPT(tiny(router="dlo", n_layers=2))
    for router in model.router.routers:
        torch.nn.init.normal_(router.weight, std=0.5)
    model.router.rates = torch.tensor([0.5, 0.25], dtype=torch.float64)
    out = model.train()(torch.randint(0, 97, (3, 16)))
    scale, ran = out.route["scale"], out.route["mlp"]
    runs = ran.sum(dim=2)  # (L, B) tokens running the MLP per sequence
    assert runs[0].tolist() == [8, 8, 8] and runs[1].tolist() == [12, 12, 12]
    assert torch.equal(ran, scale > 0) and out.route["block"].all()  # attention runs for all
    r = 1 + (2 * torch.sigmoid(out.route["logits"]) - 1) * 0.05 / 2  # eq. (1), beta = 2
    for layer in range(2):
        assert torch.allclose(scale[layer][ran[layer]], r[layer][ran[layer]])  # scaled by r
        for b in range(3):
            assert r[layer, b][ran[layer, b]].min() >= r[layer, b][~ran[layer, b]].max()
    assert 0.975 < r.min() and r.max() < 1.025


def test_dlo_compact_evaluation_matches():
    torch.manual_seed(0)
    hp = tiny(router="dlo")
    models = [tg.GPT(hp).eval(), tg.GPT(replace(hp, compact=True)).eval()]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        for i, router in enumerate(m.router.routers):
            torch.manual_seed(i)
            torch.nn.init.normal_(router.weight, std=0.5)
    idx = torch.randint(0, 97, (3, 16))
    a, b = models[0](idx), models[1](idx)
    assert 0.2 < (~a.route["mlp"]).float().mean() < 0.8
    assert (
        torch.equal(a.route["scale"], b.route["scale"]) and (a.logits - b.logits).abs().max() < 1e-5
    )
    models[1].router.lengths = tg.packed_counts(a.route).int().tolist()  # given: the exact fit
    assert max(models[1].router.lengths) < 16
    c = models[1](idx)
    assert (
        torch.equal(a.route["scale"], c.route["scale"]) and (a.logits - c.logits).abs().max() < 1e-5
    )
    models[1].router.lengths = [max(0, n - 1) for n in models[1].router.lengths]  # a token fewer
    assert (models[1](idx).logits - a.logits).abs().max() > 1e-3


def test_dlo_labels_and_skip_loss_match_a_hand_computed_example():
    sim = torch.tensor([[[0.9, 0.1, 0.5]], [[0.2, 0.8, 0.3]]])  # (L=2, B=1, T=3)
    labels = tg.DLO.labels(sim, 0.5)  # floor(0.5 * 6) = 3 least similar run: .1 .2 .3
    assert labels.squeeze(1).tolist() == [[0, 1, 0], [1, 0, 1]]
    assert tg.DLO.labels(sim, 0.0).sum() == 6 and tg.DLO.labels(sim, 0.9).sum() == 0
    other = torch.tensor([[[0.05, 0.6, 0.7]], [[0.65, 0.04, 0.9]]])  # least: .04 .05 .6
    both = tg.DLO.labels(torch.cat([sim, other], dim=1), 0.5)  # each sequence ranked alone
    assert both.permute(1, 0, 2).tolist() == [[[0, 1, 0], [1, 0, 1]], [[1, 1, 0], [0, 1, 0]]]
    z = torch.tensor([[[0.0, 2.0, -1.0]], [[1.0, -2.0, 0.5]]])

    def sig(t):
        return 1 / (1 + math.exp(-t))

    expected = (
        -(
            math.log(1 - sig(0.0))
            + math.log(sig(2.0))
            + math.log(1 - sig(-1.0))
            + math.log(sig(1.0))
            + math.log(1 - sig(-2.0))
            + math.log(sig(0.5))
        )
        / 6
    )
    dlo = tg.DLO(tiny(router="dlo", n_layers=2, dlo_rho=0.5, dlo_anneal_steps=0))
    loss, sums = dlo.loss({"similarity": sim, "logits": z}, step=0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert sums.tolist() == [[1.0, 2.0]]  # labels to run per layer, for eq. (8)


def test_a_router_owns_the_depth_loop():
    # a router that applies block 0 twice and leaves before block 1 is one subclass: the model
    # hands it the blocks and reads back what it recorded
    class Twice(tg.Router):
        def forward(self, blocks, x, trace, mask, pos=None, cache=None):
            for _ in range(2):
                x = self.run(0, blocks[0], x, trace, mask, pos)
            return x

    torch.manual_seed(0)
    model = tg.GPT(tiny(router="none", n_layers=2)).eval()
    model.router = Twice(model.hp)
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        out = model(idx)
        x = model.embed_norm(model.embed(idx))
        x = model.blocks[0](model.blocks[0](x, None, None), None, None)
        expected = model.head(model.head_norm(x))
    assert (out.logits - expected).abs().max().item() < 1e-5
    assert out.route["block"].shape == (2, 2, 16) and out.resid is None  # its own trace


def test_dlo_annealing_rates_and_layer_learning_rates():
    state = tg.DLO(tiny(router="dlo", n_layers=2, dlo_rho=0.4, dlo_anneal_steps=4))
    assert [state.overall(s) for s in (0, 1, 3, 10)] == pytest.approx([0.1, 0.2, 0.4, 0.4])
    assert state.rates.tolist() == pytest.approx([0.1, 0.1])  # rho_{i,1}: step 1's rate
    assert state.lr_scales(0) == pytest.approx([1.0, 1.0])
    state.update(torch.tensor([[6.0, 2.0]]), 8, step=0)  # eq. (8): 6 of 8 labelled to run
    assert state.rates.tolist() == pytest.approx([0.25, 0.75])
    assert state.lr_scales(3) == pytest.approx([0.75 / 0.6, 0.25 / 0.6])  # eq. (10)
    model = tg.GPT(tiny(router="dlo", n_layers=2))
    groups = tg.param_groups(model)
    assert len(groups) == 3 and any(
        p is model.router.routers[1].weight for p in groups[2]["params"]
    )
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def expanded(init, R=4, P=2, q=1, tau=2):
    torch.manual_seed(0)
    src = tg.GPT(tiny(router="none", n_layers=R))
    state = expand.expand_state(src.state_dict(), R, P, q, init, tau, 0, src.router.layer_modules)
    return src, state


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


def test_dlo_flops_count_only_executed_mlps():
    hp = tiny(router="dlo", n_layers=2)
    dense = tg.forward_flops(replace(hp, router="none"))
    half = tg.forward_flops(hp, None, [0.5, 0.5])
    ffn = 2 * 3 * 32 * 4 * 32 * 16  # SwiGLU FLOPs per layer and sequence
    routers = 2 * 16 * 2 * 32
    assert dense - half == pytest.approx(2 * 0.5 * ffn - routers)


@pytest.mark.slow
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
        code = support.cli(expand_main, list(map(str, args)))
        out = capsys.readouterr()
        return code, out.out, out.err

    # the shape comes from the checkpoint: P = 1 group of 2 layers, q = 2 new ones
    code, out, err = expand_cli(
        tmp_path / "dense",
        tmp_path / "dlo",
        "--per_group=2",
        "--router=dlo",
        "--dlo_rho=0.5",
        "--dlo_anneal_steps=10",
        "--train_tokens=7680",
    )
    assert code == 0 and f"--resume={tmp_path / 'dlo'}" in out, err
    expanded = tg.load_checkpoint(str(tmp_path / "dlo"))
    assert expanded["step"] == 0  # it reads on where the source stopped: the tokens it has not seen
    assert (
        expanded["loader"]
        == tg.load_checkpoint(str(tmp_path / "dense"))["loader"]
        != {"shard": 0, "pos": 0}
    )
    code, _, err = run_main([f"--resume={tmp_path / 'dlo'}"], capsys)
    assert code == 0, err
    dense = [m for m in read_metrics(tmp_path / "dense") if m["kind"] == "val"]
    dlo = [m for m in read_metrics(tmp_path / "dlo") if m["kind"] == "val"]
    assert json.loads((tmp_path / "dlo" / "config.json").read_text())["n_layers"] == 4
    assert "def train(" in (tmp_path / "dlo" / "train.log").read_text()  # the source, once
    # identity expansion: the expanded model starts exactly where the dense one ended
    assert dlo[0]["step"] == 0 and dlo[0]["val_loss"] == pytest.approx(
        dense[-1]["val_loss"], abs=1e-4
    )
    assert dlo[-1]["val_loss"] < dlo[0]["val_loss"]
    assert len(dlo[-1]["mlp_active"]) == 4 and min(dlo[-1]["mlp_active"]) < 1.0
    assert dlo[-1]["fwd_flops_per_token"] < dlo[-1]["fwd_flops_per_token_dense"]
    # refused, with one error line and nothing written: a DLO checkpoint's routers fit no other
    # router; a router tied to the layer count; a shape field; a checkpoint already there
    for args, message in (
        (
            (tmp_path / "dlo", tmp_path / "x", "--router=mod"),
            "expands into a dlo model, not router=mod",
        ),
        (
            (tmp_path / "dense", tmp_path / "x", "--router=skip_middle"),
            "router=skip_middle is tied to the layer count",
        ),
        ((tmp_path / "dense", tmp_path / "x", "--dim=64"), "keeps the checkpoint's shape"),
        ((tmp_path / "dense", tmp_path / "x", "--groups=3"), "cannot make 3 groups of 2"),
        ((tmp_path / "dense", tmp_path / "x", "--init=linear", "--tau=3"), "--tau=3"),
        ((tmp_path / "dense", tmp_path / "x", "--init=magic"), "--init: invalid choice"),
        ((tmp_path / "dense", tmp_path / "x", "--nope=1"), "unknown field 'nope'"),
        ((tmp_path / "nowhere", tmp_path / "x"), "nowhere: no such folder"),
        (
            (tmp_path / "dense", tmp_path / "x", "--val_tokens=1e8"),
            "more than the validation shards hold",
        ),
        (
            (tmp_path / "dense", tmp_path / "dlo"),
            "dlo already holds checkpoint.pt, expand.json, "
            "train.log, checkpoint.prev.pt, metrics.jsonl, config.json: expand into a folder",
        ),
    ):
        code, _, err = expand_cli(*args)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, (args, err)
        assert not (tmp_path / "x").exists()
    # nor onto an aborted run's logs, or a file of that name of the user's: neither moved nor
    # replaced
    for name in ("train.log", "expand.json"):
        (tmp_path / "mine").mkdir(exist_ok=True)
        (tmp_path / "mine" / name).write_text("mine")
        code, _, err = expand_cli(tmp_path / "dense", tmp_path / "mine")
        assert code == 2 and f"mine already holds {name}: " in err and err.count("\n") == 1, err
        assert [p.name for p in (tmp_path / "mine").iterdir()] == [name]
        (tmp_path / "mine" / name).unlink()
    # a disk that fills while the new checkpoint is written: named, status 1, nothing left
    # over the 1 MiB probe
    r = subprocess.run(
        [sys.executable, "expand.py", tmp_path / "dense", tmp_path / "x" / "y"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: disk_nearly_full(2 << 20),
    )
    assert (
        r.returncode == 1
        and r.stderr == f"error: {tmp_path / 'x' / 'y' / 'checkpoint.pt'}: File too large\n"
    )
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- Figure 2 harness


def test_student_t_and_holm_against_tables_and_closed_forms():
    sweep = load_command("sweep.py")
    for df, t975 in (
        (1, 12.706),
        (2, 4.303),
        (4, 2.776),
        (9, 2.262),
        (30, 2.042),
    ):  # printed tables
        assert sweep.t_critical(0.05, df) == pytest.approx(t975, abs=6e-4)
        assert sweep.t_tail(t975, df) == pytest.approx(0.05, abs=2e-4)
    assert sweep.t_critical(0.4, 4) == pytest.approx(0.941, abs=6e-4)  # one-sided 0.80, df 4
    for t in (0.3, 1.0, 3.0, 20.0):  # closed forms: Cauchy (df 1) and df 2
        assert sweep.t_tail(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-9)
        assert sweep.t_tail(-t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), abs=1e-9)
    # Holm by hand: sorted 0.005 0.01 0.03 0.04 times 4 3 2 1, then the running maximum
    assert sweep.holm([0.01, 0.04, 0.03, None, 0.005]) == pytest.approx(
        [0.03, 0.06, 0.06, None, 0.02]
    )
    assert sweep.holm([0.5, 0.9]) == [1.0, 1.0]


def test_frontier_and_verdict_on_hand_made_numbers():
    sweep = load_command("sweep.py")
    at = sweep.frontier([(4e6, 3.0), (1e6, 4.0)])
    assert at(2e6) == pytest.approx(3.5)  # half way in log FLOPs between 1e6 and 4e6
    assert at(1e6) == 4.0 and at(4e6) == 3.0
    assert at(4e6 * 1.005) == 3.0  # within the slack beyond the end point
    assert at(5e6) is None and at(0.5e6) is None  # no extrapolation
    # the lower envelope: a costlier dense point no better than a cheaper one is dropped
    env = sweep.frontier([(1e6, 4.0), (4e6, 3.0), (16e6, 3.2)])
    assert env(8e6) == 3.0 and env(16e6) == 3.0 and env(2e6) == pytest.approx(3.5)

    def row(name, seed, flops, loss):
        return dict(
            name=name,
            seed=seed,
            flops_per_token=flops,
            val_loss=loss,
            sparsity=0.5,
            val_se=0.01,
            ms_per_token_masked=flops / 1e9,
            ms_per_token_compact=flops / 2e9,
            params=1e6,
        )

    rows, a_losses = [], [3.40, 3.41, 3.39, 3.42, 3.38]
    for s in range(5):
        rows += [row("dense_2", s, 1e6, 4.0 + 0.1 * s), row("dense_4", s, 4e6, 3.0 + 0.1 * s)]
    rows += [row("gated_a", s, 2e6, loss + 0.1 * s) for s, loss in enumerate(a_losses)]
    rows += [
        row("gated_b", s, 2e6, 3.5 + 0.1 * s + d) for s, d in enumerate([0.1, -0.1, 0.05, -0.05, 0])
    ]
    rows += [row("gated_c", s, 8e6, 2.0) for s in range(5)]  # beyond the dense FLOPs range
    rows += [
        row("dlo_control", s, 2e6, 3.5 + 0.1 * s + d)
        for s, d in enumerate([0.01, -0.01, 0.02, -0.02, 0])
    ]
    rows += [row("dlo_rho0.5", s, 2e6, 3.6 + 0.1 * s + 0.001 * s) for s in range(5)]
    e_deltas = [0.05, 0.01, 0.03, 0.045, 0.005]  # raw p 0.036, not after Holm's correction
    rows += [row("gated_e", s, 2e6, 3.5 + 0.1 * s + d) for s, d in enumerate(e_deltas)]
    rows += [row("gated_f", s, 2e6, 3.55 + 0.1 * s) for s in range(5)]  # the same in every seed
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows)}
    e = lines[("gated_e", "dense frontier")]
    # (scipy's ttest_1samp)
    assert e["p"] == pytest.approx(0.036167, abs=2e-6) and e["p_holm"] > 0.05
    assert e["verdict"].startswith("no detectable difference (95% CI [+0.003, +0.053])")
    assert e["detectable"] == pytest.approx(
        (sweep.t_critical(0.05 / 6, 4) + 0.941) * e["sd"] / math.sqrt(5), rel=1e-3
    )
    assert (
        lines[("gated_f", "dense frontier")]["verdict"]
        == "above (the same difference in every seed: no test)"
    )
    a = lines[("gated_a", "dense frontier")]
    deltas = [x - 3.5 for x in a_losses]  # each seed's frontier at 2e6 is 3.5 + 0.1 s
    mean, sd = sum(deltas) / 5, math.sqrt(sum((d - sum(deltas) / 5) ** 2 for d in deltas) / 4)
    assert a["mean"] == pytest.approx(mean) and a["sd"] == pytest.approx(sd)
    assert a["hi"] - a["mean"] == pytest.approx(2.776 * sd / math.sqrt(5), rel=1e-3)
    assert a["p"] == pytest.approx(1.45e-4, rel=0.01) and a["verdict"] == "better than dense"
    b = lines[("gated_b", "dense frontier")]
    assert b["mean"] == pytest.approx(0, abs=1e-12) and b["p"] == pytest.approx(1.0)
    assert b["verdict"] == f"no detectable difference (95% CI [{b['lo']:+.3f}, {b['hi']:+.3f}])"
    assert lines[("gated_c", "dense frontier")]["verdict"] == "outside the dense FLOPs range"
    dlo = lines[("dlo_rho0.5", "dlo_control")]  # against its own control, seed by seed
    assert dlo["mean"] == pytest.approx(0.102) and dlo["verdict"] == "worse than dlo_control"
    assert lines[("dlo_control", "dense frontier")]["p"] == pytest.approx(1.0)
    tested = [ln for ln in lines.values() if ln.get("p") is not None]
    assert len(tested) == 6  # gated_a, gated_b, gated_e, dlo_control, dlo_rho0.5 twice
    holm = sweep.holm([ln["p"] for ln in tested])
    assert [ln["p_holm"] for ln in tested] == pytest.approx(holm)
    assert lines[("dense_4", "")]["verdict"] == "frontier"
    assert a["dense_ms_at_equal_flops"] == pytest.approx(2.5e-3)  # (1e-3 + 4e-3) / 2, log midpoint
    text = sweep.verdict_text(list(lines.values()))
    assert text.startswith(
        "6 paired comparisons over 5 seeds, Holm-corrected: gated_a better than dense"
    )
    one_seed = sweep.summarise([r for r in rows if r["seed"] == 0])
    assert "use --seeds=5" in sweep.verdict_text(one_seed)


TINY_GRID = [
    "--preset=smoke",
    "--dim=32",
    "--n_heads=4",
    "--n_kv_heads=2",
    "--max_seq_len=32",
    "--seq_len=32",
    "--batch_size=8",
    "--device_batch_size=8",
    "--train_tokens=1280",
    "--val_every=0",
    "--val_tokens=512",
    "--untimed_steps=0",
    "--save_every=2",
]


@pytest.mark.slow
def test_a_tiny_grid_runs_end_to_end_and_a_killed_one_resumes(tmp_path, monkeypatch, capsys):
    sweep = load_command("sweep.py")
    # (its val_tokens overrides the base's, as dlo_source's train_tokens does in the real grids)
    gated = sweep.gated("gated_mu0.5", "--n_layers=4", "--mu_end=0.5", "--val_tokens=256")
    grid = dict(
        base=TINY_GRID,
        n_layers=4,
        runs=[
            sweep.dense(2),
            sweep.dense(4),
            gated,
            sweep.dlo(0.5, "dense_2", 2, 2),
            sweep.dlo_control("dense_2", 2),
            sweep.mor(4),
        ],
    )
    monkeypatch.setitem(sweep.GRIDS, "tiny", grid)
    runs, out = tmp_path / "runs", tmp_path / "out"
    # a grid killed while it trained the gated run: that run has a checkpoint at step 2 of 5
    sweep.launch(
        TINY_GRID
        + gated[1]
        + ["--seed=0", f"--run_dir={runs / 'gated_mu0.5_s0'}", "--stop_step=2"],
        1,
    )
    assert sweep.run_state(str(runs / "gated_mu0.5_s0")) == "resume"

    def in_process(args, nproc, script="train_gpt.py", label=""):  # the rest: quicker here
        main = tg.main if script == "train_gpt.py" else load_command(script).main
        assert support.cli(main, args) == 0, capsys.readouterr().err

    monkeypatch.setattr(sweep, "launch", in_process)
    argv = ["--grid=tiny", f"--runs={runs}", f"--out={out}"]
    assert support.cli(sweep.main, argv) == 0
    assert "resumed at step 2" in (runs / "gated_mu0.5_s0" / "train.log").read_text()
    names = ["dense_2", "dense_4", "gated_mu0.5", "dlo_rho0.5", "dlo_control", "mor_r2"]
    for name in names:
        assert sweep.run_state(str(runs / f"{name}_s0")) == "done"
    assert {p.name for p in out.iterdir()} >= {"table.md", "runs.csv", "figure.png", "README.md"}
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (out / "README.md").read_text()
    assert "Verdict: with one seed no difference can be tested" in readme
    table = {r["name"]: r for r in sweep.read_runs(str(out / "runs.csv"))}
    assert list(table) == names
    for name in ("gated_mu0.5", "dlo_rho0.5", "dlo_control"):  # resumed, with the grid's job
        assert (
            json.loads((runs / f"{name}_s0" / "config.json").read_text())["job"]["untimed_steps"]
            == 0
        )
    control = json.loads((runs / "dlo_control_s0" / "config.json").read_text())
    assert (control["router"], control["n_layers"]) == ("none", 4)  # dense_2 expanded, no skipping
    # unique parameters: MoR's 4 applied blocks are 3 of their own, the dense 4-layer model's 4
    params = {name: r["params"] for name, r in table.items()}
    assert params["dense_2"] < params["mor_r2"] < params["dense_4"]
    for name, r in table.items():  # the table holds each run's own final validation
        last = [m for m in read_metrics(runs / f"{name}_s0") if m["kind"] == "val"][-1]
        assert r["val_loss"] == pytest.approx(last["val_loss"])
        assert r["flops_per_token"] == pytest.approx(last["fwd_flops_per_token"])
        assert r["ms_per_token_masked"] > 0 and r["ms_per_token_compact"] > 0
        assert (r["steps"], r["tokens"]) == (last["step"], last["step"] * 8 * 32)
    # the standard error over documents, by hand from the dense model's per-token losses
    model = tg.load_model(str(runs / "dense_4_s0")).eval()
    hp = model.hp
    stream = torch.from_numpy(
        shards.read_shard(shards.find_shards(hp.val_files)[0], hp.vocab_size)[
            : hp.val_tokens + 1
        ].astype(np.int64)
    )
    with torch.no_grad():
        logits = model(stream[:-1].view(-1, hp.seq_len)).logits.flatten(0, 1)
    docs, cur = [], []
    for loss, target in zip(
        F.cross_entropy(logits, stream[1:], reduction="none").tolist(),
        stream[1:].tolist(),
        strict=True,
    ):
        if target == shards.EOT and cur:
            docs.append(cur)
            cur = []
        cur.append(loss)
    docs.append(cur)
    total, n = sum(map(sum, docs)), sum(map(len, docs))
    se = (
        math.sqrt(
            len(docs) / (len(docs) - 1) * sum((sum(d) - total / n * len(d)) ** 2 for d in docs)
        )
        / n
    )
    assert (table["dense_4"]["val_docs"], table["dense_4"]["val_se"]) == (
        len(docs),
        pytest.approx(se),
    )
    # the table and figure again from runs.csv alone, by the record's own command
    before = (out / "table.md").read_text()
    (out / "table.md").unlink()
    assert support.cli(sweep.main, [f"--report={out / 'runs.csv'}"]) == 0
    assert (out / "table.md").read_text() == before and "| dlo_rho0.5 | dlo_control | 1 |" in before
    d2, d4 = (table[n] for n in ("dense_2", "dense_4"))

    def x(r):
        return math.log(r["flops_per_token"])

    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(list(table.values()))}
    for name in ("gated_mu0.5", "dlo_rho0.5"):
        r = table[name]
        if x(d2) <= x(r) <= x(d4) and d4["val_loss"] < d2["val_loss"]:  # the frontier, by hand
            w = (x(r) - x(d2)) / (x(d4) - x(d2))
            front = d2["val_loss"] + w * (d4["val_loss"] - d2["val_loss"])
            assert lines[(name, "dense frontier")]["mean"] == pytest.approx(
                r["val_loss"] - front, abs=1e-9
            )
    # run again: nothing is trained, no run directory changes (a user's notes in a log included)
    with open(runs / "dense_2_s0" / "metrics.jsonl", "a") as f:
        f.write("my note\n[1, 2]\n")
    before = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert support.cli(sweep.main, argv) == 0
    printed = capsys.readouterr().out
    assert printed.count(": done") == 6 and "trained" not in printed
    assert before == {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    # the grid edited (a longer budget): its finished runs are not taken as the new grid's
    monkeypatch.setitem(grid, "base", [a.replace("=1280", "=2560") for a in TINY_GRID])
    capsys.readouterr()
    code, err = support.cli(sweep.main, argv), capsys.readouterr().err
    assert (
        code == 2
        and "dense_2_s0 was trained with other settings (train_tokens=1280 there, 2560 here)" in err
    ), err
    assert before == {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    # so is a grid with an override removed (dense_2's router=none: the default again), or a DLO
    # run's expansion made otherwise
    monkeypatch.setitem(grid, "base", TINY_GRID)
    runs_of = list(grid["runs"])
    dlo = runs_of[3]
    for i, entry, said in (
        (0, ("dense_2", ["--n_layers=2"]), "router=none there, skip_middle here"),
        (3, (*dlo[:2], [*dlo[2][:-1], "--init=copy"]), "init=identity there, copy here"),
    ):
        monkeypatch.setitem(grid, "runs", runs_of[:i] + [entry] + runs_of[i + 1 :])
        code, err = support.cli(sweep.main, argv), capsys.readouterr().err
        assert code == 2 and f"{entry[0]}_s0 was trained with other settings ({said})" in err, err
    monkeypatch.setitem(grid, "runs", runs_of)
    assert before == {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    # a file the sweep did not write (or changed since) is never replaced: refused before any run
    (out / "README.md").write_text("my notes")
    code, err = support.cli(sweep.main, argv), capsys.readouterr().err
    assert code == 2 and err.startswith(
        f"error: {out / 'README.md'} is there (a file) and this command did not write it"
    ), err
    (out / "table.md").unlink()
    (out / "table.md").mkdir()
    code, err = support.cli(sweep.main, [f"--report={out / 'runs.csv'}"]), capsys.readouterr().err
    assert code == 2 and "table.md is there (a folder)" in err and err.count("\n") == 1, err
    assert (out / "README.md").read_text() == "my notes" and before == {
        p: p.read_bytes() for p in runs.rglob("*") if p.is_file()
    }


class TokenSpans(__import__("html.parser").parser.HTMLParser):
    """Collects the text and title of each <span class="t"> (one per token)."""

    def __init__(self):
        super().__init__()
        self.spans, self.inside, self.external = [], False, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "link", "img") or "src" in attrs or "href" in attrs:
            self.external.append(tag)
        if tag == "span" and attrs.get("class") == "t":
            self.spans.append(["", attrs["title"]])
            self.inside = True

    def handle_endtag(self, tag):
        self.inside = self.inside and tag != "span"

    def handle_data(self, data):
        if self.inside:
            self.spans[-1][0] += data


@pytest.mark.slow
def test_a_sweep_started_outside_the_repository_keeps_its_runs_where_it_was_told(
    tmp_path, monkeypatch
):
    sweep = load_command("sweep.py")  # (its trainers run in the repository: the paths must agree)
    monkeypatch.setitem(sweep.GRIDS, "one", dict(base=TINY_GRID, n_layers=2, runs=[sweep.dense(2)]))
    monkeypatch.chdir(tmp_path)
    assert support.cli(sweep.main, ["--grid=one", "--runs=runs", "--out=out"]) == 0
    assert sweep.run_state(str(tmp_path / "runs" / "dense_2_s0")) == "done"
    row = sweep.read_runs(str(tmp_path / "out" / "runs.csv"))[0]
    assert f"--run_dir={tmp_path / 'runs' / 'dense_2_s0'}" in row["command"]


def test_ctrl_c_on_a_sweep_lets_the_run_in_flight_save_and_stop(tmp_path):
    # the sweep gets the signal (the trainer runs in a session of its own, as after a Ctrl-C
    # at a terminal) and passes it on once: the trainer finishes its step and saves
    sweep, metrics = load_command("sweep.py"), tmp_path / "metrics.jsonl"

    def interrupt():
        deadline = time.time() + 120
        while (
            not (metrics.exists() and '"step": 2' in metrics.read_text()) and time.time() < deadline
        ):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(sweep.Stopped, match="sweep stopped by SIGINT; .* saved its checkpoint"):
        sweep.launch(RESUME_RUN + ["--train_tokens=1024000", f"--run_dir={tmp_path}"], 1)
    step = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"]
    assert (
        step >= 2
        and f"stopped by signal SIGINT at step {step}" in (tmp_path / "train.log").read_text()
    )


def test_ctrl_c_while_a_sweep_starts_its_trainer_stops_it_quietly(tmp_path, monkeypatch):
    sweep, real = load_command("sweep.py"), subprocess.Popen

    def interrupted_popen(*args, **kwargs):  # the Ctrl-C lands as the trainer is starting
        proc = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return proc

    monkeypatch.setattr(sweep.subprocess, "Popen", interrupted_popen)
    with pytest.raises(
        sweep.Stopped, match="sweep stopped by SIGINT; .* stopped, keeping its last"
    ):
        sweep.launch(RESUME_RUN + [f"--run_dir={tmp_path}"], 1)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_skipview_page_has_one_element_per_token_with_its_depth(tmp_path, capsys):
    skipview = load_command("skipview.py")
    run = tmp_path / "run"
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={run}", "--stop_step=4"], capsys)
    assert code == 0, err
    text = "The gate decides, per token, how many blocks run.\nA second line & <markup>."
    page = tmp_path / "page.html"
    assert support.cli(skipview.main, [str(run), f"--text={text}", f"--out={page}"]) == 0
    terminal = capsys.readouterr().out
    parser = TokenSpans()
    parser.feed(page.read_text())
    ids = shards.gpt2_encoding().encode_ordinary(text)
    assert len(parser.spans) == len(ids) and not parser.external
    assert "".join(t for t, _ in parser.spans) == text  # every token, in order, unescaped
    # the counts against the gates computed here: blocks with g > 0 per token
    ckpt = tg.load_checkpoint(str(run))
    model = tg.GPT(tg.Hyperparameters(**ckpt["hp"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    with torch.no_grad():
        gates = model(torch.tensor([ids])).route["gates"][:, 0]  # (L, T)
    expected = (gates > 0).sum(0).tolist()
    assert [int(title.split()[0]) for _, title in parser.spans] == expected
    assert "⏎" in terminal and terminal.count("[") >= len(ids)
    assert support.cli(skipview.main, [str(run), "--val_tokens=0"]) == 2
    assert support.cli(skipview.main, [str(run), f"--out={tmp_path}"]) == 2
    assert capsys.readouterr().err.count("error: ") == 2


# ---------------------------------------------------------------------------- Mixture-of-Depths


def mod_model(compact=False, capacity=0.25, seed=0):
    torch.manual_seed(seed)
    model = tg.GPT(tiny(router="mod", mod_capacity=capacity, compact=compact))
    for router in model.router.routers:  # scores spread well beyond their init
        torch.nn.init.normal_(router.weight, std=0.3)
    return model


def test_mod_routes_every_other_block_and_runs_the_top_k_of_each_sequence():
    model = mod_model().train()
    assert model.router.routed == [1, 3]
    idx = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    route = model(idx).route
    assert route["block"][[0, 2]].all()  # unrouted blocks run every token
    r, chosen = route["logits"], route["block"][[1, 3]]  # (2, B, T)
    assert chosen.sum(dim=2).tolist() == [[4] * 3] * 2  # floor(0.25 x 16) per sequence
    assert torch.equal(route["topk"], chosen) and torch.equal(route["mlp"], route["block"])
    for layer in range(2):
        for b in range(3):
            assert r[layer, b][chosen[layer, b]].min() > r[layer, b][~chosen[layer, b]].max()
    route = mod_model(capacity=0.3).train()(idx).route  # 0.3 x 16 = 4.8: floor, 4 tokens
    assert route["block"][[1, 3]].sum(dim=2).tolist() == [[4] * 3] * 2


def test_a_routed_block_matches_the_block_run_on_the_chosen_tokens_alone():
    # reference: each sequence's chosen tokens as a short sequence of their own (with their
    # positions), the block's output scaled by r; every other token passes unchanged
    model = mod_model().train()
    block, x = model.blocks[1], torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    trace = __import__("collections").defaultdict(list)
    with torch.no_grad():
        out = model.router.run(1, block, x, trace, None)
        r, chosen = trace["logits"][0], trace["block"][0]
        for b in range(2):
            pos = chosen[b].nonzero().squeeze(1)
            xs = x[b, pos][None]
            y = block.attend(
                xs, r[b, pos][None, :, None], None, pos=pos[None], keys=torch.ones(1, len(pos), 1)
            )
            y = y + r[b, pos][None, :, None] * block.mlp(y)
            assert (out[b, pos] - y[0]).abs().max().item() < 1e-4
            assert torch.equal(out[b, ~chosen[b]], x[b, ~chosen[b]])


def test_mod_inference_runs_the_tokens_with_positive_scores_causally():
    model = mod_model().eval()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(idx)
        prefix = model(idx[:, :9])
    assert torch.equal(full.route["block"][[1, 3]], full.route["logits"] > 0)
    assert 0 < full.route["block"][1].float().mean() < 1
    assert (full.logits[:, :9] - prefix.logits).abs().max().item() < 1e-5  # no look-ahead


def test_mod_aux_loss_teaches_the_top_k_to_the_sign():
    model = mod_model().train()
    route = model(torch.randint(0, 97, (2, 16))).route
    loss, _ = model.router.loss(route, step=0)
    p, y = torch.sigmoid(route["logits"]), route["topk"].float()
    bce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    assert loss.item() == pytest.approx(0.01 * bce.item(), rel=1e-5)


def assert_compact_matches_masked(make, given=False):
    """make(compact=...) -> a model: the compacted one's training logits, gradients (its router's
    loss included) and evaluation logits equal the masked one's, to 1e-4. given: packed to
    lengths given on the host, the masked pass's packed_counts in that mode (the exact fit;
    MoD's and MoR's training packs its top k, known on the host, whatever the lengths)."""
    models = [make(), make(compact=True)]
    models[1].load_state_dict(models[0].state_dict())
    idx = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(4))
    out, counts = [], {}
    for m in models:
        if given and m is models[1]:
            m.router.lengths = counts[True]
        o = m.train()(idx)
        counts[True] = tg.packed_counts(o.route).int().tolist()
        reg, _ = m.router.loss(o.route, 0)
        (F.cross_entropy(o.logits.flatten(0, 1), idx.flatten()) + reg).backward()
        if given and m is models[1]:
            m.router.lengths = counts[False]
        with torch.no_grad():
            evaluated = m.eval()(idx)
        counts[False] = tg.packed_counts(evaluated.route).int().tolist()
        out.append((o.logits.detach(), grads(m), evaluated.logits))
    assert min(counts[False]) < 16  # some block packs fewer tokens than the sequence has
    (l0, p0, e0), (l1, p1, e1) = out
    assert (l0 - l1).abs().max().item() < 1e-4 and (e0 - e1).abs().max().item() < 1e-4
    for name in p0:
        assert_close_rel(p0[name], p1[name], 1e-4)
    if given:  # the lengths are what packs in evaluation (training packs its exact top k)
        models[1].router.lengths = [max(0, n - 1) for n in counts[False]]  # a token fewer
        with torch.no_grad():
            assert (models[1](idx).logits - e0).abs().max().item() > 1e-3


@pytest.mark.parametrize("given", [False, True])
def test_mod_compact_matches_masked_logits_and_gradients(given):
    assert_compact_matches_masked(mod_model, given)


def test_mod_flops_match_flop_counter_at_capacity(monkeypatch):
    hp = tiny(
        router="mod",
        vocab_size=1000,
        dim=128,
        n_layers=4,
        max_seq_len=64,
        seq_len=64,
        mod_capacity=0.25,
        compact=True,
    )
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    reference = counted_flops(tg.GPT(hp).train(), 1, 64)  # top-k: exactly 16 of 64 tokens
    assert tg.forward_flops(hp, [1, 0.25, 1, 0.25]) == pytest.approx(reference, rel=0.02)
    # the two routers' linears, every token
    assert (
        tg.forward_flops(hp) - tg.forward_flops(replace(hp, router="none", compact=False))
        == 2 * 64 * 2 * 128
    )


# ---------------------------------------------------------------------------- Mixture-of-Recursions


def mor_model(seed=0, **kw):
    """8 applied blocks: 0 and 3 once, the stack 1-2 three times (N_r = 3, M = 2)."""
    torch.manual_seed(seed)
    model = tg.GPT(tiny(**{"router": "mor", "n_layers": 8, **kw}))
    for router in model.router.routers:  # scores spread well beyond their init
        torch.nn.init.normal_(router.weight, std=0.3)
    return model


def test_mor_without_routing_is_its_shared_stack_applied_n_r_times():
    model = mor_model(mor_routed=False).train()
    assert len(model.blocks) == 4 and not list(model.router.parameters())
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        x = model.embed_norm(model.embed(idx))
        for i in [0] + [1, 2] * 3 + [3]:  # ungated, every token, by hand
            x = model.blocks[i](x, None, None)
        expected = model.head(model.head_norm(x))
        out = model(idx)
    assert (out.logits - expected).abs().max().item() < 1e-5
    assert out.route["block"].shape[0] == 8 and out.route["block"].all()
    dense = tg.GPT(tiny(router="none", n_layers=4))  # the unique parameters: a 4-block model's
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in dense.parameters())


@pytest.mark.parametrize("n_layers,mode", [(5, "train"), (8, "train"), (8, "eval")])
def test_mor_matches_a_loop_over_each_sequences_kept_tokens(n_layers, mode):
    # reference: a stack of M = (n_layers - 2) / 3 shared blocks; recursion 0 keeps every token,
    # recursion r > 0 keeps in training the top floor((3 - r) / 3 x 16) of each sequence's
    # still-active tokens by the router's score, in evaluation those with a positive score; the
    # stack runs on the kept tokens alone (a short sequence with their positions) and each moves
    # by sigmoid(score) x the stack's update
    model = mor_model(n_layers=n_layers).train(mode == "train")
    M = (n_layers - 2) // 3
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        x = model.blocks[0](model.embed_norm(model.embed(idx)), None, None)
        active = torch.ones(2, 16, dtype=torch.bool)
        for r, k in enumerate([16, 10, 5]):
            z = model.router.routers[r](x)[..., 0]
            new, kept = x.clone(), torch.zeros_like(active)
            for b in range(2):
                if r == 0:
                    pos = torch.arange(16)
                elif mode == "train":
                    pos = z[b].masked_fill(~active[b], -math.inf).topk(k).indices.sort().values
                else:
                    pos = (active[b] & (z[b] > 0)).nonzero().squeeze(1)
                if len(pos):  # (in evaluation a sequence may keep none)
                    y = x[b, pos][None]
                    for block in model.blocks[1 : 1 + M]:
                        y = block(y, None, None, pos=pos[None])
                    new[b, pos] = x[b, pos] + torch.sigmoid(z[b, pos])[:, None] * (y[0] - x[b, pos])
                    kept[b, pos] = True
            x, active = new, kept
        expected = model.head(model.head_norm(model.blocks[-1](x, None, None)))
        out = model(idx)
    assert 0 < active.float().mean() < 1
    assert (out.logits - expected).abs().max().item() < 1e-4


def test_mor_active_sets_are_nested_and_each_recursion_keeps_its_share():
    route = (
        mor_model()
        .train()(torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(6)))
        .route
    )
    z, active, top = route["logits"], route["active"], route["topk"]  # (2, B, T): recursions 1, 2
    assert active[0].all() and top.sum(dim=2).tolist() == [[10] * 3, [5] * 3]
    for r in range(2):
        assert not (top[r] & ~active[r]).any()
        for b in range(3):
            out = active[r, b] & ~top[r, b]
            assert z[r, b][top[r, b]].min() > z[r, b][out].max()
    assert torch.equal(active[1], top[0])
    # applied blocks: 0 and 7 every token, the stack's two at recursion r its kept tokens
    assert route["block"][[0, 1, 2, 7]].all()
    assert torch.equal(route["block"][3:7], top.repeat_interleave(2, dim=0))


def test_mor_inference_routes_each_token_by_its_own_score():
    model = mor_model().eval()
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(8))
    later = idx.clone()
    later[:, 9:] = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, b = model(idx), model(later)
    runs = a.route["block"][[1, 3, 5]]  # the first block of each recursion
    assert runs[0].all() and 0 < runs[2].float().mean() < runs[1].float().mean() < 1
    assert torch.equal(a.route["block"][:, :, :9], b.route["block"][:, :, :9])  # no look-ahead
    assert (a.logits[:, :9] - b.logits[:, :9]).abs().max().item() < 1e-5


def test_mor_aux_loss_is_the_bce_of_the_active_tokens_by_hand():
    model = mor_model()
    z = torch.tensor([[[2.0, -1.0, 0.5, 0.0]], [[1.5, 3.0, -0.5, 9.0]], [[0.3, -2.0, 1.0, -9.0]]])
    top = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 0, 0]], [[0, 1, 0, 0]]], dtype=torch.bool)
    active = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 1, 1]], [[1, 1, 0, 0]]], dtype=torch.bool)
    terms = []
    for r in range(3):
        for t in range(4):
            if active[r, 0, t]:
                p = 1 / (1 + math.exp(-z[r, 0, t].item()))
                terms.append(-math.log(p) if top[r, 0, t] else -math.log(1 - p))
    loss, _ = model.router.loss({"logits": z, "topk": top, "active": active}, step=0)
    assert loss.item() == pytest.approx(model.hp.mor_aux_coef * sum(terms) / 10, rel=1e-6)


@pytest.mark.parametrize("given", [False, True])
def test_mor_compact_matches_masked_logits_and_gradients(given):
    assert_compact_matches_masked(mor_model, given)


def test_mor_decoding_caches_k_v_only_at_the_recursions_a_token_ran():
    model = mor_model(compact=True).eval()
    idx = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        full = model(idx)
    cache = sample.KVCache(model.hp, "cpu")
    for pos in range(16):
        with torch.no_grad():
            step = model(idx[:, pos : pos + 1], pos=torch.tensor([[pos]]), cache=cache).logits
        assert (step[0, -1] - full.logits[0, pos]).abs().max().item() < 1e-4
    assert cache.n == full.route["block"][:, 0].sum(dim=1).tolist()
    assert cache.n[:3] == [16] * 3 and cache.n[7] == 16 and cache.n[5] < cache.n[3] < 16


def test_mor_flops_match_flop_counter_at_its_shares(monkeypatch):
    hp = tiny(
        router="mor", vocab_size=1000, dim=128, n_layers=5, max_seq_len=64, seq_len=64, compact=True
    )
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    reference = counted_flops(tg.GPT(hp).train(), 1, 64)  # top-k: 64, 42 and 21 of 64 tokens
    assert tg.forward_flops(hp, [1, 1, 42 / 64, 21 / 64, 1]) == pytest.approx(reference, rel=0.02)
    # the three routers' linears, every token
    assert (
        tg.forward_flops(hp) - tg.forward_flops(replace(hp, router="none", compact=False))
        == 3 * 64 * 2 * 128
    )


def test_mor_settings_that_make_no_sense_are_refused():
    for kw, message in (
        (dict(n_layers=7), r"multiple of it \(n_layers=5 or 8\)"),
        (dict(n_layers=4), r"multiple of it \(n_layers=5\)"),
        (dict(mor_routed=False, compact=True), "every token runs everywhere"),
        (dict(n_layers=3, mor_recursions=1, compact=True), "every token runs"),
        (dict(mor_routed=False, mor_aux_coef=0.5), "has no effect"),
        (dict(n_layers=3, mor_recursions=1, mor_aux_coef=0.5), "has no effect"),
    ):
        with pytest.raises(tg.UserError, match=message):
            tg.validate(tiny(router="mor", **{"n_layers": 8, **kw}), 1)
    tg.validate(tiny(router="mor", n_layers=3, mor_recursions=1), 1)  # one block, applied once


def test_skipview_counts_the_recursions_each_token_ran():
    skipview = load_command("skipview.py")
    model = mor_model()
    counts, per_recursion, units = skipview.token_depths(model, list(range(16)), "cpu")
    with torch.no_grad():
        blocks = model(torch.tensor([list(range(16))])).route["block"][:, 0].sum(0).tolist()
    # blocks 0 and 7, then 2 per recursion
    assert units == 3 and [2 + 2 * c for c in counts] == blocks
    assert per_recursion == sorted(per_recursion, reverse=True) and 0 < per_recursion[2] < 16


def test_a_mor_run_resumes_exactly(tmp_path, capsys):
    args = TINY_RUN + [
        "--router=mor",
        "--n_layers=5",
        "--train_tokens=2048",
        "--val_every=2",
        "--val_tokens=512",
    ]
    code, _, err = run_main(args + [f"--run_dir={tmp_path / 'full'}"], capsys)
    assert code == 0, err[-2000:]
    code, _, err = run_main(args + [f"--run_dir={tmp_path / 'part'}", "--stop_step=2"], capsys)
    assert code == 0, err[-2000:]
    code, _, err = run_main([f"--resume={tmp_path / 'part'}"], capsys)
    assert code == 0, err[-2000:]

    def strip(ms):
        return [timing(m) for m in ms if m["kind"] in ("train", "val")]

    a, b = (strip(read_metrics(tmp_path / r)) for r in ("full", "part"))
    assert len(a) == 4 + 3 and a == b
    assert len(a[-1]["block_active"]) == 5 and a[-1]["block_active"][2] < 1  # inference shares


@pytest.mark.slow
@pytest.mark.parametrize("router", ["none", "dlo", "mod"])
def test_a_smoke_run_per_router(tmp_path, router, capsys):
    extra = ["--dlo_anneal_steps=4"] if router == "dlo" else []
    code, _, err = run_main(
        TINY_RUN
        + [
            f"--router={router}",
            "--train_tokens=5120",
            "--val_every=5",
            "--val_tokens=1024",
            f"--run_dir={tmp_path}",
        ]
        + extra,
        capsys,
    )
    assert code == 0, err[-2000:]
    val = [m for m in read_metrics(tmp_path) if m["kind"] == "val"]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.5  # 10 steps of 512 tokens
    assert len(val[-1]["block_active"]) == len(val[-1]["mlp_active"]) == 2
    skipped = {"none": 0.0, "dlo": None, "mod": None}[router]
    assert val[-1]["sparsity"] == skipped if skipped is not None else val[-1]["sparsity"] > 0


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
            tg.check_run(settings, tg.Job(), runs.Dist(device=device), None)
        assert str(e.value) == message
    tg.check_run(replace(hp, attn_impl="sdpa"), tg.Job(), runs.Dist(), None)  # the rest is fine


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
    assert "{none|skip_middle|dlo|mod|mor}" in lines["--router"]  # the registry's names


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
        (dict(router="mod", mod_aux_coef=0.0), "mod_aux_coef=0.0 must lie in (0"),
    ]:
        with pytest.raises(tg.UserError, match=re.escape(message)):
            tg.validate(tiny(**ok, **kw), 1)
    for kw in (
        dict(router="mod", compact=True),
        dict(router="dlo", compact=True),
        dict(controller="sparsity", fixed_coef=0.5),
        dict(controller="proportional", gamma=0.5),
    ):
        tg.validate(tiny(**ok, **kw), 1)


# ---------------------------------------------------------------------------- the loss in chunks


@pytest.mark.parametrize(
    "rows,compiled", [(1, False), (7, False), (16, False), (1000, False), (7, True)]
)
def test_chunked_loss_equals_the_full_cross_entropy_and_its_gradients(rows, compiled):
    # compiled: torch 2.11's torch.compile (any backend) gave all-zero gradients when the
    # loss's forward wrote its gradients into buffers made beforehand (seen on an H100)
    torch.manual_seed(0)
    hp = tiny(loss_rows=rows)
    model = tg.GPT(hp)
    idx = torch.randint(0, 97, (3, 16))
    targets = torch.roll(idx, -1, dims=1)
    reference = F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())  # plain
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = (torch.compile(model, backend="aot_eager") if compiled else model)(
        idx, targets=targets
    ).loss
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close_rel(got[name], expected[name], 1e-5)
    with torch.no_grad():  # evaluation: the same value, no gradient kept
        assert model(idx, targets=targets).loss.item() == pytest.approx(reference.item(), rel=1e-6)


@pytest.mark.parametrize(
    "router,compact",
    [
        ("none", False),
        ("skip_middle", False),
        ("skip_middle", True),
        ("dlo", False),
        ("dlo", True),
        ("mod", False),
        ("mod", True),
        ("mor", False),
        ("mor", True),
    ],
)
@pytest.mark.slow
def test_a_compiled_training_step_equals_the_eager_one(router, compact, monkeypatch, request):
    # what compile_model compiles (each block's regions),
    # through AOTAutograd (aot_eager: the layer where torch 2.11 lost the loss's gradients; the
    # CI's torch 2.11 leg runs this): the loss, the router's loss and every parameter's gradient
    # within 1e-5 of the largest, and no gradient all-zero that eager makes non-zero
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"})
    )
    torch._dynamo.reset()  # a fresh cache, and no silent fall-back to eager at the limit
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    patch.__enter__()  # (not monkeypatch: see the bench test below)
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    hp = tiny(
        router=router,
        compact=compact,
        n_layers=5 if router == "mor" else 4,
        mod_every=2,
        dlo_rho=0.5,
        loss_rows=7,
    )
    torch.manual_seed(0)
    eager, raw = tg.GPT(hp), tg.GPT(hp)
    if router == "skip_middle":
        spread_gates(eager)  # some tokens skip some blocks
    raw.load_state_dict(eager.state_dict())
    model = tg.compile_model(raw)
    idx = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m, r in ((eager, eager), (model, raw)):
        out = m(idx, targets=torch.roll(idx, -1, 1))
        reg, _ = r.router.loss(out.route, 0)
        (out.loss + reg).backward()
        losses.append((out.loss.item(), float(torch.as_tensor(reg).detach())))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    expected, got = grads(eager), grads(raw)
    assert got.keys() == expected.keys() and len(expected) > 4 * hp.n_layers
    for name, g in expected.items():
        assert_close_rel(got[name], g, 1e-5)
        assert got[name].any() or not g.any(), name


# ------------------------------------------------------------------------ CUDA (skipped without)
# Run on a GPU machine with `python -m pytest -q test_train.py -k cuda`; gpu_check.sh runs
# them with the GPU benchmarks and writes a record.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def spread_gates(model, std=0.15, bias=0.1, seed=1):
    torch.manual_seed(seed)
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=std)
        torch.nn.init.constant_(gate.bias, bias)


def cuda_step(model, idx):
    """Loss and parameter gradients of one forward and backward pass."""
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets=torch.roll(idx, -1, 1)).loss
    loss.backward()
    return loss.detach(), grads(model)


@cuda
def test_cuda_flex_score_mod_matches_sdpa_with_gate_gradients():
    # captured tensors in score_mod (here ln g per key) have had silent gradient bugs upstream
    torch.manual_seed(0)
    hp = tiny(n_layers=4, dim=64, max_seq_len=128, seq_len=128)
    models = [tg.GPT(replace(hp, attn_impl=impl)).cuda() for impl in ("sdpa", "flex")]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        spread_gates(m)
    idx = torch.randint(0, 97, (4, 128), device="cuda")
    (l0, g0), (l1, g1) = (cuda_step(m, idx) for m in models)
    assert (l0 - l1).abs().item() < 1e-4
    assert any(k.startswith("router.gates.") for k in g0) and g0.keys() == g1.keys()
    for name in g0:
        assert_close_rel(g0[name], g1[name], 1e-3)


@cuda
def test_cuda_compiled_model_matches_eager():
    # dim 256: at dim 64 Triton 3.6 failed to compile a fused fp32 RMSNorm kernel (H100, torch
    # 2.11); the gradients are what this guards (torch 2.11's compile once zeroed them all)
    torch.manual_seed(0)
    hp = tiny(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=4, max_seq_len=128, seq_len=128, attn_impl="flex"
    )
    eager = tg.GPT(hp).cuda()
    spread_gates(eager)
    compiled_raw = tg.GPT(hp).cuda()
    compiled_raw.load_state_dict(eager.state_dict())
    compiled = tg.compile_model(compiled_raw)
    idx = torch.randint(0, 97, (4, 128), device="cuda")
    (l0, g0), (l1, g1) = cuda_step(eager, idx), cuda_step(compiled, idx)
    assert (l0 - l1).abs().item() < 1e-4
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_close_rel(g0[name], g1[name], 1e-3)


@cuda
def test_cuda_bf16_autocast_loss_is_close_to_fp32():
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=4, dim=64, max_seq_len=128, seq_len=128)).cuda()
    spread_gates(model)
    idx = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad():
        fp32 = model(idx, targets=torch.roll(idx, -1, 1)).loss
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(idx, targets=torch.roll(idx, -1, 1)).loss
    assert abs(bf16.item() - fp32.item()) < 0.02 * fp32.item()


@cuda
def test_cuda_compact_path_compiles_each_packed_length_once_and_never_syncs(request):
    # Inductor and Flex through the packed lengths the packing makes (every block at one unit
    # and at full length, mixed vectors, then each step's own as train_step sets them): no
    # crash, no graph break, one graph per length whatever the vector (the blocks share it),
    # and once compiled a forward and backward pass that never waits for the GPU
    # (torch.cuda.set_sync_debug_mode: any sync an error)
    import torch._dynamo

    torch._dynamo.reset()
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)  # giving up fails
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch.manual_seed(0)
    T, unit = 256, 256 // tg.PACKS
    hp = tiny(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=4, max_seq_len=T, seq_len=T, compact=True,
        attn_impl="flex",
    )  # fmt: skip
    raw = tg.GPT(hp).cuda()
    spread_gates(raw)
    model = tg.compile_model(raw)
    counts = torch._dynamo.utils.counters
    counts.clear()
    given = [[T] * 4, [unit] * 4, [unit, T, 2 * unit, T - unit], [T // 2, 3 * unit, unit, T]]
    lengths = set()
    for step in range(len(given) + 6):  # the given vectors, then each batch's own counts
        if step < len(given):
            raw.router.lengths = given[step]
        lengths.add(tuple(raw.router.lengths))
        idx = torch.randint(0, 97, (4, T), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, targets=torch.roll(idx, -1, 1))
        out.loss.backward()
        assert out.loss.isfinite()
        raw.router.lengths = tg.packed_lengths([tg.packed_counts(out.route).tolist()], T)
    shapes = {n for v in lengths for n in v}
    assert counts["stats"]["unique_graphs"] == len(shapes), (dict(counts["stats"]), shapes)
    assert not counts["graph_break"], dict(counts["graph_break"])
    raw.router.lengths = given[2]  # compiled already
    model(idx, targets=torch.roll(idx, -1, 1)).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(idx, targets=torch.roll(idx, -1, 1))
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def two_ranks(tmp_path, script: str, *args) -> subprocess.CompletedProcess:
    """script run as ddp.py under torchrun on 2 CPU processes (one thread each), with HERE, args
    and tmp_path as its arguments."""
    (tmp_path / "ddp.py").write_text(script)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "ddp.py"),
            HERE,
            *map(str, args),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


DDP_COMPACT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import train_gpt as tg
from dataclasses import asdict, replace
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
hp = replace(tg.Hyperparameters(), vocab_size=97, n_layers=4, dim=32, n_heads=4, n_kv_heads=2,
             max_seq_len=16, seq_len=16, attn_impl="sdpa", compact=True)
model = tg.GPT(hp)
model.load_state_dict(torch.load(sys.argv[2]))
ddp = torch.nn.parallel.DistributedDataParallel(model)
# rank 0: tokens that skip the middle, rank 1: tokens that run it
idx = torch.load(sys.argv[3])[rank]
out = ddp(idx, targets=torch.roll(idx, -1, 1))
out.loss.backward()
torch.save({"grads": {n: p.grad for n, p in model.named_parameters()},
            "block": out.route["block"]}, os.path.join(sys.argv[4], f"rank{rank}.pt"))
torch.distributed.barrier()  # both ranks have saved: what is tested ends here
os._exit(0)  # gloo's teardown (destroy, interpreter exit) can abort ("terminate called ...")
"""


@pytest.mark.slow
def test_ddp_with_compact_blocks_empty_on_one_rank(tmp_path):
    # a block with no active token on one rank: its parameters must still get a (zero)
    # gradient there, or DDP's all-reduce errors or hangs; the result must be one process's
    model = steered_model(tiny(compact=True))  # token 5 skips every gated block, token 7 none
    with torch.no_grad():  # tokens 11 and 12 at two thirds of their embeddings' length
        model.embed.weight[11], model.embed.weight[12] = (2 / 3) * model.embed.weight[[5, 7]]
    idx = torch.stack([torch.full((2, 16), 5), torch.full((2, 16), 7)])  # (rank, B, T)
    idx[:, :, ::4] = torch.tensor([[[11]], [[12]]])  # some variety per rank
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(idx, tmp_path / "idx.pt")
    r = two_ranks(tmp_path, DDP_COMPACT, tmp_path / "model.pt", tmp_path / "idx.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert not ranks[0]["block"][1].any() and ranks[1]["block"][1].all()  # block 1: empty on rank 0
    # one process over both ranks' batches; DDP averages the two ranks' mean-loss gradients
    for i in (0, 1):
        model.zero_grad(set_to_none=True)
        model(idx[i], targets=torch.roll(idx[i], -1, 1)).loss.backward()
        if i == 0:
            first = grads(model)
    expected = {n: (first[n] + p.grad) / 2 for n, p in model.named_parameters()}
    for name, g in expected.items():
        assert_close_rel(ranks[0]["grads"][name], g, 1e-4)
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name])


DDP_REDO = r"""
import contextlib, os, sys, torch
sys.path.insert(0, sys.argv[1])
import runs, train_gpt as tg
from dataclasses import replace
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
hp = replace(torch.load(sys.argv[2], weights_only=False), compact=True)
model = tg.GPT(hp)
model.load_state_dict(torch.load(sys.argv[3]))
model.router.lengths = torch.load(sys.argv[4])  # long enough for rank 0's rows, not rank 1's
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(tg.param_groups(model), lr=1.0)
loader = tg.DistributedLoader(hp.train_files, 2, hp.seq_len, rank, 2, hp.vocab_size)
stats = tg.train_step(ddp, model.router, hp, opt, loader, runs.Dist(rank=rank, world=2),
                      contextlib.nullcontext(), 1, [1.0] * len(opt.param_groups), 0)
torch.save({"stats": stats, "params": model.state_dict()},
           os.path.join(sys.argv[5], f"rank{rank}.pt"))
torch.distributed.barrier()
os._exit(0)  # (gloo's teardown can abort: see DDP_COMPACT)
"""


@pytest.mark.slow
def test_ddp_ranks_redo_a_step_together_when_one_rank_outgrows_its_lengths(tmp_path):
    # the packed counts are the most over the ranks: a rank whose own rows fit its lengths
    # still redoes the step with the rank that did not, and both apply the one-process update
    hp = tiny(
        n_layers=4,
        dim=48,
        max_seq_len=32,
        seq_len=32,
        vocab_size=50257,
        train_files=f"{HERE}/data/sample/sample_train_*.bin",
        batch_size=4,
        device_batch_size=2,
    )
    masked = steered_model(hp)
    loader = tg.DistributedLoader(hp.train_files, 4, 32, 0, 1, hp.vocab_size)
    x, y = loader.next_batch()  # the global batch: rows 0-1 rank 0's, rows 2-3 rank 1's
    with torch.no_grad():
        counts = [tg.packed_counts(masked(x[r : r + 2]).route).tolist() for r in (0, 2)]
    lengths = tg.packed_lengths([counts[0]], 32)
    assert any(n > m for n, m in zip(counts[1], lengths, strict=True))  # rank 1 outgrows them
    assert all(n <= m for n, m in zip(counts[0], lengths, strict=True))  # rank 0 does not
    for name, obj in (("hp", hp), ("model", masked.state_dict()), ("lengths", lengths)):
        torch.save(obj, tmp_path / f"{name}.pt")
    r = two_ranks(tmp_path, DDP_REDO, *(tmp_path / f"{n}.pt" for n in ("hp", "model", "lengths")))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert [rk["stats"].get("redone") for rk in ranks] == [[1], [1]]
    before = {n: p.detach().clone() for n, p in masked.state_dict().items()}
    masked(x, targets=y).loss.backward()  # one process, the global batch (DDP's mean gradient)
    for name, p in masked.named_parameters():
        expected = before[name] - p.grad
        assert_close_rel(ranks[0]["params"][name] - before[name], expected - before[name], 1e-4)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])


@pytest.mark.slow
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=cuda)]
)  # CPU: through AOTAutograd, no Inductor (Dynamo's decisions are the same)
def test_bench_compiles_a_bounded_number_of_graphs_and_times_them(device, monkeypatch, request):
    # bench.py times a masked and a compacted model, their blocks compiled, at four sparsities:
    # per grad mode one graph for the masked model and one per packed length, shared by the
    # blocks and the sparsities; each row's compile columns hold the graphs its calls compiled
    # (the first row's, its forced gates and fitted lengths included), none where none is new
    import torch._dynamo

    if device == "cpu":
        real = torch.compile
        monkeypatch.setattr(
            torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"})
        )
    bench = load_command("bench.py")
    monkeypatch.setitem(
        bench.SIZES,
        "tiny",
        (dict(n_layers=4, dim=256, n_heads=4, n_kv_heads=4, max_seq_len=256, seq_len=256), 4),
    )
    fitted, fit = [], tg.fit_lengths

    def fit_lengths(raw, idx):  # the packed lengths each sparsity is timed at
        fit(raw, idx)
        fitted.append(tuple(raw.router.lengths))

    monkeypatch.setattr(tg, "fit_lengths", fit_lengths)
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)  # not monkeypatch: pytest
    patch.__enter__()  # 9.2 undoes a config attribute by deleting it, and the option is gone
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch._dynamo.reset()
    torch.manual_seed(0)
    counts = torch._dynamo.utils.counters
    counts.clear()
    _, _, rows = bench.bench_size("tiny", device, 1, True)
    lengths = {n for v in fitted for n in v}
    assert len(fitted) == 4 and len(lengths) < 4 * 4
    assert counts["stats"]["unique_graphs"] <= 2 * (1 + len(lengths)), dict(counts["stats"])
    assert not counts["graph_break"], dict(counts["graph_break"])
    assert rows[0]["compile_masked"] > 0 and rows[0]["compile_compact"] > 0
    assert all(r["compile_masked"] == 0 for r in rows[1:])  # its one shape: compiled once
    new = [bool(set(v) - {n for u in fitted[:i] for n in u}) for i, v in enumerate(fitted)]
    assert [r["compile_compact"] > 0 for r in rows] == new  # a new length: a new graph


@pytest.mark.parametrize(
    "router,compact",
    [
        ("none", False),
        ("skip_middle", False),
        ("dlo", False),
        ("mod", False),
        ("mor", False),
        ("skip_middle", True),
        ("dlo", True),
        ("mod", True),
        ("mor", True),
    ],
)
def test_a_training_step_and_its_router_update_read_the_device_once(router, compact, monkeypatch):
    # on a GPU every value read back to the host waits for the queued work: count the reads
    # made by train_gpt.py's own code (item, tolist, bool, float, int) in a step, the router's
    # update and its learning-rate scales (docs/speed.md: what the host waits for). With compact,
    # as train() runs it, the packed lengths are known on the host: no read per block
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(t, *a, real=real, name=name):
            if sys._getframe(1).f_code.co_filename in (
                tg.__file__,
                routers.__file__,
                runs.__file__,
            ):
                reads.append(f"{name} at line {sys._getframe(1).f_lineno}")
            return real(t, *a)

        monkeypatch.setattr(torch.Tensor, name, counted)
    hp = tiny(
        router=router,
        vocab_size=50257,
        batch_size=4,
        device_batch_size=2,
        dlo_rho=0.5,
        compact=compact,
        n_layers=5 if router == "mor" else 4,
    )
    model = tg.GPT(hp)
    opt = torch.optim.AdamW(tg.param_groups(model), lr=1e-3)
    loader = tg.DistributedLoader(
        f"{HERE}/data/sample/sample_train_*.bin", 4, hp.seq_len, 0, 1, hp.vocab_size
    )
    lrs = [1e-3] * len(opt.param_groups)
    if router == "skip_middle":
        spread_gates(model, std=0.5)  # many tokens skip the middle
    if compact and model.router.packs_in_training:
        model.router.lengths = [hp.seq_len] * hp.n_layers  # as train() starts
    for step in (0, 1):  # the second step packs to the lengths the first one's counts gave
        stats = tg.train_step(
            model, model.router, hp, opt, loader, runs.Dist(), contextlib.nullcontext(), 2, lrs, 0
        )
        model.router.update(stats.get("router"), stats["tokens"][0], 0)
        model.router.lr_scales(1)  # the next step's per-layer rates: DLO's eq. 10 reads them
        assert len(reads) == (1 + (router == "dlo")) * (step + 1), reads
    assert "redone" not in stats
    if compact and model.router.packs_in_training:
        seen = model.router.seen  # both steps' counts: the lengths hold the most of either
        assert len(seen) == 2 and seen[-1] == stats["packed"]
        assert model.router.lengths == tg.packed_lengths(seen, hp.seq_len)
        assert min(model.router.lengths) < hp.seq_len  # some block packs fewer than all
    assert stats["tokens"] == [4 * hp.seq_len] and len(stats["block_active"]) == hp.n_layers


def test_ddp_around_the_compiled_blocks_splits_their_graph_at_the_gradient_buckets(
    tmp_path, monkeypatch
):
    # train() wraps the model, its blocks compiled (compile_model), in DDP: the blocks keep their
    # one shared graph, which Dynamo splits at each gradient bucket (DDPOptimizer), so that each
    # bucket's all-reduce can start while the backward of the blocks before it runs
    import torch.distributed as dist

    graphs, real = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=backend, **kw))
    hp = tiny(dim=256, max_seq_len=32, seq_len=32)  # about 1M parameters a block: 4 MB
    x = torch.randint(0, 97, (2, 32))
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    counts, pieces = torch._dynamo.utils.counters, {}
    try:
        for ddp in (False, True):
            graphs.clear()
            counts.clear()
            torch._dynamo.reset()
            model = tg.compile_model(tg.GPT(hp))
            if ddp:  # in train()'s order; buckets of 1 MB (the least DDPOptimizer takes)
                model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
            model(x, targets=x).loss.backward()
            assert counts["stats"]["unique_graphs"] == 1  # one graph serves every block
            pieces[ddp] = len(graphs)
    finally:
        dist.destroy_process_group()
    assert pieces[False] == 1 < pieces[True], pieces  # a piece per bucket


@pytest.mark.parametrize(
    "attn,router,compact",
    [
        *[
            ("sdpa", r, c)
            for r, c in [
                ("none", False),
                ("skip_middle", False),
                ("skip_middle", True),
                ("dlo", False),
                ("dlo", True),
                ("mod", False),
                ("mod", True),
                ("mor", False),
                ("mor", True),
            ]
        ],
        ("flex", "skip_middle", False),
        ("flex", "skip_middle", True),
        ("flex", "mod", False),
        ("flex", "mod", True),
    ],
)  # Flex: a score_mod, key masks, and a block mask per packed length
@pytest.mark.slow
def test_a_compiled_model_stays_compiled(router, compact, attn, monkeypatch, request):
    # at the paper's depth (12 layers): graph breaks and recompiles are dynamo's decisions, the
    # same on CPU and CUDA: traced here with the eager backend, dynamo told to fail where it
    # would give up (its recompile limit). Flex, CUDA's attention, has no backward on CPU: its
    # training steps run forward only, at 4 layers (what differs from SDPA is inside a block).
    # compile_model compiles the blocks (regions), shapes static: the blocks share their graphs,
    # and a packed length compiles one graph, whatever vector of lengths it comes in
    import torch._dynamo

    real, graphs = torch.compile, []

    def backend(gm, example_inputs):  # the model's graphs (Flex's own CPU wrapper names "eager")
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{"backend": backend, **kw}))
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)  # put back afterwards:
    patch.__enter__()  # compile_model raises the limit (not monkeypatch: see the bench test above)
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    hp = tiny(
        router=router,
        compact=compact,
        dim=64,
        n_layers=(11 if router == "mor" else 12) if attn == "sdpa" else 4,
        max_seq_len=256,
        seq_len=256,
        mod_every=2,
        dlo_rho=0.5,
        attn_impl=attn,
    )
    torch.manual_seed(0)
    raw = tg.GPT(hp)
    if router == "skip_middle":
        spread_gates(raw)  # some tokens skip some blocks, more or fewer with each batch
    packs = compact and raw.router.packs_in_training
    if packs:  # as train() and train_step set them: all, then each step's counts
        raw.router.lengths = [hp.seq_len] * hp.n_layers
    model = tg.compile_model(raw)
    lengths = set()
    for step in range(20):  # training: a new batch, the router's loss and update each step
        idx = torch.randint(0, 97, (1, 256), generator=torch.Generator().manual_seed(step))
        with torch.set_grad_enabled(attn == "sdpa"):
            out = model(idx, targets=torch.roll(idx, -1, 1))
            reg, sums = raw.router.loss(out.route, step)
        if attn == "sdpa":
            (out.loss + reg).backward()
        raw.router.update(sums, idx.numel(), step)
        if packs:  # each step's own counts (not train_step's window): lengths change often
            raw.router.lengths = tg.packed_lengths([tg.packed_counts(out.route).tolist()], 256)
            lengths.add(tuple(raw.router.lengths))
    training_graphs = len(graphs)
    model.eval()
    fitted = set()
    with torch.no_grad():
        for seed in range(6):  # evaluation (inference routing), each batch's own lengths
            idx = torch.randint(
                0, 97, (2, 256), generator=torch.Generator().manual_seed(100 + seed)
            )
            if compact:
                tg.fit_lengths(raw, idx)  # (compiled in place: at the shapes used next)
                fitted.add(tuple(raw.router.lengths))
            model(idx, targets=torch.roll(idx, -1, 1))
    # per mode, one graph per shape a block is called at: per packed length (the sequence's
    # when not compacted), for each region the router calls (DLO: attention and MLP apart; MoD,
    # MoR: ungated blocks besides) and for each way of gating it (MoR: keys and none)
    assert not counts["graph_break"], dict(counts["graph_break"])
    shapes = {n for v in lengths for n in v} | {hp.seq_len}
    assert training_graphs <= 2 * len(shapes), (training_graphs, shapes)
    evaluated = {n for v in fitted for n in v} | {hp.seq_len}
    assert len(graphs) - training_graphs <= 2 * len(evaluated), (len(graphs), evaluated)
    if router == "skip_middle" and compact:  # one graph a length: shared by every block
        assert training_graphs == len(shapes) <= tg.PACKS + 1
        assert len(graphs) - training_graphs <= len(evaluated)


# ------------------------------------------------------------------------ layout and settings


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
        digest = support.sha256_of(str(path))
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


def test_one_router_registry_however_train_gpt_is_loaded(tmp_path):
    # by path, with no sys.modules entry (as a tool or notebook may load it): the settings'
    # choices are the registry's names and each one builds its own router; and no module
    # beside it imports train_gpt, which would build a second registry beside __main__'s
    code = """
import importlib.util, sys
from dataclasses import fields, replace
spec = importlib.util.spec_from_file_location("loaded_by_path", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert "loaded_by_path" not in sys.modules and "train_gpt" not in sys.modules
router = {f.name: f for f in fields(m.Hyperparameters)}["router"]
assert router.metadata["spec"] == tuple(m.ROUTERS), router.metadata
smoke = m.resolve(m.parse_overrides(["--preset=smoke", "--n_layers=5", "--compact=false"]))
for name, cls in m.ROUTERS.items():
    hp = replace(smoke, router=name, n_layers=4 if name == "skip_middle" else 5)
    m.validate(hp, 1)
    assert type(m.GPT(hp).router) is cls, name
print(" ".join(m.ROUTERS))
"""
    r = subprocess.run(
        [sys.executable, "-c", code, os.path.join(HERE, "train_gpt.py")],
        cwd=HERE,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["none", "skip_middle", "dlo", "mod", "mor"]
    siblings = "import routers, runs, support, sys; print('train_gpt' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", siblings], cwd=HERE, capture_output=True, text=True)
    assert r.stdout == "False\n", r.stderr


def test_every_fields_facts_are_well_formed():
    # the facts are code (support.setting): each default lies in its own range or choices,
    # every number has a range, and a router named as a field's owner is one that exists
    for cls in (tg.Hyperparameters, tg.Job, runs.RunState):
        for f in tg.fields(cls):
            facts = f.metadata
            assert set(facts) == {"spec", "help", "fixed", "router"}, f.name
            spec, default = facts["spec"], f.default
            if isinstance(spec, tuple):
                assert default in spec and all(type(c) is str for c in spec), f.name
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                low, high, closed_low, closed_high = support.interval(spec)
                assert low <= default <= high, f.name
                assert (low, high) == tuple(map(float, spec[1:-1].split(","))), f.name
            else:
                assert spec == "", f.name  # a text or a boolean: checked where it is used
            assert facts["router"] in ("", *tg.ROUTERS), f.name
            assert not facts["fixed"] or cls is tg.Hyperparameters, f.name
            support.check_fields(cls())  # the defaults pass their own checks


# -----------------------------------------------------------------------------
# Models as files: the authors' released format, --init_from, --eval_only, export.py

AUTHORS_TINY = Path(HERE) / "data" / "fixtures" / "authors_hf_tiny"  # its README: what it is
EVAL_ON_SAMPLE = [
    "--eval_only=true",
    "--val_files=data/sample/sample_val_*.bin",
    "--val_tokens=2048",
    "--seq_len=64",
    "--batch_size=8",
    "--device_batch_size=8",
]
TRAIN_ON_SAMPLE = [  # a new run of the source's settings, on the sample
    "--train_files=data/sample/sample_train_*.bin",
    *EVAL_ON_SAMPLE[1:],
    "--train_tokens=5120",
]


def test_the_authors_released_model_reproduces_their_logits():
    expected = torch.load(AUTHORS_TINY / "expected.pt", weights_only=True)
    ids = expected["input_ids"]
    model = tg.load_model(str(AUTHORS_TINY)).eval()
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
    unrounded = tg.load_model(str(AUTHORS_TINY), embed_dtype="float32").eval()
    with torch.no_grad():
        assert (
            unrounded(ids).logits[..., :1024] - expected["logits_first_1024"]
        ).abs().max() > 1e-2


AUTHORS_CASES = Path(HERE) / "data" / "fixtures" / "authors_cases"  # made by their code: README


@pytest.mark.parametrize("case", sorted(p.name for p in AUTHORS_CASES.iterdir() if p.is_dir()))
def test_the_authors_layout_loads_as_their_code_reads_it(case):
    # each case written and read back by their code (make.py): a FFN multiplier their code
    # ignores (4 x dim whatever it says), Llama 3.1's scaled RoPE, an embedding stored in fp32
    # (their bf16 module rounds it), fields their config class supplies; our logits and gates
    # within 1e-4 of their forward's, and off where what the case is about is not followed
    folder = AUTHORS_CASES / case
    expected = torch.load(folder / "expected.pt", weights_only=True)
    ids = expected["input_ids"]

    def outputs(**changes):
        model = tg.load_model(str(folder), **changes).eval()
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
    assert torch.allclose(norm(xf), expect.float(), atol=1e-2)  # fp32 in: no rounding at all
    assert not torch.equal(norm(xf), expect)


def authors_copy(tmp_path, name, config=None, weights=None, raw=None) -> str:
    """A copy of the authors' tiny folder with its config or weights changed."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    folder.mkdir()
    cfg = json.loads((AUTHORS_TINY / "config.json").read_text())
    text = raw if raw is not None else json.dumps(config(cfg) if config else cfg)
    (folder / "config.json").write_text(text)
    tensors = load_file(AUTHORS_TINY / "model.safetensors")
    if weights is None:
        shutil.copy(AUTHORS_TINY / "model.safetensors", folder)
    elif isinstance(weights, bytes):
        (folder / "model.safetensors").write_bytes(weights)
    else:
        save_file(weights(tensors), folder / "model.safetensors")
    return str(folder)


@pytest.mark.slow
def test_a_source_that_cannot_be_represented_is_one_line_naming_it(tmp_path, capsys):
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
    bench = load_command("bench.py")  # the gate on the query axis has no compact path
    assert support.cli(bench.main, [f"--init_from={AUTHORS_TINY}", f"--out={tmp_path}/b"]) == 2
    out = capsys.readouterr()
    assert "needs the gate on the key axis; this model has router=skip_middle, gate_axis=query" in (
        out.err
    )
    assert out.err.count("\n") == 1 and out.out == "" and not (tmp_path / "b").exists()


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


@pytest.mark.slow
def test_a_hub_source_is_read_from_the_cache_offline_with_one_line_errors(tmp_path, capsys):
    commit = fake_model_repo(tmp_path / "hub", AUTHORS_TINY)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code, local, err = run_main([f"--init_from={AUTHORS_TINY}", *EVAL_ON_SAMPLE], capsys)
    assert code == 0 and local.startswith(f"eval_only {AUTHORS_TINY} val_loss:"), err

    def evaluate(source):
        return subprocess.run(
            [sys.executable, os.path.join(HERE, "train_gpt.py"), f"--init_from={source}"]
            + EVAL_ON_SAMPLE,
            cwd=tmp_path,  # (nothing written: none of the folder's files change)
            env={**env, "OMP_NUM_THREADS": str(torch.get_num_threads())},
            capture_output=True,
            text=True,
            timeout=300,
        )

    shutil.copytree(Path(HERE) / "data" / "sample", tmp_path / "data" / "sample")
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


@pytest.mark.slow
def test_export_round_trips_and_a_new_run_starts_from_the_weights(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "out"
    base = TINY_RUN + ["--train_tokens=10240", "--val_every=0", "--val_tokens=1024"]
    code, _, err = run_main(base + [f"--run_dir={run}"], capsys)
    assert code == 0, err[-2000:]
    export = load_command("export.py")
    assert support.cli(export.main, [str(run), str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # bit for bit, the settings as well
        exported, trained = tg.load_model(str(out)).eval(), tg.load_model(str(run)).eval()
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    assert exported.hp == trained.hp
    config = json.loads((out / "config.json").read_text())
    logged = json.loads((run / "config.json").read_text())
    val = [m for m in read_metrics(run) if m["kind"] == "val"][-1]
    shared = {"train_files": tg.PRESETS["smoke"]["train_files"]}  # inside the repository
    shared["val_files"] = tg.PRESETS["smoke"]["val_files"]  # (relative, as the defaults are)
    assert config["settings"] == {**asdict(trained.hp), **shared}
    assert config["trained"]["git_commit"] == logged["git_commit"]
    card = (out / "README.md").read_text()
    assert logged["command"] in card and f"loss {val['val_loss']:.4f}" in card
    assert f"sparsity {val['sparsity']:.4f}" in card
    # a checkpoint of an older version (no embed_dtype) loads as a float32 embedding
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    del ckpt["hp"]["embed_dtype"]
    (tmp_path / "old").mkdir()
    torch.save(ckpt, tmp_path / "old" / "checkpoint.pt")
    assert tg.load_model(str(tmp_path / "old")).hp == trained.hp
    # again into its own folder: accepted; a folder with a user's file: refused, untouched
    assert support.cli(export.main, [str(run), str(out)]) == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert support.cli(export.main, [str(run), str(tmp_path / "mine")]) == 2
    err = capsys.readouterr().err
    assert "holds files export did not write (notes.txt)" in err and err.count("\n") == 1
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # the tools read the exported folder as they read the run
    sampler, texts = load_command("sample.py"), []
    for source in ([str(run)], [f"--init_from={out}"]):
        assert support.cli(sampler.main, [*source, "--tokens=8", "--seed=3"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 8  # the same text sampled
    # a new run from the weights: at step 0 it validates as --eval_only does the source
    sample_val = ["--val_files=data/sample/sample_val_*.bin", "--val_tokens=1024"]
    code, evaluated, err = run_main([f"--init_from={out}", "--eval_only=true", *sample_val], capsys)
    assert code == 0, err
    new = tmp_path / "new"
    code, _, err = run_main(
        [f"--init_from={out}", f"--run_dir={new}", "--train_tokens=5120", "--val_every=5"]
        + sample_val,
        capsys,
    )
    assert code == 0, err[-2000:]
    first = [m for m in read_metrics(new) if m["kind"] == "val"][0]
    assert first["step"] == 0
    assert f"val_loss:{first['val_loss']:.4f}" in evaluated.splitlines()[0]
    assert json.loads((new / "config.json").read_text())["init_from"] == str(out)
    # a push without a network: one line, after the files are written
    r = subprocess.run(
        [sys.executable, "export.py", str(run), str(tmp_path / "pushed"), "--push_to=me/tiny"],
        cwd=HERE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_none"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not pushed" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "pushed")) == [".outputs.json", *sorted(export.FILES)]


@pytest.mark.slow
def test_export_in_the_authors_layout_reads_back_as_their_model(tmp_path, capsys):
    # a run their model can express (gate on the query axis, a bfloat16 embedding), written in
    # their layout: their config fields and tensor names, read back by our reader of their
    # layout (which reproduces their code's logits: the authors_cases fixtures) to the same
    # logits; a run theirs cannot express: one line, nothing written; the card says what is
    # true of the weights written
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "out"
    base = TINY_RUN + ["--train_tokens=10240", "--val_every=0", "--val_tokens=1024"]
    query = base + ["--gate_axis=query", "--embed_dtype=bfloat16"]
    code, _, err = run_main(query + [f"--run_dir={run}", "--stop_step=3"], capsys)
    assert code == 0, err[-2000:]
    export = load_command("export.py")
    assert support.cli(export.main, [str(run), str(out), "--format=authors"]) == 0
    assert capsys.readouterr().err == ""
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SkipMiddleModel"] and config["use_scaled_rope"] is False
    assert (config["dim"], config["n_layers"], config["ffn_dim_multiplier"]) == (64, 2, 4)
    tensors = load_file(out / "model.safetensors")
    assert all(k.startswith("model.") for k in tensors) and len(tensors) == 2 * 11 + 4 + 2
    assert tensors["model.tok_embeddings.weight"].dtype == torch.bfloat16
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported, trained = tg.load_model(str(out)).eval(), tg.load_model(str(run)).eval()
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    card = (out / "README.md").read_text()
    logged = json.loads((run / "config.json").read_text())
    assert "trained here 3 steps" in card and "from a random initialisation" in card
    assert "no validation of these weights (step 3) recorded" in card
    assert ("with changes not committed" in card) == bool(logged["git_dirty"])
    # a checkpoint alone (no config.json): what is not known is said so
    (tmp_path / "only").mkdir()
    shutil.copy(run / "checkpoint.pt", tmp_path / "only")
    assert support.cli(export.main, [str(tmp_path / "only"), str(tmp_path / "only_out")]) == 0
    card = (tmp_path / "only_out" / "README.md").read_text()
    assert "from unknown (no config.json)" in card and "command: `unknown`" in card, card
    # a run theirs cannot express: refused, naming the setting, nothing written
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    for change, message in (
        (dict(gate_axis="key"), "gate_axis=key: the authors' model has gate_axis=query only"),
        (dict(embed_dtype="float32"), "embed_dtype=float32"),
    ):
        torch.save({**ckpt, "hp": {**ckpt["hp"], **change}}, run / "checkpoint.pt")
        code = support.cli(export.main, [str(run), str(tmp_path / "no"), "--format=authors"])
        err = capsys.readouterr().err
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
    assert support.cli(export.main, [str(new), str(tmp_path / "new_out")]) == 0
    card = (tmp_path / "new_out" / "README.md").read_text()
    val = [m for m in read_metrics(new) if m["kind"] == "val"][-1]
    assert f"from the weights of {out}" in card and f"loss {val['val_loss']:.4f}" in card


# -----------------------------------------------------------------------------
# Files that are not ours: never rewritten, replaced, moved or read without bound


@pytest.mark.slow
def test_a_folder_that_is_not_a_runs_is_refused_as_run_dir_nothing_moved(tmp_path, capsys):
    # a new run moves aside only the logs of a run of ours that never saved (its config.json
    # has its run_id and job); an export folder (a model), a user's config.json, logs with no
    # config.json: one line, exit 2, every file where and as it was (issue 58)
    folders = {
        "export": {"model.safetensors": b"", "config.json": b'{"format": "train_gpt"}'},
        "users": {"config.json": b'{"lr": 1}', "notes.txt": b"mine"},
        "logs_only": {"train.log": b"my log"},
        "not_json": {"config.json": b"{not json", "metrics.jsonl": b"{}"},
    }
    for name, files in folders.items():
        folder = tmp_path / name
        folder.mkdir()
        for file, data in files.items():
            (folder / file).write_bytes(data)
        code, out, err = run_main(TINY_RUN + [f"--run_dir={folder}"], capsys)
        assert code == 2 and err.count("\n") == 1 and "nothing was moved" in err, (name, err)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files, name
    model = Path(authors_copy(tmp_path, "model"))  # a run from a model, into its own folder
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    code, _, err = run_main(
        [f"--init_from={model}", f"--run_dir={model}", *TRAIN_ON_SAMPLE], capsys
    )
    assert code == 2 and "holds a model (model.safetensors), not a run" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


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
        make(out / support.OUTPUTS)
        before = sorted(os.listdir(out))
        code = support.cli(bench.main, [f"--out={out}"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (what, err)
        assert "is not a record this project wrote" in err, (what, err)
        assert sorted(os.listdir(out)) == before, what
    assert json.loads((tmp_path / "mine.json").read_text()) == {"bench.md": "0" * 64}


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
    kept = runs.kept_metrics(str(tmp_path / "m.jsonl"), 10, 10).decode().splitlines()
    assert kept[-1] == "[" * 100000  # a user's line too deep to parse: kept, no traceback
    assert [json.loads(line) for line in kept[:-1]] == ours[:2] + users[:2] + [ours[2]] + users[2:]


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


def test_the_put_back_takes_only_an_older_checkpoint_of_the_same_run(tmp_path):
    d = runs.Dist(device="cpu")
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
        support.STOP.untried, support.STOP.last_ckpt = True, "the newest"
        said = runs.last_good(d, str(run), "aa")
        step = torch.load(run / runs.CHECKPOINT, weights_only=True)["step"]
        if put_back:
            assert step == 5 and not (run / runs.PREVIOUS).exists() and "(step 5, put back" in said
        else:
            assert step == 10 and os.path.lexists(run / runs.PREVIOUS), prev
            assert said.startswith("none: no step from the newest, the newest, had a finite")
    support.STOP.untried, support.STOP.last_ckpt = True, None


@pytest.mark.slow
def test_counts_have_bounds_and_messages_name_what_the_user_has(tmp_path):
    (tmp_path / "a.txt").write_text("thirty short lines\n" * 30)
    r = run_data_script(  # a worker per CPU at most: never thousands of processes
        "tokenize_corpus.py",
        [str(tmp_path / "a.txt"), f"--out={tmp_path / 's'}", "--workers=100000"],
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--workers" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()
    sweep = load_command("sweep.py")  # an empty range of seeds: refused, no folder made
    argv = ["--seeds=2", "--first_seed=2", f"--runs={tmp_path / 'r'}", f"--out={tmp_path / 'o'}"]
    assert support.cli(sweep.main, argv) == 2
    assert not (tmp_path / "r").exists() and not (tmp_path / "o").exists()
    # debian_docs.py names its own options (it has --out, no --name)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "docs_train_000001.bin").write_bytes(b"a user's file")
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'd'}", "--unpinned"])
    assert r.returncode == 2 and "choose another --out; nothing" in r.stderr, r.stderr
    assert "--name" not in r.stderr and r.stderr.count("\n") == 1
    # a symbolic link is called one
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    assert support.kind_of(str(tmp_path / "link")) == "a symbolic link to a file"
    # an error writing a file names it, never the temporary file beside it (deleted by then)
    (tmp_path / "target").mkdir()
    with pytest.raises(OSError) as e:
        support.write_atomically(str(tmp_path / "target"), b"data")
    assert e.value.filename == str(tmp_path / "target") and ".tmp" not in str(e.value)
    assert not glob.glob(str(tmp_path / "target.*.tmp"))
    # a named pipe where debian_docs.py's manifest would be: refused at once, never opened
    (tmp_path / "p").mkdir()
    os.mkfifo(tmp_path / "p" / "docs.manifest.json")
    r = run_data_script("debian_docs.py", [f"--out={tmp_path / 'p'}", "--unpinned"])
    assert r.returncode == 2 and "docs.manifest.json is the manifest" in r.stderr, r.stderr
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "config.json").write_text("[" * 100000)
    assert runs.logged(str(tmp_path / "deep")) is None  # too deep: no run_id, no traceback


@pytest.mark.slow
def test_what_a_command_did_not_write_stays_as_it_is(tmp_path, capsys):
    # a resume leaves a checkpoint.prev.pt that is not an earlier one of its run where it is
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('\ufeff{"run_id": "aa"}')  # (a BOM, as an editor saves it)
    ckpt = {"run_id": "aa", "step": 10}
    torch.save(ckpt, run / runs.CHECKPOINT)
    runs.check_owner(str(run), ckpt)  # none there: fine
    for prev, fine in (({"run_id": "aa", "step": 4}, True), ({"run_id": "bb", "step": 4}, False)):
        torch.save(prev, run / runs.PREVIOUS)
        if fine:
            runs.check_owner(str(run), ckpt)
        else:
            with pytest.raises(support.UserError, match="not an earlier checkpoint of this run"):
                runs.check_owner(str(run), ckpt)
    (run / runs.PREVIOUS).write_text("my notes")
    with pytest.raises(support.UserError, match="not an earlier checkpoint of this run"):
        runs.check_owner(str(run), ckpt)
    # a linked checkpoint is not the run's own file: a resume refuses it
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / runs.CHECKPOINT).symlink_to(run / runs.CHECKPOINT)
    with pytest.raises(support.UserError, match="checkpoint.pt is a symbolic link to a file"):
        runs.open_run_dir(str(tmp_path / "new"), "x", {**ckpt, "mtime": 0})
    # export.py reads a run's logs only as files (a named pipe would block it)
    os.mkfifo(tmp_path / "fifo_run_metrics")
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "metrics.jsonl").symlink_to(tmp_path / "fifo_run_metrics")
    assert load_command("export.py").last_validation(str(tmp_path / "r2"), 0) == {}
    # skipview.py --out never replaces a user's file of that name
    skipview = load_command("skipview.py")
    (tmp_path / "notes.html").write_text("mine")
    argv = [f"--init_from={AUTHORS_TINY}", "--text=a few words", f"--out={tmp_path}/notes.html"]
    assert support.cli(skipview.main, argv) == 2
    assert "did not write it" in capsys.readouterr().err
    assert (tmp_path / "notes.html").read_text() == "mine"
    # a runs.csv saved with a BOM (as a spreadsheet does) is read as it is
    csv_path = sorted(glob.glob(os.path.join(HERE, "records", "*", "runs.csv")))[-1]
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "runs.csv").write_bytes(b"\xef\xbb\xbf" + Path(csv_path).read_bytes())
    sweep = load_command("sweep.py")
    assert support.cli(sweep.main, [f"--report={tmp_path / 'report' / 'runs.csv'}"]) == 0
    capsys.readouterr()
    # a runs.csv cut short, or too large to be one, is refused naming what is wrong (issue 58)
    whole = Path(csv_path).read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[0]  # (without its last row)
    for i, (data, message) in enumerate(
        [
            (whole[:-40], "its last row is not ended: the file was cut short"),
            (last + b"\n" + b"dense,1,2\n", "not as many fields as the header: cut short?"),
            (None, "over 64 MiB: not a runs.csv of sweep.py"),
        ]
    ):
        (tmp_path / f"cut{i}").mkdir()
        path = tmp_path / f"cut{i}" / "runs.csv"
        if data is None:  # sparse: no disk used
            with open(path, "wb") as f:
                f.truncate(65 << 20)
        else:
            path.write_bytes(data)
        assert support.cli(sweep.main, [f"--report={path}"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert os.listdir(path.parent) == ["runs.csv"]


# -----------------------------------------------------------------------------
# The paper's values where they are used, not only where they are declared


@pytest.mark.slow
def test_the_optimiser_reads_its_settings_where_built_and_where_a_resume_reapplies_them(
    tmp_path, capsys, monkeypatch
):
    hp = tiny(beta1=0.7, beta2=0.9, adam_eps=1e-8, weight_decay=0.01, lr=2e-3)
    groups = tg.optimizer(tg.GPT(hp), hp).param_groups
    assert len(groups) == 1 + hp.n_layers  # the rest, then one per block (DLO scales them)
    for g in groups:
        assert (g["betas"], g["eps"], g["weight_decay"], g["lr"]) == ((0.7, 0.9), 1e-8, 0.01, 2e-3)
    seen, real = [], tg.train_step

    def spy(model, router, hp, opt, loader, d, autocast, accum, lrs, step):
        out = real(model, router, hp, opt, loader, d, autocast, accum, lrs, step)
        keys = ("betas", "eps", "weight_decay", "lr")
        seen.append((hp, step, [tuple(g[k] for k in keys) for g in opt.param_groups]))
        return out

    monkeypatch.setattr(tg, "train_step", spy)
    first = ["--beta1=0.7", "--beta2=0.9", "--adam_eps=1e-8", "--weight_decay=0.01"]
    code, _, err = run_main(RESUME_RUN + first + [f"--run_dir={tmp_path}", "--stop_step=2"], capsys)
    assert code == 0, err
    # the resumed job's own values, not the checkpoint's (its optimiser state saved them)
    again = ["--beta1=0.6", "--beta2=0.8", "--adam_eps=1e-9", "--weight_decay=0.02"]
    code, _, err = run_main([f"--resume={tmp_path}", *again], capsys)
    assert code == 0, err
    steps = tg.num_steps(seen[0][0])
    for hp, step, used in seen:
        want = ((0.6, 0.8), 1e-9, 0.02) if step >= 2 else ((0.7, 0.9), 1e-8, 0.01)
        assert {u[:3] for u in used} == {want}, step
        assert {u[3] for u in used} == {tg.lr_at(hp, step, steps)}, step  # router=skip_middle: 1x
    assert [s for _, s, _ in seen] == list(range(steps))


def test_every_norm_of_a_built_model_uses_norm_eps():
    # a small input, where eps matters: each norm against RMSNorm written here, with norm_eps
    for router in tg.ROUTERS:
        hp = tiny(router=router, norm_eps=3e-4, n_layers=8)
        model = tg.GPT(hp)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert len(norms) == 2 + 4 * len(model.blocks), router  # embedding, head; 4 per block
        x = 1e-2 * torch.randn(3, hp.dim, generator=torch.Generator().manual_seed(0))
        for norm in norms:
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
            expect = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 3e-4) * norm.weight
            assert torch.allclose(norm(x), expect, rtol=1e-5, atol=0), router


def test_the_schedule_reads_the_warmup_length_and_start_factor_each_as_itself():
    hp = tiny(lr=2.0, warmup_frac=0.2, warmup_start=0.05)  # different values: neither stands in
    total = 100  # warm-up: 20 steps from 0.05 lr, then cosine over the other 80 to 0
    expect = {
        0: 2.0 * 0.05,
        10: 2.0 * (0.05 + 0.95 * 10 / 20),
        19: 2.0 * (0.05 + 0.95 * 19 / 20),
        20: 2.0,
        60: 2.0 * 0.5 * (1 + math.cos(math.pi * 40 / 80)),
        100: 0.0,
    }
    for step, lr in expect.items():
        assert tg.lr_at(hp, step, total) == pytest.approx(lr, abs=1e-12), step


def test_the_frontier_holds_exactly_its_slack_beyond_the_dense_range():
    sweep = load_command("sweep.py")
    at = sweep.frontier([(1e6, 4.0), (4e6, 3.0)])
    inside, outside = 0.0099, 0.0101  # in log FLOPs, either side of 1%: a gated model's gate
    # linears beyond the end dense point, not an extrapolation
    assert at(4e6 * math.exp(inside)) == 3.0 and at(1e6 * math.exp(-inside)) == 4.0
    assert at(4e6 * math.exp(outside)) is None and at(1e6 * math.exp(-outside)) is None


def test_the_controller_targets_are_section_3s():
    # mean targets linear from mu*_0 to mu*_{L/2} over the first half (mirrored), variance
    # targets the Bernoulli mu*(1 - mu*); mu_end's default is our point on Figure 2's sweep
    assert tg.Hyperparameters().mu_start == 1.0 and tg.Hyperparameters().mu_end == 0.5
    hp = tiny(n_layers=8, mu_start=0.9, mu_end=0.3)
    controller = tg.GPT(hp).router.ctrl
    half = [0.9, 0.7, 0.5, 0.3]
    assert controller.mu.tolist() == pytest.approx(half + half[::-1])
    assert controller.var.tolist() == pytest.approx([m * (1 - m) for m in half + half[::-1]])
