"""Tests of the paper's path in train_gpt.py: the model and its skip-middle gates, the gate
controller, the compacted path, the loader, FLOPs and the training loop end to end. CPU only.

The rest of the suite is under tests/, by module; conftest.py holds what the files share.
`python -m pytest -q` runs all of it (pyproject.toml's testpaths), `-m "not slow"` the quick part.

Each test checks a property against a reference written here: a plain softmax attention,
hand-computed controller steps, FlopCounterMode, shards written by the test, a one-process
run against a two-process one.
"""

import contextlib
import copy
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ranks
import routers
import runlog
import runs
import sources
import support
import train_gpt as tg
from conftest import (
    REPO,
    RESUME_RUN,
    TINY_RUN,
    CountedOps,
    assert_close_rel,
    compact_matches_masked,
    counted_flops,
    documents_by_hand,
    grads,
    logits_gates,
    math_sdpa,
    read_metrics,
    run_command,
    run_main,
    sha256,
    spread_gates,
    steered_model,
    tiny,
    write_shard,
)

# -------------------------------------------------- attention with ln g on each key


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


def random_qkv_logg(B=2, H=4, Hkv=2, T=24, hd=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, hd, generator=gen) for h in (H, Hkv, Hkv))
    g = torch.rand(B, T, generator=gen)
    g[:, ::5] = 0.0  # some fully gated keys
    g[:, 1::7] = 1.0
    return q, k, v, torch.log(g.clamp(min=1e-6))


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


def test_gated_sdpa_on_bf16_rounds_once():
    # bf16 q, k, v (autocast's): the scores, ln g and the softmax in fp32, then one rounding to
    # bf16: the output is the exact (float64) gated attention of those inputs, rounded (in bf16,
    # ln g and the scores would be rounded too: 15% of the outputs another bf16 value)
    q, k, v, log_g = random_qkv_logg(hd=16, seed=4)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    out = tg.gated_attention(q, k, v, log_g)
    exact = reference_attention(q.double(), k.double(), v.double(), log_g.double())
    assert out.dtype == torch.bfloat16
    assert (out == exact.bfloat16()).float().mean() > 0.99


def test_sdpa_and_flex_paths_agree():
    q, k, v, log_g = random_qkv_logg(T=40, seed=3)
    a = tg.gated_attention(q, k, v, log_g, None)
    b = tg.gated_attention(q, k, v, log_g, flex_or_sdpa("flex", q))
    assert (a - b).abs().max().item() < 1e-5


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


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_query_axis_gate_is_cancelled_by_softmax(impl):
    # the authors' released indexing: ln g_i on every logit of query row i, a constant per row
    q, k, v, log_g = random_qkv_logg(seed=4)
    ungated = reference_attention(q, k, v, None)
    on_query = tg.gated_attention(q, k, v, log_g, flex_or_sdpa(impl, q), axis="query")
    on_key = tg.gated_attention(q, k, v, log_g, flex_or_sdpa(impl, q), axis="key")
    assert (on_query - ungated).abs().max().item() < 1e-5
    assert (on_key - ungated).abs().max().item() > 1e-2


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


# --------------------------------------------------------------------- gated blocks


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
    g.requires_grad_()
    a, B, T = block.attn, 2, 12
    h = block.attn_in(x)
    q, k, v = (w(h).view(B, T, -1, a.head_dim).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
    log_g = torch.log(torch.maximum(g[..., 0], torch.tensor(hp.gate_eps)))
    y = reference_attention(a.rotary(q), a.rotary(k), v, log_g).transpose(1, 2).reshape(B, T, -1)
    mid = x + g * block.attn_out(a.wo(y))
    expected = mid + g * block.ffn_out(block.ffn(block.ffn_in(mid)))
    out = block(x, g, None)
    assert (out - expected).abs().max().item() < 1e-5
    # and what the gates learn from: both residual branches and ln g on each key's logit
    w = torch.randn_like(out)
    (got,), (want,) = (torch.autograd.grad((y * w).sum(), g) for y in (out, expected))
    assert_close_rel(got, want, 1e-4)


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


# ---------------------------------------------- the model and its skip-middle gates


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


def test_mirrored_blocks_share_a_gate():
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


def test_gate_parameters_receive_nonzero_gradient_inside_the_open_interval():
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


def test_zero_initialised_gates_are_not_stuck(monkeypatch):
    # deviation in the docstring: relu'(0) = 0 would leave zero-initialised gates at 1 forever.
    # The controller's own loss, (1/L) sum_l alpha mean(g_l) (sparsity: alpha = fixed_coef):
    # gate 0's bias moves g_0..g_3 (S_0 and S_1, mirrored), gate 1's g_1 and g_2, each by -1.
    # On every torch: clamp (clip, clamp_min, clamp_max) as torch 2.15 has it, gradient 0 at a
    # bound (a plain one in eq. 1 or 2 would then leave the gates stuck here too, not on 2.15)
    real = torch.Tensor.clamp

    def clamp_as_in_2_15(x, min=None, max=None):
        inside = torch.ones_like(x, dtype=torch.bool)
        inside &= True if min is None else x > min
        inside &= True if max is None else x < max
        return torch.where(inside, x, real(x.detach(), min, max))

    forms = {
        "clamp": clamp_as_in_2_15,
        "clip": clamp_as_in_2_15,
        "clamp_min": lambda x, min: clamp_as_in_2_15(x, min),
        "clamp_max": lambda x, max: clamp_as_in_2_15(x, None, max),
    }
    for name, form in forms.items():
        monkeypatch.setattr(torch, name, form)
        monkeypatch.setattr(torch.Tensor, name, form)
    torch.manual_seed(0)
    model = tg.GPT(tiny(gate_init="zero", controller="sparsity", fixed_coef=0.1))
    route = model(torch.randint(0, 97, (2, 16))).route
    assert torch.equal(route["gates"], torch.ones_like(route["gates"]))
    model.router.loss(route, 0)[0].backward()
    biases = [gate.bias.grad.item() for gate in model.router.gates]
    assert biases == pytest.approx([-0.1 * 4 / 4, -0.1 * 2 / 4])


def test_the_gated_model_matches_sections_2_1_to_2_3_written_out_with_every_gradient():
    # the model around the block (checked above): the embedding, its norm; the gate of block
    # l < L/2 reads the stream entering block l (eq. 1), S sums the s_k, g = 1 - clamp(S) (eq.
    # 2); block L-1-l reuses g_l; the head's norm and head. Logits and every parameter's
    # gradient (through the gates into the stream, the embedding's too) as autograd gives them
    hp = tiny(n_layers=6)
    model = tg.GPT(hp)
    spread_gates(model, std=0.4, bias=0.05)
    idx = torch.randint(
        0, hp.vocab_size, (3, hp.seq_len), generator=torch.Generator().manual_seed(2)
    )
    weights = torch.randn(3, hp.seq_len, hp.vocab_size, generator=torch.Generator().manual_seed(3))

    def by_hand():
        x, S, gates = model.embed_norm(model.embed(idx)), 0.0, []
        for layer, block in enumerate(model.blocks):
            if layer < hp.n_layers // 2:
                gate = model.router.gates[layer]
                S = S + torch.relu(x @ gate.weight[0] + gate.bias[0])  # eq. (1), summed
                gates.append(1 - S.clamp(0, 1))  # eq. (2)
            g = gates[min(layer, hp.n_layers - 1 - layer)]
            x = block(x, g[..., None], None)
        return model.head(model.head_norm(x))

    grads = []
    for forward in (lambda: model(idx).logits, by_hand):
        model.zero_grad()
        logits = forward()
        (logits * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        gates = model(idx).route["gates"]
    assert 0.1 < (gates == 0).float().mean() < 0.9 and ((gates > 0) & (gates < 1)).any()
    assert torch.allclose(model(idx).logits, by_hand(), atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name
    assert grads[0]["router.gates.0.weight"].abs().sum() > 0  # (the gates learn here)


def test_eq1_and_eq2_have_gradient_one_at_their_bounds_on_every_torch():
    # torch 2.15 made clamp's gradient 0 at a bound: with it, zero-initialised gates never move
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0], requires_grad=True)
    y = tg.clamp_keep_grad(x, 0.0, 1.0)
    y.sum().backward()
    assert torch.equal(y, x.detach().clamp(0, 1)) and x.grad.tolist() == [0, 1, 1, 1, 0]
    x.grad = None
    tg.clamp_keep_grad(x, 0.0).sum().backward()  # eq. 1's ReLU
    assert x.grad.tolist() == [0, 1, 1, 1, 1]


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--router=none", "--mu_end=0.5"], "router=none has none"),
        (["--router=none", "--mod_capacity=0.125"], "router=none has none"),
        (["--router=mod", "--gate_axis=key"], "router=mod has none"),
        (["--controller=sparsity", "--gamma=0.001"], "gamma=0.001 has no effect"),
        (["--controller=proportional", "--delta=0.01"], "delta=0.01 has no effect"),
        (["--router=mor", "--mor_routed=false", "--mor_aux_coef=0.1"], "mor_aux_coef=0.1 has no"),
        (["--router=none", "--gate_eps=1e-6"], "with router=none as set: no key is weighted"),
        (["--router=dlo", "--gate_eps=0.5"], "gate_eps=0.5 has no effect with router=dlo"),
        (["--router=mor", "--mor_recursions=1", "--n_layers=3", "--gate_eps=1e-6"], "gate_eps"),
        (["--gate_axis=query", "--gate_eps=1e-6"], "router=skip_middle as set: no key is weighted"),
        (["--warmup_frac=0", "--warmup_start=0.1"], "has no effect with warmup_frac=0"),
    ],
)
def test_a_knob_that_does_nothing_is_refused_even_at_its_default(args, message, tmp_path, capsys):
    # each is given at its default value, where it looks untouched to check_model
    code, _, err = run_main([*args, f"--run_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


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


# --------------------------------------------------------------- the loss in chunks


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


def test_chunked_loss_is_finite_where_exp_of_the_logits_overflows():
    # logits in the hundreds (exp overflows fp32 past 88): each row's largest is taken from its
    # logits before exp, as F.cross_entropy does; the same loss and gradients
    torch.manual_seed(0)
    h = (10 * torch.randn(12, 16)).requires_grad_()
    w = (3 * torch.randn(40, 16)).requires_grad_()
    t = torch.randint(0, 40, (12,))
    assert (h @ w.t()).abs().max() > 300
    reference = F.cross_entropy(h @ w.t(), t, reduction="sum")
    reference.backward()
    expected, h.grad, w.grad = (h.grad, w.grad), None, None
    loss = tg.LinearCrossEntropy.apply(h, w, t, 5, True)
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert_close_rel(h.grad, expected[0], 1e-5)
    assert_close_rel(w.grad, expected[1], 1e-5)


def test_chunked_loss_under_bf16_autocast_casts_each_softmax_gradient_once():
    # under autocast the products run in bf16: each chunk's softmax gradient is cast to it once,
    # for both products (grad_w's takes it transposed, with no second, transposing cast); grad_w
    # sums the chunks' bf16 products in fp32, as its docstring says (counted: a sum in bf16
    # stays within this test's tolerance); loss and gradients within bf16's rounding of fp32's
    torch.manual_seed(0)
    n, rows, vocab, dim = 64, 16, 300, 32
    h = torch.randn(n, dim, requires_grad=True)
    w = (0.1 * torch.randn(vocab, dim)).requires_grad_()
    t = torch.randint(0, vocab, (n,))
    reference = F.cross_entropy(h @ w.t(), t, reduction="sum")  # fp32
    reference.backward()
    expected, h.grad, w.grad = (h.grad, w.grad), None, None

    def softmax_cast(func, args, kwargs):  # a (rows, vocab) tensor cast to bf16, either layout
        cast = func.overloadpacket is torch.ops.aten._to_copy
        return cast and kwargs.get("dtype") == torch.bfloat16 and args[0].numel() == rows * vocab

    def chunk_sum(dtype):  # an add of a (vocab, dim) tensor of dtype: grad_w's running sum
        def which(func, args, kwargs):
            shapes = {(a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor)}
            adds = (torch.ops.aten.add, torch.ops.aten.add_)
            return func.overloadpacket in adds and ((vocab, dim), dtype) in shapes

        return which

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        CountedOps(softmax_cast) as casts,
        CountedOps(chunk_sum(torch.float32)) as fp32_sums,
        CountedOps(chunk_sum(torch.bfloat16)) as bf16_sums,
    ):
        loss = tg.LinearCrossEntropy.apply(h, w, t, rows, True)
    loss.backward()
    assert casts.n == n // rows and (fp32_sums.n, bf16_sums.n) == (n // rows, 0)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-2)
    assert_close_rel(h.grad, expected[0], 3e-2)
    assert_close_rel(w.grad, expected[1], 3e-2)


# ------------------------------------------------------------------ gate controller


def controller(kind, **kw):
    hp = tiny(
        controller=kind, mu_start=1.0, mu_end=0.5, gamma=0.1, delta=0.05, fixed_coef=0.3, **kw
    )
    return tg.GateController(hp)


def test_mean_and_variance_targets():
    c = controller("proportional_tol", n_layers=6)
    assert c.mu.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.5, 0.75, 1.0])
    assert c.var.tolist() == pytest.approx([0.0, 0.1875, 0.25, 0.25, 0.1875, 0.0])


def test_the_controller_targets_are_section_3s():
    # mean targets linear from mu*_0 to mu*_{L/2} over the first half (mirrored), variance
    # targets the Bernoulli mu*(1 - mu*); mu_end's default is our point on Figure 2's sweep
    assert tg.Hyperparameters().mu_start == 1.0 and tg.Hyperparameters().mu_end == 0.5
    hp = tiny(n_layers=8, mu_start=0.9, mu_end=0.3)
    controller = tg.GPT(hp).router.ctrl
    half = [0.9, 0.7, 0.5, 0.3]
    assert controller.mu.tolist() == pytest.approx(half + half[::-1])
    assert controller.var.tolist() == pytest.approx([m * (1 - m) for m in half + half[::-1]])


@pytest.mark.parametrize("kind", list(tg.CONTROLLERS))
def test_the_share_of_zero_gates_aimed_at_is_one_minus_each_mean_target(kind):
    # (sweep.py's target_zero) a controller that reads mu aims each layer's zero gates at
    # 1 - mu*_l; one that does not aims at none
    mu = dict(mu_start=0.9, mu_end=0.3) if "mu_start" in tg.CONTROLLERS[kind] else {}
    targets = tg.GPT(tiny(n_layers=8, controller=kind, **mu)).router.zero_targets()
    half = [0.1, 0.3, 0.5, 0.7]
    aims = kind in ("proportional_tol", "proportional", "adaptive", "sparsity_variance_l2")
    assert targets == (pytest.approx(half + half[::-1]) if aims else [None] * 8)


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
    c = controller("proportional_tol")  # a deviation of exactly delta (exact in binary): none
    c.delta = 0.25
    c.update(torch.tensor([1.0, 0.75, 0.5, 1.0]), torch.tensor([0.0, 0.25, 0.75, 0.0]))
    assert c.alpha.tolist() == [0.0] * 4  # deviations 0, 0.25 = delta, 0, 0: none past it
    assert c.beta.tolist() == [0.0, 0.0, 0.1 * 0.5, 0.0]  # deviation 0.5 at block 2: gamma dev
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
    c = controller("sparsity_variance")  # beta = -fixed_coef: the variance rewarded
    assert c.loss(gates).item() == pytest.approx(0.3 * (3 - 0.25) / 4)
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


# ---------------------------------------- compacted path: the skipped work not done


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
        y = block(xi, gi, None, compact=compact, length=given)
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
        y2 = block(x, g, None, compact=True, length=given - 1)
        assert not torch.allclose(y2, y1, atol=1e-3)


def test_a_compacted_blocks_key_weights_get_a_gradient_only_where_they_learn(monkeypatch):
    # skip-middle's keys are its gate, which learns through ln g as a key weight; MoD's and
    # MoR's are their choices, with no gradient: the packed region is told which, and key
    # weights told not to learn get none (not one computed for nothing and dropped)
    hp = tiny(dim=48, n_heads=4, n_kv_heads=2, max_seq_len=24, seq_len=24)
    torch.manual_seed(0)
    block, x, g = tg.Block(hp), torch.randn(4, 24, hp.dim), mixed_gates(4, 24)
    told, real = [], tg.Block.packed
    monkeypatch.setattr(tg.Block, "packed", lambda self, *a: told.append(a[-1]) or real(self, *a))
    gate, chosen = g.clone().requires_grad_(), (g > 0).float()
    block(x, gate, None, compact=True, length=16)  # skip-middle: keys=None, the gate
    block(x, gate * chosen, None, compact=True, keys=chosen, length=16)  # MoD
    block(x, chosen, None, compact=True, keys=chosen, length=16)  # MoR: g and keys its choice
    assert told == [True, False, False]
    gk = torch.cat((gate, gate), dim=-1).detach().requires_grad_()
    for learns in (True, False):
        gk.grad = None
        real(block, x, gk, None, 16, learns).square().sum().backward()
        assert (gk.grad[..., 1] != 0).any() == learns and (gk.grad[..., 0] != 0).any()


def test_compact_model_matches_masked_logits_and_gradients():
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


@pytest.mark.parametrize("given", [None, "fit", "full"])
def test_compact_model_packed_to_given_lengths_matches_masked(given):
    # the gated model at the paper's routing, with a row where every token skips and one where
    # none does: packed lengths read on the host, given as the exact fit, or the whole sequence
    hp = tiny(n_layers=6, dim=48, max_seq_len=32, seq_len=32)
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    idx[0] = 5  # every token skips the middle
    if given != "fit":
        idx[1] = 7  # none does: its blocks pack the whole sequence
    m2, out, counts = compact_matches_masked(steered_model(hp), idx, given, evaluate=False)
    (o0, _), (o1, _) = out  # (their logits and gradients: compact_matches_masked)
    lengths, b0, b1 = counts[0][True], o0.route["block"], o1.route["block"]
    assert not b0[1:5, 0].any() and 0 < b0[1:5, 2:].float().mean() < 1
    assert b0[:, 1].all() if given != "fit" else 0 < max(lengths[1:5]) < 32
    assert torch.equal(b0, b1)
    if given == "fit":  # the lengths are what packs: a token fewer at one block changes logits
        m2.router.lengths = [*lengths[:2], lengths[2] - 1, *lengths[3:]]
        assert (m2(idx).logits - o0.logits).abs().max().item() > 1e-3


def test_a_compacted_block_packed_to_every_position_runs_as_masked():
    # packed to every position, a block would do all the work and pay for the packing too: it
    # runs as masked, to the bit, with no scatter back (given lengths, and in evaluation where
    # a block's count rounds up to T); a length short of T still packs and scatters
    hp = tiny(n_layers=6, dim=48, max_seq_len=32, seq_len=32)
    masked = steered_model(hp)
    twin = tg.GPT(replace(hp, compact=True))
    twin.load_state_dict(masked.state_dict())
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    idx[1] = 7  # no token skips: every block's count is T
    for train, lengths in ((True, [32] * 6), (False, None), (True, [32, 32, 16, 32, 32, 32])):
        expected = masked.train(train)(idx).logits
        twin.train(train).router.lengths = lengths
        with CountedOps(lambda func, *_: func.overloadpacket is torch.ops.aten.scatter) as scatters:
            logits = twin(idx).logits
        assert scatters.n == (lengths is not None and min(lengths) < 32)
        assert torch.equal(logits, expected) == (scatters.n == 0)


def test_packed_lengths_hold_the_most_of_the_last_steps_in_sixteenths():
    # per block the most of the steps seen, rounded up to a multiple of T / 16, at least one
    # such unit (a block no token ran still runs a padding token), at most T
    seen = [[0, 5, 31, 32, 4], [0, 9, 16, 3, 4]]  # T = 32: units of 2
    assert routers.packed_lengths(seen, 32) == [2, 10, 32, 32, 4]
    assert routers.packed_lengths([[17, 64, 65, 1024]], 1024) == [64, 64, 128, 1024]
    # a router's lengths come from the counts of its last PACK_STEPS steps: one step's count
    # holds for 16 steps after it, then drops out
    router = tg.ROUTERS["skip_middle"](tiny(n_layers=2, seq_len=32, max_seq_len=32))
    router.lengths = [32, 32]
    held = []
    for step in range(routers.PACK_STEPS + 1):
        router.saw([30, 3] if step == 0 else [1, 3])
        held.append(router.lengths)
    assert held == [[30, 4]] * routers.PACK_STEPS + [[2, 4]]
    assert len(router.seen) == routers.PACK_STEPS
    # a step outgrew them where a count exceeds its length; one that fills it fits
    assert not router.outgrew([2, 4]) and router.outgrew([3, 4]) and router.outgrew([2, 5])
    # a resume restores them, but not those saved at another seq_len (they count other sequences'
    # tokens): then it packs every token, as a new run's first step
    saved = {"hp": {"seq_len": 16}, "packing": {"lengths": [8, 4], "seen": [[7, 3]]}}
    router.lengths = [32, 32]
    router.restore_packing(saved, "checkpoint.pt")
    assert router.lengths == [32, 32]
    saved = {"hp": {"seq_len": 32}, "packing": {"lengths": [8, 4], "seen": [[7, 3]]}}
    router.restore_packing(saved, "checkpoint.pt")
    assert router.lengths == [8, 4] and router.seen == [[7, 3]]


@pytest.mark.parametrize("short", ["every", "first"])
def test_a_step_that_outgrows_its_packed_lengths_is_redone_at_full_length(short):
    # lengths too short for this batch (its two micro-batches, or only the first: the second's
    # own counts fit): train_step sees the counts exceed them (in its one host read), redoes the
    # step at full length and applies the masked model's update; without the redo the packed
    # step would be another. The next lengths come from the step's counts
    hp = tiny(n_layers=4, dim=48, max_seq_len=32, seq_len=32, vocab_size=50257, batch_size=4)
    hp = replace(hp, device_batch_size=2)
    masked, model = steered_model(hp), tg.GPT(replace(hp, compact=True))
    model.load_state_dict(masked.state_dict())
    shards = f"{REPO}/data/sample/sample_train_*.bin"
    tokens = tg.read_shard(tg.find_shards(shards)[0], hp.vocab_size)
    x = torch.tensor(tokens[128:256].astype("int64"))  # the loader's second step (see below)
    first, second = (routers.packed_counts(masked(m).route) for m in x.view(2, 2, 32))
    lengths = [2] * 4 if short == "every" else second.int().tolist()
    assert (first > torch.tensor(lengths)).any() and (short == "every") == bool(
        (second > torch.tensor(lengths)).any()
    )
    cut = tg.GPT(replace(hp, compact=True))
    cut.load_state_dict(masked.state_dict())
    cut.router.lengths = lengths
    assert (cut(x[:64].view(2, 32)).logits - masked(x[:64].view(2, 32)).logits).abs().max() > 1e-3

    after = []
    for m, given in ((masked, None), (model, lengths)):
        m.router.lengths = given
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt = torch.optim.SGD(tg.param_groups(m), lr=1.0)  # the update: minus the gradient
        loader = tg.DistributedLoader(shards, 4, hp.seq_len, 0, 1, hp.vocab_size)
        loader.next_batch()  # (its first step's second micro-batch packs more than its first)
        stats = tg.train_step(
            m,
            m.router,
            hp,
            opt,
            loader,
            ranks.Dist(),
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
        model.router.lengths == routers.packed_lengths([s1["packed"]], 32)
        and s1["packed"] == s0["packed"]
    )
    assert p0.keys() == p1.keys()
    for name in p0:
        assert_close_rel(p1[name], p0[name], 1e-4)


def test_a_step_with_a_non_finite_loss_changes_no_weight_nor_the_optimisers_state(monkeypatch):
    # "applied only if the loss is finite" (train_step): after a good step (AdamW's moments no
    # longer 0), a step whose loss is NaN leaves every weight and the optimiser's state (moments,
    # step counts) as they were, bit for bit, and no gradient behind
    hp = tiny(vocab_size=50257, batch_size=4, device_batch_size=2)
    torch.manual_seed(0)
    model = tg.GPT(hp)
    opt = tg.optimizer(model, hp)
    shards = f"{REPO}/data/sample/sample_train_*.bin"
    loader = tg.DistributedLoader(shards, 4, hp.seq_len, 0, 1, hp.vocab_size)
    lrs, amp = [1e-3] * len(opt.param_groups), contextlib.nullcontext()

    def step():
        return tg.train_step(model, model.router, hp, opt, loader, ranks.Dist(), amp, 2, lrs, 0)

    assert math.isfinite(step()["total_loss"][0])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict()["state"])
    real = tg.LinearCrossEntropy.apply
    monkeypatch.setattr(tg.LinearCrossEntropy, "apply", lambda *a: real(*a) * float("nan"))
    assert math.isnan(step()["total_loss"][0])
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]) and p.grad is None, name
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys() and len(state) == len(weights)
    for i, kept in state.items():
        assert all(torch.equal(after[i][k], t) for k, t in kept.items()), i


def test_a_training_step_moves_each_weight_by_the_gradient_written_here():
    # SGD at lr 1 over 2 micro-batches: each weight moves by minus the gradient of the mean over
    # them of cross-entropy (F.cross_entropy on the logits, not the chunked loss) plus eq. 5's
    # regulariser under the sparsity controller, (1/L) sum_l alpha mean(g_l), alpha = fixed_coef
    hp = tiny(vocab_size=50257, batch_size=4, device_batch_size=2, controller="sparsity")
    hp = replace(hp, fixed_coef=0.1)
    torch.manual_seed(0)
    model = tg.GPT(hp)
    spread_gates(model)
    twin = copy.deepcopy(model)
    shards = f"{REPO}/data/sample/sample_train_*.bin"
    xs, ys = tg.DistributedLoader(shards, 4, hp.seq_len, 0, 1, hp.vocab_size).next_batch()
    total = 0.0
    for x, y in zip(xs.split(2), ys.split(2), strict=True):
        out = twin(x)
        assert 0 < (out.route["gates"] == 0).float().mean() < 1  # gates that skip, and not all
        ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        total = total + (ce + (0.1 * out.route["gates"].mean(dim=(1, 2))).mean()) / 2
    total.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(tg.param_groups(model), lr=1.0)
    loader = tg.DistributedLoader(shards, 4, hp.seq_len, 0, 1, hp.vocab_size)
    lrs, amp = [1.0] * len(opt.param_groups), contextlib.nullcontext()
    stats = tg.train_step(model, model.router, hp, opt, loader, ranks.Dist(), amp, 2, lrs, 0)
    assert stats["total_loss"][0] == pytest.approx(total.item(), rel=1e-5)
    after = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        assert_close_rel(before[name] - after[name].detach(), p.grad, 1e-3)


# --------------------------------------------------------------------------- loader


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


def test_loader_passes_over_a_shard_shorter_than_one_global_batch(tmp_path):
    # one global batch: 2 sequences of 4 (+1). The first shard (3 tokens: a corpus's last
    # shard, sorted first, say) and shard 2 (8) hold none: never read, not even to start, in the
    # first pass or the next (the pass counted where the last shard ends it); a shard's tail
    # short of a batch is left, as ever, and a shard of k batches and the one token more that
    # the last target needs gives all k; one of exactly 2 batches (16) gives 1, then the next
    sizes = [3, 17, 8, 12, 16]
    start = np.cumsum([0] + sizes)
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"d_{i}.bin", np.arange(start[i], start[i] + n))
    loader = tg.DistributedLoader(str(tmp_path / "d_*.bin"), 2, 4, 0, 1)
    assert (loader.state()["shard"], sorted(loader.read)) == (1, [1])
    firsts, laps = [], []
    for _ in range(8):
        firsts.append(loader.next_batch()[0][0, 0].item())
        laps.append(loader.laps)
    # shard 1: tokens 3..19, 2 batches (3, 11); shard 3: 28..39, 1 batch (28); shard 4: 40..55,
    # 1 batch (40); then round again
    assert firsts == [3, 11, 28, 40, 3, 11, 28, 40] and laps == [0, 0, 0, 1, 1, 1, 1, 2]
    assert sum(loader.batches) == 4  # global batches in one pass
    assert sorted(loader.read) == [1, 3, 4]
    assert loader.fingerprints(3)["read"] == [
        [1, *tg.shard_fingerprint(loader.files[1])],
        [3, *tg.shard_fingerprint(loader.files[3])],
    ]
    with pytest.raises(
        tg.UserError,
        match=r"no shard that \S+ matches holds one batch over the ranks \(ranks x sequences "
        r"x length \+ 1 = 1 x 2 x 4 \+ 1 = 9 ",
    ):
        tg.DistributedLoader(str(tmp_path / "d_[02].bin"), 2, 4, 0, 1)


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
    # a name with [ ] in it, matching nothing as a glob: the file it names
    write_shard(tmp_path / "d[1].bin", range(100))
    assert tg.find_shards(str(tmp_path / "d[1].bin")) == [str(tmp_path / "d[1].bin")]
    (tmp_path / "e[1].bin").mkdir()  # (said so, as a folder the glob matches is)
    with pytest.raises(tg.UserError, match=r"e\[1\]\.bin, which is a folder, not a shard"):
        tg.find_shards(str(tmp_path / "e[1].bin"))


def test_validation_takes_what_its_shards_hold_no_token_twice_and_of_its_own_encoding(tmp_path):
    # batches of 2 x 16 (+1): a shard of 3 x 32 + 1 tokens holds 3, all that val_tokens may ask
    # (a fourth would repeat tokens); a gpt2 model refuses byte validation shards, as it does
    # training shards (ids below 256 would all pass its vocabulary check)
    write_shard(tmp_path / "v_0.bin", np.arange(97))
    hp = tiny(val_files=str(tmp_path / "v_*.bin"), device_batch_size=2, seq_len=16)
    loader = tg.validation_loader(replace(hp, val_tokens=3 * 32), ranks.Dist())
    assert sum(loader.batches) == 3
    said = r"val_tokens=128 is more .* whole batches of 2 x 16 x 1 = 32 tokens \(96\); valid"
    with pytest.raises(tg.UserError, match=said):
        tg.validation_loader(replace(hp, val_tokens=4 * 32), ranks.Dist())
    write_shard(tmp_path / "b_0.bin", np.arange(97), encoding=1)
    with pytest.raises(tg.UserError, match="b_0.bin holds bytes tokens, but encoding=gpt2"):
        tg.validation_loader(replace(hp, val_files=str(tmp_path / "b_*.bin")), ranks.Dist())


def test_embedded_sample_is_valid():
    for name in ("sample_train_000001.bin", "sample_val_000000.bin"):
        tokens = tg.read_shard(os.path.join(REPO, "data", "sample", name))
        assert len(tokens) > 5000 and tokens.max() <= 50256 and tokens[0] == 50256


# -------------------------------------------------------------------- FLOPs and MFU


@pytest.mark.parametrize("router, seq_len", [("none", 64), ("none", 256), ("skip_middle", 64)])
def test_flops_per_token_match_flop_counter_at_the_trained_length(monkeypatch, router, seq_len):
    # every token run (gated: as masked runs them, its gate linears' matmuls too)
    hp = tiny(router=router, vocab_size=1000, dim=128, n_layers=2, max_seq_len=256, seq_len=seq_len)
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    reference = counted_flops(tg.GPT(hp), 1, seq_len)
    assert tg.forward_flops(hp) == pytest.approx(reference, rel=1e-9)  # (every matmul, exactly)


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
    # the pairs among the active tokens alone (evaluate's, route_sums) are not those it ran
    pairs = [T * (T + 1) / 2 * a * a for a in active]
    assert tg.forward_flops(query, active, pairs=pairs) == tg.forward_flops(query, active)


def test_sparse_flops_scale_with_active_fraction():
    hp = tiny(n_layers=4)
    full = tg.forward_flops(hp, [1, 1, 1, 1])
    assert full == tg.forward_flops(hp)
    # one block per sequence of 16, by hand: per token q and o 2 x 2 x 32 x 32, k and v
    # 2 x 2 x 32 x 16, the SwiGLU 2 x 3 x 32 x 128; 2 x 2 x 4 heads x 8 per causal pair
    proj, ffn, attn = 16 * (4096 + 2048), 16 * 24576, 128 * 16 * 17 / 2
    assert full - tg.forward_flops(hp, [1, 0, 0, 1]) == 2 * (proj + ffn + attn)
    # a share a of the tokens: a of the projections and FFN, a^2 of the pairs (one sequence)
    half = 2 * (proj + ffn + attn) / 2 + 2 * attn / 4
    assert full - tg.forward_flops(hp, [1, 0.5, 0.5, 1]) == pytest.approx(half)
    assert full - tg.forward_flops(hp, None, [1, 0, 0, 1]) == 2 * ffn  # the MLPs alone
    dense = tg.forward_flops(replace(hp, router="none"))
    assert full - dense == 2 * 16 * 2 * 32  # only the two gate linears' matmuls differ


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
    assert tg.mfu(hp, step_s, 1, 1e12) == pytest.approx(step_flops / step_s / 1e12, rel=1e-9)
    assert tg.mfu(hp, step_s, 2, 1e12) == pytest.approx(tg.mfu(hp, step_s, 1, 1e12) / 2)
    # a step's sums (train_step): each sequence ran half of its tokens through each block
    n, pairs = 3 * 64, 32 * 33 / 2
    stats = {"tokens": [n], "block_active": [n / 2] * 2, "attn_pairs": [3 * pairs] * 2}
    gated = replace(hp, router="skip_middle", compact=True)
    sparse = tg.mfu(gated, step_s, 1, 1e12, stats)  # compact: only the work executed counts
    executed = tg.forward_flops(gated, [0.5, 0.5], pairs=[pairs] * 2)
    assert sparse == pytest.approx(3 * executed * 3 / step_s / 1e12)
    assert sparse < 0.7 * tg.mfu(hp, step_s, 1, 1e12)
    masked = replace(gated, compact=False)  # every token's work runs: the shares do not count
    assert tg.mfu(masked, step_s, 1, 1e12, stats) == tg.mfu(masked, step_s, 1, 1e12)
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


# ----------------------------------------------------------------------- validation


def test_validation_loss_per_token_its_documents_and_se_by_hand(tmp_path):
    # val_loss is the mean over tokens (per-document sums over their lengths), not a mean of the
    # documents' means; a document runs from a separator (a target) to the next, and a first
    # target that is one leaves no empty document before it; val_se is the delta method's;
    # resid_norm the mean L2 norm over tokens of the stream after each block
    hp = tiny(router="none", vocab_size=256, encoding="bytes", device_batch_size=2, val_tokens=64)
    tokens = np.random.default_rng(0).integers(1, 256, 65)
    tokens[[1, 4, 20, 21, 50]] = tg.BYTES_EOT  # targets 0, 3, 19, 20, 49: one of one token
    write_shard(tmp_path / "v_0.bin", tokens)
    torch.manual_seed(0)
    model = tg.GPT(hp)
    loader = tg.DistributedLoader(str(tmp_path / "v_*.bin"), 2, 16, 0, 1, 256)
    v = tg.evaluate(model, hp, loader, tg.Dist(), contextlib.nullcontext())
    stream = torch.from_numpy(tokens.astype(np.int64))
    x, y = stream[:-1].view(4, 16), stream[1:]
    streams = []
    for block in model.blocks:
        block.register_forward_hook(lambda _, args, out: streams.append(out))
    with torch.no_grad():
        losses = F.cross_entropy(model(x).logits.flatten(0, 1), y, reduction="none")
    assert v["resid_norm"] == pytest.approx([s.norm(dim=-1).mean().item() for s in streams])
    docs, mean, se = documents_by_hand(losses.tolist(), y.tolist(), tg.BYTES_EOT)
    assert [len(d) for d in docs] == [3, 16, 1, 29, 15]
    assert abs(mean - np.mean([sum(d) / len(d) for d in docs])) > 1e-3  # (they differ)
    assert v["val_docs"] == 5
    assert v["val_loss"] == pytest.approx(mean, rel=1e-6)
    assert v["val_se"] == pytest.approx(se, rel=1e-5)


def test_validation_flops_price_the_blocks_and_causal_pairs_each_sequence_ran(
    tmp_path, monkeypatch
):
    # Figure 2's x-axis from the data alone: token 5 skips every gated block and token 7 none
    # (steered_model), so each block ran each sequence's n 7s: their share of the tokens, and
    # n(n+1)/2 causal pairs per sequence (not the mean share squared), priced by forward_flops;
    # the dense figure is a dense model's, as FlopCounterMode counts it; compact validates every
    # token, whatever packed lengths training left (not cut to them), and leaves them as it found;
    # each validation reads the same tokens (the first val_tokens, not those after the last's)
    hp = tiny(device_batch_size=2, val_tokens=64)
    tokens = np.random.default_rng(0).choice([5, 7], 65)
    write_shard(tmp_path / "v_0.bin", tokens)
    write_shard(tmp_path / "v_1.bin", np.full(65, 5))  # (what a validation must not reach)
    loader = tg.DistributedLoader(str(tmp_path / "v_*.bin"), 2, 16, 0, 1, hp.vocab_size)
    v = tg.evaluate(steered_model(hp), hp, loader, tg.Dist(), contextlib.nullcontext())
    assert tg.evaluate(steered_model(hp), hp, loader, tg.Dist(), contextlib.nullcontext()) == v
    n = (tokens[:-1].reshape(4, 16) == 7).sum(axis=1)  # (sequences,)
    assert len(set(n.tolist())) > 1  # (sequences that differ: the pairs are not the share's)
    share, pairs = n.sum() / 64, (n * (n + 1) / 2).mean()
    assert v["block_active"] == pytest.approx([share] * hp.n_layers, abs=1e-12)
    want = tg.forward_flops(hp, [share] * hp.n_layers, pairs=[pairs] * hp.n_layers)
    assert v["fwd_flops_per_token"] == pytest.approx(want / hp.seq_len, rel=1e-12)
    assert v["fwd_flops_per_seq"] == pytest.approx(want, rel=1e-12)
    assert v["fwd_flops_per_token"] < 0.9 * v["fwd_flops_per_token_dense"]
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    dense = counted_flops(tg.GPT(replace(hp, router="none")), 1, hp.seq_len) / hp.seq_len
    assert v["fwd_flops_per_token_dense"] == pytest.approx(dense, rel=1e-9)
    compact = steered_model(replace(hp, compact=True))
    short = [1] * hp.n_layers  # (a training step's lengths: one token a sequence at each block)
    compact.router.lengths = short
    packed = tg.evaluate(compact, hp, loader, tg.Dist(), contextlib.nullcontext())
    assert packed["val_loss"] == pytest.approx(v["val_loss"], rel=1e-6)
    assert packed["block_active"] == v["block_active"] and compact.router.lengths is short


# ---------------------------------------------------- the training loop, end to end


def test_lr_schedule():
    hp = tiny(lr=1.0, warmup_frac=0.1, warmup_start=0.1)
    assert tg.lr_at(hp, 0, 100) == pytest.approx(0.1)
    assert tg.lr_at(hp, 5, 100) == pytest.approx(0.55)
    assert tg.lr_at(hp, 10, 100) == pytest.approx(1.0)
    assert tg.lr_at(hp, 55, 100) == pytest.approx(0.5)
    assert tg.lr_at(hp, 100, 100) == pytest.approx(0.0, abs=1e-12)
    assert tg.lr_at(hp, 0, 5) == pytest.approx(0.1)  # a share of no whole step: one step
    assert tg.lr_at(hp, 12, 127) == pytest.approx(1.0)  # 12.7 steps: the whole ones, 12
    none = replace(hp, warmup_frac=0.0)  # no warm-up: the cosine from the first step
    assert [tg.lr_at(none, s, 100) for s in (0, 50)] == pytest.approx([1.0, 0.5])


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


def test_the_controller_is_fed_the_sums_and_tokens_of_the_whole_global_batch(
    tmp_path, monkeypatch, capsys
):
    # train() hands router.update the gates' sums of every micro-step of the step (2 here) and
    # the global batch's token count: one micro-batch's count would double eq. (4)'s mean, the
    # last micro-step's sums alone halve it
    micro, fed = [], []
    loss, update = tg.SkipMiddle.loss, tg.SkipMiddle.update

    def spy_loss(self, route, step):
        out = loss(self, route, step)
        micro.append((step, out[1].clone(), route["gates"][0].numel()))
        return out

    def spy_update(self, sums, count, step):
        fed.append((step, sums.clone(), count))
        update(self, sums, count, step)

    monkeypatch.setattr(tg.SkipMiddle, "loss", spy_loss)
    monkeypatch.setattr(tg.SkipMiddle, "update", spy_update)
    code, _, err = run_main(RESUME_RUN + [f"--run_dir={tmp_path}", "--stop_step=2"], capsys)
    assert code == 0, err
    hp = tg.resolve(tg.parse_overrides(RESUME_RUN))
    assert [step for step, _, _ in fed] == [0, 1]
    for step, sums, count in fed:
        mine = [(s, n) for at, s, n in micro if at == step]
        assert len(mine) == hp.batch_size // hp.device_batch_size == 2
        assert count == sum(n for _, n in mine) == hp.batch_size * hp.seq_len
        assert torch.allclose(sums, sum(s for s, _ in mine), rtol=1e-12)


class FakeLog:
    """RunLog's print and record, kept."""

    def __init__(self):
        self.lines, self.records = [], []

    def print(self, line):
        self.lines.append(line)

    def record(self, record):
        self.records.append(record)


def test_compile_time_is_counted_apart_from_step_time():
    # runlog.compile_ms grows by torch.compile's own timers when a graph compiles (a forward at
    # its call, a backward at its first backward), not when a compiled one runs; the clock
    # leaves a step that compiled out of train_time and step_avg whole (on a GPU it costs more
    # than compile_ms) and reports the compile time and the steps left out apart
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    before = runlog.compile_ms()
    loss = f(x)
    forward = runlog.compile_ms()
    loss.backward()
    backward = runlog.compile_ms()
    f(x).backward()
    assert before < forward < backward == runlog.compile_ms()
    log, run = FakeLog(), runs.RunState()
    clock = runlog.StepClock(log, 0, 1)
    for step_ms, compile_ms in ((900.0, 800.0), (100.0, 0.0), (350.0, 250.0), (120.0, 0.0)):
        run.step += 1
        clock.add(run, step_ms, compile_ms)
    clock.end(run)
    assert (run.train_ms, run.timed_steps) == (220.0, 2)  # steps 2 and 4; 3 compiled
    assert log.lines[1:] == [
        "warm-up: steps 1-1 of this job untimed, 900ms (compile 800ms)",
        "compile: 1.1s in this job; steps after the warm-up that compiled, left out of "
        "train_time: 1 (350ms)",
    ]
    resumed = runlog.StepClock(log, run.step, 0)  # a job whose every timed step compiled
    for _ in range(2):
        run.step += 1
        resumed.add(run, 400.0, 300.0)
    resumed.end(run)
    assert (run.train_ms, run.timed_steps) == (220.0, 2)  # the last job's steps, unchanged
    assert log.lines[-1] == (
        "compile: 0.6s in this job; steps after the warm-up that compiled, left out of "
        "train_time: 2 (800ms)"
    )
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
    router = tg.GPT(hp).router  # (RunLog.step on the fake log: its print and record)
    runlog.RunLog.step(log, run, 10, stats, router.means, [1e-3] * 5, (350.0, 250.0))
    assert log.lines[-1].endswith(" step_avg:110.00ms compile:250ms")  # no tok/s: not a step's
    assert (log.records[-1]["step_ms"], log.records[-1]["compile_ms"]) == (350.0, 250.0)
    runlog.RunLog.step(log, run, 10, stats, router.means, [1e-3] * 5, (100.0, 0.0), 0.25)
    assert log.lines[-1].endswith(" step_avg:110.00ms tok/s:5120 mfu:25.0%")  # 512 in 100 ms


def test_the_clock_reports_a_warm_up_once_and_compile_time_only_where_there_was_some():
    # a job that ends as its warm-up does: one warm-up line and record; a job that ran no step
    # (a resume that only validated): none; a job that compiled nothing: no compile line
    log, run = FakeLog(), runs.RunState(step=4)
    clock = runlog.StepClock(log, 4, 2)
    for step_ms in (120.0, 80.0):
        run.step += 1
        clock.add(run, step_ms, 0.0)
    clock.end(run)
    assert log.lines[1:] == ["warm-up: steps 5-6 of this job untimed, 200ms (compile 0ms)"]
    assert log.records == [
        {"kind": "warmup", "step": 6, "steps": 2, "warmup_ms": 200.0, "compile_ms": 0.0}
    ]
    idle = FakeLog()
    runlog.StepClock(idle, 6, 2).end(run)
    assert len(idle.lines) == 1 and idle.records == []  # (its opening line alone)


def test_a_steps_and_a_validations_records_hold_their_own_figures():
    # RunLog.step: the base lr apart from each layer's, the blocks' shares the step's sums over
    # its tokens; RunLog.validation: the train time so far, and the clock of 250 ms over 2 steps
    log = FakeLog()
    run = runs.RunState(step=3, tokens=1536, train_ms=250.0, timed_steps=2)
    router = tg.GPT(tiny(router="none")).router
    stats = {
        "tokens": [512.0],
        "lm_loss": [3.0],
        "total_loss": [3.5],
        "block_active": [512.0, 256.0, 128.0, 0.0],
        "mlp_active": [512.0, 384.0, 0.0, 64.0],
        "packed": [16.0] * 4,
    }
    lrs = [1e-3, 2e-3, 3e-3, 4e-3, 5e-3]
    runlog.RunLog.step(log, run, 10, stats, router.means, lrs, (100.0, 0.0))
    got = log.records[-1]
    assert (got["lr"], got["layer_lr"]) == (1e-3, [2e-3, 3e-3, 4e-3, 5e-3])
    assert got["block_active"] == [1.0, 0.5, 0.25, 0.0]
    assert got["mlp_active"] == [1.0, 0.75, 0.0, 0.125]
    # the language model's loss is train_loss, in the line too; with the router's terms, total
    assert (got["train_loss"], got["total_loss"], got["redone"]) == (3.0, 3.5, False)
    line = log.lines[-1]
    assert line.startswith("step:3/10 train_loss:3.0000 ") and "redone" not in line, line
    runlog.RunLog.step(log, run, 10, {**stats, "redone": [1.0]}, router.means, lrs, (100.0, 0.0))
    assert log.lines[-1].endswith(" redone:full_length") and log.records[-1]["redone"] is True
    v = {
        "val_loss": 2.5,
        "val_se": 0.125,
        "val_docs": 7,
        "sparsity": 0.25,
        "fwd_flops_per_token": 1000.0,
        "fwd_flops_per_token_dense": 2000.0,
        "block_active": [1.0, 0.5, 0.75, 0.75],
        "mlp_active": [1.0, 0.5, 0.75, 0.75],
        "resid_norm": [1.0, 2.0, 3.0, 4.0],
    }
    runlog.RunLog.validation(log, router, v, run, 10)
    assert log.records[-1] == {"kind": "val", "step": 3, "train_time_ms": 250.0, **v}
    at = next(i for i, line in enumerate(log.lines) if line.startswith("step:3/10 val_loss:"))
    assert log.lines[at:] == [
        "step:3/10 val_loss:2.5000 (SE 0.1250 over 7 docs) sparsity:0.2500 "
        "fwd_flops/token:1000 dense:2000 train_time:250ms step_avg:125.00ms",
        "  block_active:[1.000 0.500 0.750 0.750] mlp_active:[1.000 0.500 0.750 0.750]",
        "  resid_norm:[1.000 2.000 3.000 4.000]",
    ]
    runlog.RunLog.validation(log, router, {**v, "val_se": None}, run, 10)  # (one document)
    assert "val_loss:2.5000 (SE nan over 7 docs) " in log.lines[-3]


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
    assert log.count("\n  alpha:") == log.count("\n  gate_mean:") == 5  # each validation's state
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
    source = (Path(REPO) / "train_gpt.py").read_bytes()
    assert log.startswith(source.decode())
    assert f"---- support.py\n{(Path(REPO) / 'support.py').read_text()}" in log
    assert "\ncommand: python train_gpt.py --preset=smoke --n_layers=2 " in log
    assert "\ngit: " in log and f"\nsource: train_gpt.py sha256 {sha256(source)}\n" in log


@pytest.mark.slow
@pytest.mark.parametrize("router", ["skip_middle", "mor", "dlo"])
def test_two_processes_match_one(tmp_path, capsys, router):
    # (they agree within 5e-7: 1e-5 sees the router's sums left on each rank, which move the
    # controller's coefficients and DLO's skip rates, eq. 8)
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
    peak = ["--peak_flops=1e10"]  # (a job's: the records compared below do not hold it)
    two = run_command("train_gpt.py", *args, *peak, f"--run_dir={tmp_path / 'two'}", nproc=2)
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
        assert abs(a[key] - b[key]) < 1e-5, (a, b)
    # 3 documents over both ranks' sequences: per-token losses gathered in the loader's order
    assert m1[-1]["val_docs"] == m2[-1]["val_docs"] > 1
    assert m1[-1]["val_se"] == pytest.approx(m2[-1]["val_se"], abs=1e-5)
    key = "gate_mean" if router == "skip_middle" else "mlp_active"  # the routing, per block
    assert m1[-1][key] == pytest.approx(m2[-1][key], abs=1e-5)
    # MFU: 3x the forward FLOPs of a step's tokens over its time, over both devices' peaks
    hp = sources.saved_settings(sources.load_checkpoint(str(tmp_path / "two"))["hp"])
    mfu = re.findall(r"step:(\d)/3 .* mfu:([\d.]+)%", (tmp_path / "two" / "train.log").read_text())
    assert [int(step) for step, _ in mfu] == [1, 2, 3]
    for (_, shown), m in zip(mfu, m2, strict=False):
        want = 3 * tg.forward_flops(hp) * 8 / (m["step_ms"] / 1000) / (2 * 1e10)
        assert float(shown) == pytest.approx(100 * want, abs=0.06), (shown, want)


def test_every_position_the_loader_reaches_is_one_a_resume_accepts(tmp_path):
    # one global batch: 2 sequences of 4 (+1). Shard 0 (17 tokens) holds batches at 0 and 8, the
    # last one ending at its last token; shard 1 (9 tokens) one at 0. Each state the loader
    # reaches passes check_position; a position past a shard's last batch start, a negative
    # one, or a shard index out of range is a UserError (not an IndexError)
    write_shard(tmp_path / "d_0.bin", np.arange(17))
    write_shard(tmp_path / "d_1.bin", np.arange(9))
    loader = tg.DistributedLoader(str(tmp_path / "d_*.bin"), 2, 4, 0, 1)
    seen = []
    for _ in range(4):
        loader.check_position(loader.state())
        seen.append((loader.shard, loader.pos))
        loader.next_batch()
    assert seen == [(0, 0), (0, 8), (1, 0), (0, 0)]
    # and a new loader restored to each state goes on with the same batches, passes counted
    for _ in range(3):
        again = tg.DistributedLoader(str(tmp_path / "d_*.bin"), 2, 4, 0, 1)
        again.restore(loader.state())
        for _ in range(3):
            assert all(map(torch.equal, loader.next_batch(), again.next_batch()))
            assert again.state() == loader.state()
    for shard, pos in ((0, 9), (1, 1), (0, -1), (2, 0), (-1, 0)):
        with pytest.raises(tg.UserError, match=rf"data position \(shard {shard}, token {pos}\)"):
            loader.check_position({"shard": shard, "pos": pos})
    # two ranks: a global batch of 2 x 2 x 4 (+1), at 0 and 16 in a shard of 33 tokens; past
    # 16, rank 1's sequences would run off the shard's end
    write_shard(tmp_path / "w_0.bin", np.arange(33))
    for rank in (0, 1):
        loader = tg.DistributedLoader(str(tmp_path / "w_*.bin"), 2, 4, rank, 2)
        seen = []
        for _ in range(3):
            loader.check_position(loader.state())
            seen.append(loader.pos)
            loader.next_batch()
        assert seen == [0, 16, 0]
        for pos in (17, 24):
            with pytest.raises(tg.UserError, match=rf"data position \(shard 0, token {pos}\)"):
                loader.check_position({"shard": 0, "pos": pos})


def test_a_validation_record_names_only_the_shards_its_batches_read(tmp_path):
    # global batches of 2 x 4 (+1): shards of 17, 8 and 12 tokens hold 2, 0 and 1. The first
    # two batches read shard 0 alone; a third reads shard 2 too (shard 1 is passed over)
    for i, n in enumerate((17, 8, 12)):
        write_shard(tmp_path / f"v_{i}.bin", np.arange(n) + 100 * i)
    loader = tg.DistributedLoader(str(tmp_path / "v_*.bin"), 2, 4, 0, 1)
    for batches, read in ((0, []), (1, [0]), (2, [0]), (3, [0, 2]), (9, [0, 2])):
        assert [e[0] for e in loader.fingerprints(batches)["read"]] == read, batches
