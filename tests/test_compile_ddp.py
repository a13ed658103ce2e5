"""What the GPU runs, tested on CPU: compiled blocks (graph breaks, recompiles, gradients), the
host reads of a training step, and DDP around compacted and compiled blocks (gloo)."""

import contextlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import ranks
import routers
import runs
import train_gpt as tg
from conftest import REPO, assert_close_rel, grads, run_command, spread_gates, steered_model, tiny

# every router, masked and (where it has one) compacted
ROUTER_PATHS = [
    ("none", False),
    *[
        (router, compact)
        for router in ("skip_middle", "dlo", "mod", "mor")
        for compact in (False, True)
    ],
]

# ------------------------------------------------------------------------- compiled


@pytest.mark.parametrize(
    "router,compact",
    ROUTER_PATHS,
)
@pytest.mark.slow
def test_a_compiled_training_step_equals_the_eager_one(router, compact, monkeypatch, strict_dynamo):
    # what compile_model compiles (each block's regions and the readout),
    # through AOTAutograd (aot_eager: the layer where torch 2.11 lost the loss's gradients; the
    # CI's torch 2.11 leg runs this): the loss, the router's loss and every parameter's gradient
    # within 1e-5 of the largest, and no gradient all-zero that eager makes non-zero
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"})
    )
    torch._dynamo.reset()  # a fresh cache; strict_dynamo: no silent fall-back to eager at the limit
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


@pytest.mark.parametrize(
    "attn,router,compact",
    [
        *[("sdpa", r, c) for r, c in ROUTER_PATHS],
        ("flex", "skip_middle", False),
        ("flex", "skip_middle", True),
        ("flex", "mod", False),
        ("flex", "mod", True),
    ],
)  # Flex: a score_mod, key masks, and a block mask per packed length
@pytest.mark.slow
def test_a_compiled_model_stays_compiled(
    router, compact, attn, monkeypatch, strict_dynamo, recwarn
):
    # at the paper's depth (12 layers): graph breaks and recompiles are dynamo's decisions, the
    # same on CPU and CUDA: traced here with the eager backend, dynamo told to fail where it
    # would give up (its recompile limit). Flex, CUDA's attention, has no backward on CPU: its
    # training steps run forward only, at 4 layers (what differs from SDPA is inside a block).
    # compile_model compiles the blocks (regions) and the readout, shapes static: the blocks share
    # their graphs, and a packed length compiles one graph, whatever vector of lengths it comes in
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # (once a process)

    real, graphs = torch.compile, []

    def backend(gm, example_inputs):  # the model's graphs (Flex's own CPU wrapper names "eager")
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{"backend": backend, **kw}))
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
            raw.router.lengths = routers.packed_lengths(
                [routers.packed_counts(out.route).tolist()], 256
            )
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
                routers.fit_lengths(raw, idx)  # (compiled in place: at the shapes used next)
                fitted.add(tuple(raw.router.lengths))
            model(idx, targets=torch.roll(idx, -1, 1))
    # per mode, one graph per shape a block is called at: per packed length (the sequence's
    # when not compacted), for each region the router calls (DLO: attention and MLP apart; MoD,
    # MoR: ungated blocks besides) and for each way of gating it (MoR: keys and none); and the
    # readout's: with targets, and in evaluation also without (fit_lengths' forward)
    assert not counts["graph_break"], dict(counts["graph_break"])
    # nor traced through a cache (gated_attention: Flex itself when compiling, not its wrapper)
    assert not [w for w in recwarn if "lru_cache" in str(w.message)], [str(w) for w in recwarn]
    # the model ran compiled at all: a block's graph and the readout's in training, more in
    # evaluation (the bounds below are upper ones only, which no compiling at all meets)
    assert training_graphs >= 2, training_graphs
    assert len(graphs) > training_graphs, (len(graphs), training_graphs)
    shapes = {n for v in lengths for n in v} | {hp.seq_len}
    assert training_graphs <= 2 * len(shapes) + 1, (training_graphs, shapes)
    evaluated = {n for v in fitted for n in v} | {hp.seq_len}
    assert len(graphs) - training_graphs <= 2 * len(evaluated) + 2, (len(graphs), evaluated)
    if router == "skip_middle" and compact:  # one graph a length: shared by every block
        assert training_graphs - 1 == len(shapes) <= routers.PACKS
        assert len(graphs) - training_graphs <= len(evaluated) + 2
        # each length below T's graph holds the packing too (a region of its own: Block.packed),
        # training's apart from evaluation's (SDPA: by grad mode; Flex, whose training here runs
        # without gradients: by the batch, 1 sequence against 2)
        packed = torch._dynamo.eval_frame._debug_get_cache_entry_list(tg.Block.packed.__code__)
        assert len(packed) == len(shapes) - 1 + len(evaluated) - 1, (len(packed), shapes, evaluated)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "flex"])  # (Flex: CUDA's, a block mask per length)
def test_one_process_evaluating_every_router_at_every_packed_length_stays_compiled(
    attn, monkeypatch, strict_dynamo
):
    # sweep.py's measure evaluates each run of a grid, compiled, in one process: every router's
    # masked model and its compacted one at whatever lengths its runs pack. A block's regions
    # are one code each, whose graphs every router's calls add to: past Dynamo's limit on one
    # code (compile_model) the rest would run eagerly, and measure would time that. Each router
    # here at every length a sequence of T packs to, one process (backend "eager": Dynamo's
    # decisions as on CUDA): the routers' compacted blocks share a graph per length
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    T = 32
    lengths = sorted({routers.packed_length(n, T) for n in range(T + 1)})
    idx = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(0))
    for router in tg.ROUTERS:
        n_layers = 5 if router == "mor" else 4
        hp = tiny(
            router=router,
            n_layers=n_layers,
            dim=64,
            max_seq_len=T,
            seq_len=T,
            dlo_rho=0.5,
            attn_impl=attn,
        )
        torch.manual_seed(0)
        masked = tg.compile_model(tg.GPT(hp).eval())
        can_compact = not tg.ROUTERS[router].check(replace(hp, compact=True))  # (as measure)
        compact = tg.GPT(replace(hp, compact=True)).eval() if can_compact else None
        with torch.no_grad():
            masked(idx)
            if compact is not None:
                routers.fit_lengths(compact, idx)  # (eager: the number of applied blocks)
                applied = len(compact.router.lengths)
                tg.compile_model(compact)
                for n in lengths:
                    compact.router.lengths = [n] * applied
                    compact(idx)
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list
    graphs = {name: len(cached(getattr(tg.Block, name).__code__)) for name in tg.REGIONS}
    # a graph per packed length, else the compacted blocks ran eagerly (measure would time eager
    # blocks), which an upper bound alone lets pass: the gated routers' packed region, one for
    # them all, at each length below T, and DLO's MLP at each; at most one more a router (its
    # masked model's) in any region
    assert graphs["packed"] == len(lengths) - 1, (graphs, lengths)
    assert len(lengths) <= graphs["mlp"], (graphs, lengths)
    assert max(graphs.values()) <= len(lengths) + len(tg.ROUTERS), graphs


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
                ranks.__file__,
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
        f"{REPO}/data/sample/sample_train_*.bin", 4, hp.seq_len, 0, 1, hp.vocab_size
    )
    lrs = [1e-3] * len(opt.param_groups)
    if router == "skip_middle":
        spread_gates(model, std=0.5)  # many tokens skip the middle
    if compact and model.router.packs_in_training:
        model.router.lengths = [hp.seq_len] * hp.n_layers  # as train() starts
    for step in (0, 1):  # the second step packs to the lengths the first one's counts gave
        stats = tg.train_step(
            model, model.router, hp, opt, loader, ranks.Dist(), contextlib.nullcontext(), 2, lrs, 0
        )
        model.router.update(stats.get("router"), stats["tokens"][0], 0)
        model.router.lr_scales(1)  # the next step's per-layer rates: DLO's eq. 10 reads them
        assert len(reads) == (1 + (router == "dlo")) * (step + 1), reads
    assert "redone" not in stats
    if compact and model.router.packs_in_training:
        seen = model.router.seen  # both steps' counts: the lengths hold the most of either
        assert len(seen) == 2 and seen[-1] == stats["packed"]
        assert model.router.lengths == routers.packed_lengths(seen, hp.seq_len)
        assert min(model.router.lengths) < hp.seq_len  # some block packs fewer than all
    assert stats["tokens"] == [4 * hp.seq_len] and len(stats["block_active"]) == hp.n_layers


@pytest.mark.parametrize(
    "device,compile_,compiled",
    [("cuda:1", True, True), ("cuda:1", False, False), ("cpu", True, False)],
)
def test_the_model_training_runs_is_compiled_where_asked_on_cuda_and_nowhere_else(
    device, compile_, compiled, monkeypatch
):
    # train() runs what wrapped() returns: compile_model's model on CUDA with compile=1 (the
    # tests above check that model; here a stand-in), the eager one on the CPU (docs/speed.md)
    # or with compile=0
    given, stand_in = [], torch.nn.Identity()

    def spy(model):
        given.append(model)
        return stand_in

    monkeypatch.setattr(tg, "compile_model", spy)
    raw = tg.GPT(tiny())
    model = tg.wrapped(raw, tg.Job(compile=compile_), ranks.Dist(device=device))
    assert model is (stand_in if compiled else raw)
    assert given == ([raw] if compiled else [])


# ------------------------------------------------------------------------------ DDP


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
            assert counts["stats"]["unique_graphs"] == 2  # one serves every block; the readout
            pieces[ddp] = len(graphs)
    finally:
        dist.destroy_process_group()
    assert pieces[False] == 2 < pieces[True], pieces  # a piece per bucket


def two_ranks(tmp_path, script: str, *args) -> subprocess.CompletedProcess:
    """script run as ddp.py under torchrun on 2 CPU processes (one thread each), with REPO, args
    and tmp_path as its arguments."""
    (tmp_path / "ddp.py").write_text(script)
    return run_command(tmp_path / "ddp.py", REPO, *args, tmp_path, nproc=2, timeout=180)


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
import ranks, train_gpt as tg
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
stats = tg.train_step(ddp, model.router, hp, opt, loader, ranks.Dist(rank=rank, world=2),
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
        train_files=f"{REPO}/data/sample/sample_train_*.bin",
        batch_size=4,
        device_batch_size=2,
    )
    masked = steered_model(hp)
    loader = tg.DistributedLoader(hp.train_files, 4, 32, 0, 1, hp.vocab_size)
    x, y = loader.next_batch()  # the global batch: rows 0-1 rank 0's, rows 2-3 rank 1's
    with torch.no_grad():
        counts = [routers.packed_counts(masked(x[r : r + 2]).route).tolist() for r in (0, 2)]
    lengths = routers.packed_lengths([counts[0]], 32)
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
