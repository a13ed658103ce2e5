"""The routers other than the paper's (routers.py): what every router shares, DLO,
Mixture-of-Depths and Mixture-of-Recursions, each against a reference written here."""

import collections
import contextlib
import math
import os
from dataclasses import replace

import pytest
import torch

import routers
import sample
import train_gpt as tg
from conftest import (
    REPO,
    TINY_RUN,
    assert_close_rel,
    compact_matches_masked,
    counted_flops,
    math_sdpa,
    mor_model,
    read_metrics,
    run_command,
    run_main,
    timing,
    tiny,
    write_shard,
)

# --------------------------------------------------------------------- every router


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


def test_one_router_registry_however_train_gpt_is_loaded(tmp_path):
    # by path, with no sys.modules entry (as a tool or notebook may load it): the settings'
    # choices are the registry's names and each one builds its own router; and no module it
    # imports as it loads imports train_gpt, which would build a second registry beside
    # __main__'s (sources.py, which main imports, does: test_cli's one-module test)
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
    r = run_command("-c", code, os.path.join(REPO, "train_gpt.py"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["none", "skip_middle", "dlo", "mod", "mor"]
    siblings = "import routers, runs, support, sys; print('train_gpt' in sys.modules)"
    r = run_command("-c", siblings)
    assert r.stdout == "False\n", r.stderr


def assert_compact_matches_masked(make, given=False):
    """make(compact=...) -> a model: compact_matches_masked on a batch of 3 x 16, in training and
    in evaluation. given: packed to lengths given on the host, the masked pass's packed_counts
    in that mode (the exact fit; MoD's and MoR's training packs its top k, known on the host,
    whatever the lengths)."""
    idx = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(4))
    twin, out, counts = compact_matches_masked(make(), idx, "fit" if given else None)
    assert min(counts[1][False]) < 16  # some block packs fewer tokens than the sequence has
    if given:  # the lengths are what packs in evaluation (training packs its exact top k)
        twin.router.lengths = [max(0, n - 1) for n in counts[1][False]]  # a token fewer
        with torch.no_grad():
            assert (twin(idx).logits - out[0][1].logits).abs().max().item() > 1e-3


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


def test_a_packed_length_holds_its_count_in_the_fewest_units_of_at_most_packs_lengths():
    # every count of a sequence of T fits its length, which is the smallest multiple of the unit
    # (T / PACKS rounded up) that holds it (at least one unit), or T; so a compiled block meets
    # at most PACKS lengths (docs/gpu.md)
    for T in range(1, 600):
        unit = -(-T // routers.PACKS)
        lengths = set()
        for count in range(T + 1):
            n = routers.packed_length(count, T)
            smallest = unit * max(1, -(-count // unit))
            assert n == min(T, smallest), (T, count, n)
            lengths.add(n)
        assert len(lengths) <= routers.PACKS, (T, sorted(lengths))
    assert len({routers.packed_length(c, 256) for c in range(257)}) == routers.PACKS


# ------------------------------------------------------------------------------ DLO


def test_zero_router_scores_are_one_and_the_model_is_dense():
    torch.manual_seed(0)
    dense = tg.GPT(tiny(router="none"))
    dlo = tg.GPT(tiny(router="dlo"))
    missing, unexpected = dlo.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and missing == [f"router.routers.{i}.weight" for i in range(4)]
    idx = torch.randint(0, 97, (3, 16))
    ref = dense(idx).logits
    dlo.router.rates = torch.zeros(4, dtype=torch.float64)  # training: skip rate 0 everywhere
    for training in (False, True):
        out = dlo.train(training)(idx)
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
    # eq. (3)'s floor: (1 - 0.3) 16 = 11.2 and (1 - 0.7) 16 = 4.8 tokens of each sequence
    model.router.rates = torch.tensor([0.3, 0.7], dtype=torch.float64)
    runs = model(torch.randint(0, 97, (3, 16))).route["mlp"].sum(dim=2)
    assert runs.tolist() == [[11, 11, 11], [4, 4, 4]]


@pytest.mark.parametrize("std", [0.5, 0.0, 20.0])
def test_dlo_training_forward_written_from_its_weights(std):
    # eqs. 1-3 in training, by hand: r = (beta + (2 sigmoid(h.w) - 1) gamma) / 2 from the routers'
    # weights; attention for every token; the top floor((1 - rho_i) T) of each sequence by r run
    # the MLP, scaled by r, the others none of it. r's order is z's, exactly (std 20: most z past
    # 14, where fp32 r is one value). std 0: every r ties (the routers' zero init, each run's
    # first step): the earlier tokens run (the docstring's rule)
    torch.manual_seed(0)
    hp = tiny(router="dlo", n_layers=2)
    model = tg.GPT(hp).train()
    for router in model.router.routers:
        torch.nn.init.normal_(router.weight, std=std)
    rates = [0.5, 0.25]
    model.router.rates = torch.tensor(rates, dtype=torch.float64)
    idx = torch.randint(0, 97, (3, 16))
    out = model(idx)
    runs = []
    with torch.no_grad():
        x = model.embed_norm(model.embed(idx))
        for layer, block in enumerate(model.blocks):
            z = x @ model.router.routers[layer].weight[0]  # (B, T)
            r = (hp.dlo_beta + (2 * torch.sigmoid(z) - 1) * hp.dlo_gamma) / 2
            k = math.floor((1 - rates[layer]) * 16)
            run = torch.zeros_like(r, dtype=torch.bool)
            for b, zb in enumerate(z.tolist()):  # by r (as z: exact), then the earlier token
                ranked = [t for _, t in sorted((-zb[t], t) for t in range(16))]
                run[b, ranked[:k]] = True
            runs.append(run)
            a = block.attend(x, None, None)
            x = a + (r * run)[..., None] * block.mlp(a)
        logits = model.head(model.head_norm(x))
    assert torch.equal(out.route["mlp"], torch.stack(runs))
    assert (out.logits - logits).abs().max().item() < 1e-5
    if std == 0:
        assert [run[0].nonzero().flatten().tolist() for run in runs] == [[*range(8)], [*range(12)]]


def test_dlo_similarity_is_the_cosine_of_the_mlps_input_and_output_by_hand():
    # eq. (4): cos(A(h), M(A(h))), M the MLP sublayer with its residual (routers.py's choice):
    # its input a, its output a + f, f the MLP branch
    torch.manual_seed(0)
    model = tg.GPT(tiny(router="dlo", n_layers=2)).train()
    seen = []
    for block in model.blocks:

        def recording(a, mlp=block.mlp):
            f = mlp(a)
            seen.append((a.double(), f.double()))
            return f

        block.mlp = recording
    similarity = model(torch.randint(0, 97, (3, 16))).route["similarity"]  # (L, B, T)
    for layer, (a, f) in enumerate(seen):
        out = a + f
        cos = (a * out).sum(-1) / (a.norm(dim=-1) * out.norm(dim=-1))
        assert (similarity[layer].double() - cos).abs().max() < 1e-5


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


def test_dlo_annealing_rates_and_layer_learning_rates():
    state = tg.DLO(tiny(router="dlo", n_layers=2, dlo_rho=0.4, dlo_anneal_steps=4))
    assert [state.overall(s) for s in (0, 1, 3, 10)] == pytest.approx([0.1, 0.2, 0.4, 0.4])
    assert state.rates.tolist() == pytest.approx([0.1, 0.1])  # rho_{i,1}: step 1's rate
    assert state.lr_scales(0) == pytest.approx([1.0, 1.0])
    state.update(torch.tensor([[6.0, 2.0]]), 8, step=0)  # eq. (8): 6 of 8 labelled to run
    assert state.rates.tolist() == pytest.approx([0.25, 0.75])
    assert state.lr_scales(3) == pytest.approx([0.75 / 0.6, 0.25 / 0.6])  # eq. (10)
    # the loss's labels at the annealed rate (Algorithm 1 line 46), not the target: of each
    # sequence's 2 x 16 positions, floor((1 - rho^t) 32) run: 28.8, 22.4, 19.2
    model = tg.GPT(tiny(router="dlo", n_layers=2, dlo_rho=0.4, dlo_anneal_steps=4)).train()
    route = model(torch.randint(0, 97, (3, 16))).route
    for step, run in ((0, 28), (2, 22), (5, 19)):
        assert model.router.loss(route, step)[1].sum().item() == 3 * run
    model = tg.GPT(tiny(router="dlo", n_layers=2))
    groups = tg.param_groups(model)
    assert len(groups) == 3 and any(
        p is model.router.routers[1].weight for p in groups[2]["params"]
    )
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


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
    models[1].router.lengths = routers.packed_counts(a.route).int().tolist()  # given: the exact fit
    assert max(models[1].router.lengths) < 16
    c = models[1](idx)
    assert (
        torch.equal(a.route["scale"], c.route["scale"]) and (a.logits - c.logits).abs().max() < 1e-5
    )
    models[1].router.lengths = [max(0, n - 1) for n in models[1].router.lengths]  # a token fewer
    assert (models[1](idx).logits - a.logits).abs().max() > 1e-3


def test_dlo_scales_an_mlp_output_by_r_unrounded():
    # without sandwich norm the MLP's output is bf16 under autocast: r, within 0.975..1.025, must
    # scale it in fp32 (in bf16 it rounds to 1 near 1). Here a = 0 and f = 1, so out = r * run
    torch.manual_seed(0)
    model = tg.GPT(tiny(router="dlo", n_layers=2)).eval()
    router, block, x = model.router.routers[0], model.blocks[0], torch.randn(1, 16, 32)
    torch.nn.init.normal_(router.weight, std=0.1)
    block.attend = lambda x, *_: torch.zeros_like(x)
    block.mlp = lambda a: torch.ones(a.shape, dtype=torch.bfloat16)
    out = model.router.run(0, block, x, collections.defaultdict(list), None)
    r = (2 + (2 * torch.sigmoid(router(x).float()) - 1) * 0.05) / 2  # eq. (1), beta 2, gamma 0.05
    run = r >= 1  # eq. (2)
    assert run.any() and (r[run] != 1).all() and torch.equal(out, (r * run).expand_as(out))


def test_dlo_inference_skips_every_negative_logit_however_small():
    # r >= beta / 2 holds exactly when hW >= 0; r computed in fp32 is beta / 2 near 0 either side
    model = tg.GPT(tiny(router="dlo", n_layers=2)).eval()
    router, block, x = model.router.routers[0], model.blocks[0], torch.zeros(1, 5, 32)
    torch.nn.init.zeros_(router.weight)
    router.weight.data[0, 0] = 1.0
    x[0, :, 0] = torch.tensor([-1e-7, -1e-30, 0.0, 1e-7, -1.0])  # the logits hW
    block.attend = lambda x, *_: torch.zeros_like(x)
    block.mlp = lambda a: torch.ones_like(a)
    trace = collections.defaultdict(list)
    model.router.run(0, block, x, trace, None)
    assert trace["mlp"][0][0].tolist() == [False, False, True, True, False]


def test_dlo_validation_counts_skipped_mlps_as_its_sparsity(tmp_path):
    # every DLO block runs its attention (block_active 1): the share skipped is of the MLPs,
    # counted here from the routers' own choices (eq. 2 at inference: hW >= 0 runs)
    torch.manual_seed(0)
    hp = tiny(router="dlo", n_layers=2, device_batch_size=2, val_tokens=64)
    model = tg.GPT(hp)
    for router in model.router.routers:
        torch.nn.init.normal_(router.weight, std=0.5)
    tokens = torch.randint(0, hp.vocab_size, (65,)).numpy()
    write_shard(tmp_path / "v_0.bin", tokens)
    loader = tg.DistributedLoader(str(tmp_path / "v_*.bin"), 2, 16, 0, 1, hp.vocab_size)
    v = tg.evaluate(model, hp, loader, tg.Dist(), contextlib.nullcontext())
    ran = []
    for router in model.router.routers:
        router.register_forward_hook(lambda _, args, out: ran.append(out >= 0))
    with torch.no_grad():
        model.eval()(torch.from_numpy(tokens[:-1].astype("int64")).view(4, 16))
    assert v["block_active"] == [1.0, 1.0]
    assert v["mlp_active"] == pytest.approx([r.float().mean().item() for r in ran], abs=1e-12)
    skipped = sum((~r).sum().item() for r in ran) / (2 * 64)  # of every (layer, token)'s MLP
    assert 0 < v["sparsity"] == pytest.approx(skipped, abs=1e-12)


def test_dlo_flops_count_only_executed_mlps():
    hp = tiny(router="dlo", n_layers=2)
    dense = tg.forward_flops(replace(hp, router="none"))
    half = tg.forward_flops(hp, None, [0.5, 0.5])
    ffn = 2 * 3 * 32 * 4 * 32 * 16  # SwiGLU FLOPs per layer and sequence
    routers = 2 * 16 * 2 * 32
    assert dense - half == pytest.approx(2 * 0.5 * ffn - routers)


# ---------------------------------------------------------------- Mixture-of-Depths


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
    # reference: r = h.w from the router's weight; each sequence's top k by r as a short sequence
    # of its own (with their positions), the block's output scaled by r; every other token
    # passes unchanged. The gradients too: r's into h and w included
    model = mod_model().train()
    block, x = model.blocks[1], torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    w = model.router.routers[0].weight
    x.requires_grad_()
    trace = collections.defaultdict(list)
    out = model.router.run(1, block, x, trace, None)
    r = x @ w[0]  # (B, T)
    chosen = torch.zeros_like(r, dtype=torch.bool).scatter(1, r.topk(4, dim=1).indices, True)
    assert torch.equal(trace["block"][0], chosen)
    expected = x.clone()
    for b in range(2):
        pos = chosen[b].nonzero().squeeze(1)
        xs = x[b, pos][None]
        y = block.attend(
            xs, r[b, pos][None, :, None], None, pos=pos[None], keys=torch.ones(1, len(pos), 1)
        )
        expected[b, pos] = (y + r[b, pos][None, :, None] * block.mlp(y))[0]
    assert (out - expected).abs().max().item() < 1e-4
    assert torch.equal(out[~chosen], x[~chosen])
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (x, w))
    want = torch.autograd.grad((expected * weights).sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 1e-3)


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


@pytest.mark.parametrize("router", ["dlo", "mod"])
def test_a_routers_own_loss_trains_its_weights_as_the_bce_gradient_by_hand(router):
    # d/dw of coef x mean BCE(sigmoid(h.w), y) = coef / N x sum (sigmoid(h.w) - y) h over the N
    # scores of all its layers, for the last router (an earlier one's r also moves the later
    # layers' h); h: its input as it ran (captured), y: the labels the loss reads (DLO: eq. 5's
    # at the annealed rate, tested above; MoD: the top k)
    torch.manual_seed(0)
    model = tg.GPT(tiny(router=router)).train()
    seen = []
    for linear in model.router.routers:
        torch.nn.init.normal_(linear.weight, std=0.3)
        linear.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    route = model(torch.randint(0, 97, (3, 16))).route
    model.router.loss(route, 0)[0].backward()
    if router == "dlo":
        y, coef = tg.DLO.labels(route["similarity"], model.router.overall(0)), 1.0
    else:
        y, coef = route["topk"].float(), model.hp.mod_aux_coef
    assert len(seen) == len(y) == len(model.router.routers) and 0 < y.mean() < 1
    last, h = model.router.routers[-1], seen[-1]
    p = torch.sigmoid(h @ last.weight[0].detach())
    want = coef / y.numel() * ((p - y[-1])[..., None] * h).sum(dim=(0, 1))
    assert_close_rel(last.weight.grad[0], want, 1e-5)


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
    assert tg.forward_flops(hp, [1, 0.25, 1, 0.25]) == pytest.approx(reference, rel=1e-9)
    # the two routers' linears, every token; at 5 layers the same two (blocks 1 and 3)
    for shape in (hp, replace(hp, n_layers=5)):
        dense = replace(shape, router="none", compact=False)
        assert tg.forward_flops(shape) - tg.forward_flops(dense) == 2 * 64 * 2 * 128


# ------------------------------------------------------------ Mixture-of-Recursions


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
    # by sigmoid(score) x the stack's update; the same gradients, the scores' into the stream
    model = mor_model(n_layers=n_layers).train(mode == "train")
    M = (n_layers - 2) // 3
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
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
    weights, params = torch.randn_like(expected), list(model.parameters())
    got = torch.autograd.grad((out.logits * weights).sum(), params)
    want = torch.autograd.grad((expected * weights).sum(), params)
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 1e-3)


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


@torch.no_grad()
def decoded_as_the_full_pass(model):
    """Decodes 16 tokens one at a time with a KV cache: each step's logits the full pass's, and
    each block's cached K/V those of the tokens it ran -> the cache."""
    idx = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(10))
    full, cache = model(idx), sample.KVCache(model.hp, "cpu", 16)
    for pos in range(16):
        step = model(idx[:, pos : pos + 1], pos=torch.tensor([[pos]]), cache=cache).logits
        assert (step[0, -1] - full.logits[0, pos]).abs().max().item() < 1e-4
    assert cache.n == full.route["block"][:, 0].sum(dim=1).tolist()
    return cache


def test_mor_decoding_caches_k_v_only_at_the_recursions_a_token_ran():
    model = mor_model(compact=True).eval()
    cache = decoded_as_the_full_pass(model)
    assert cache.n[:3] == [16] * 3 and cache.n[7] == 16 and cache.n[5] < cache.n[3] < 16


@pytest.mark.parametrize("router", ["mod", "dlo"])
def test_decoding_matches_the_full_pass_and_caches_k_v_where_attention_ran(router):
    # a token at a time: each step's logits are the full pass's; a block keeps K/V only for the
    # tokens its attention ran (MoD: those with r > 0 at its routed blocks; DLO: every token)
    torch.manual_seed(0)
    model = tg.GPT(tiny(router=router, compact=True)).eval()
    for linear in model.router.routers:
        torch.nn.init.normal_(linear.weight, std=0.3)
    cache = decoded_as_the_full_pass(model)
    if router == "mod":  # its routed blocks, 1 and 3, cache some tokens, not all
        assert cache.n[0] == cache.n[2] == 16 and 0 < cache.n[1] < 16 and 0 < cache.n[3] < 16
    else:
        assert cache.n == [16] * 4


def test_mor_flops_match_flop_counter_at_its_shares(monkeypatch):
    hp = tiny(
        router="mor", vocab_size=1000, dim=128, n_layers=5, max_seq_len=64, seq_len=64, compact=True
    )
    monkeypatch.setattr(tg.F, "scaled_dot_product_attention", math_sdpa)
    reference = counted_flops(tg.GPT(hp).train(), 1, 64)  # top-k: 64, 42 and 21 of 64 tokens
    assert tg.forward_flops(hp, [1, 1, 42 / 64, 21 / 64, 1]) == pytest.approx(reference, rel=1e-9)
    # its recursive baseline: no router, none of their FLOPs
    baseline = replace(hp, mor_routed=False, compact=False)
    reference = counted_flops(tg.GPT(baseline).train(), 1, 64)
    assert tg.forward_flops(baseline) == pytest.approx(reference, rel=1e-9)
    # the three routers' linears, every token
    assert (
        tg.forward_flops(hp) - tg.forward_flops(replace(hp, router="none", compact=False))
        == 3 * 64 * 2 * 128
    )


def test_mor_settings_that_make_no_sense_are_refused():
    for kw, message in (
        (dict(n_layers=7), r"multiple of it \(n_layers=5 or 8\)"),
        (dict(n_layers=4), r"multiple of it \(n_layers=5\)"),
        (dict(n_layers=2), r"multiple of it \(n_layers=5\)"),  # (no block to recur)
        (dict(mor_routed=False, compact=True), "every token runs everywhere"),
        (dict(n_layers=3, mor_recursions=1, compact=True), "every token runs"),
        (dict(mor_routed=False, mor_aux_coef=0.5), "has no effect"),
        (dict(n_layers=3, mor_recursions=1, mor_aux_coef=0.5), "has no effect"),
    ):
        with pytest.raises(tg.UserError, match=message):
            tg.validate(tiny(router="mor", **{"n_layers": 8, **kw}), 1)
    tg.validate(tiny(router="mor", n_layers=3, mor_recursions=1), 1)  # one block, applied once


@pytest.mark.slow
@pytest.mark.parametrize("router", ["mor", "dlo"])
def test_a_routed_run_resumes_exactly_and_trains_at_its_layer_rates(
    router, tmp_path, monkeypatch, capsys
):
    # the routers' state outside their parameters (DLO's skip rates: eq. 3's top-k, eq. 10's
    # rates) comes back with a resume; each step's learning rates per block are the schedule's
    # times the router's lr_scales (DLO eq. 10; every other router: 1), and the optimiser's
    args = (
        TINY_RUN
        + [
            f"--router={router}",
            "--n_layers=5",
            "--train_tokens=2048",
            "--val_every=2",
            "--val_tokens=512",
        ]
        + (["--dlo_anneal_steps=0"] if router == "dlo" else [])
    )
    scales, step_fn = [], tg.train_step

    def recording(model, router, hp, opt, loader, d, autocast, accum, lrs, step):
        scales.append(router.lr_scales(step))
        assert lrs[1:] == [lrs[0] * s for s in scales[-1]]
        out = step_fn(model, router, hp, opt, loader, d, autocast, accum, lrs, step)
        assert [group["lr"] for group in opt.param_groups] == lrs
        return out

    with monkeypatch.context() as m:
        m.setattr(tg, "train_step", recording)
        code, _, err = run_main(args + [f"--run_dir={tmp_path / 'full'}"], capsys)
    assert code == 0, err[-2000:]
    assert len(scales) == 4 and (max(map(max, scales)) > 1.01) == (router == "dlo")
    code, _, err = run_main(args + [f"--run_dir={tmp_path / 'part'}", "--stop_step=2"], capsys)
    assert code == 0, err[-2000:]
    code, _, err = run_main([f"--resume={tmp_path / 'part'}"], capsys)
    assert code == 0, err[-2000:]

    def strip(ms):
        return [timing(m) for m in ms if m["kind"] in ("train", "val")]

    a, b = (strip(read_metrics(tmp_path / r)) for r in ("full", "part"))
    assert len(a) == 4 + 3 and a == b
    assert len(a[-1]["block_active"]) == 5 and min(a[-1]["mlp_active"]) < 1  # inference shares


@pytest.mark.parametrize("router", [r for r in tg.ROUTERS if r != "none"])
def test_every_router_compacts_under_bf16_autocast_with_either_norm(router):
    # under autocast a pre-norm block's branches come out in bf16, a sandwich-normed one's in fp32
    # (the norm's weight): compacted, each router evaluates as masked does and trains, in both
    torch.manual_seed(0)
    idx = torch.randint(0, 97, (3, 16))
    for sandwich in (True, False):
        hp = tiny(router=router, sandwich_norm=sandwich, n_layers=5 if router == "mor" else 4)
        masked, compact = tg.GPT(hp).eval(), tg.GPT(replace(hp, compact=True)).eval()
        for p in masked.router.parameters():  # scores far from their zero init: tokens skip
            torch.nn.init.normal_(p, std=1.0)
        compact.load_state_dict(masked.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = masked(idx), compact(idx)
            assert 0 < a.route["block"].float().mean() * a.route["mlp"].float().mean() < 1
            assert (a.logits - b.logits).abs().max() < 1e-2  # (logits ~0.4: bf16's rounding)
            compact.train()
            if compact.router.packs():  # (as a new run's first step: room for every token)
                compact.router.lengths = [hp.seq_len] * hp.n_layers
            compact(idx, targets=idx).loss.backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in compact.parameters())
