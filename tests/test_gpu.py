"""The CUDA tests (skipped without CUDA) and gpu_check.sh's dry run on CPU.

On a GPU machine gpu_check.sh runs `python -m pytest -q -k cuda -rs` (these) with the GPU
benchmarks, and writes a record.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import fields, replace

import pytest
import torch

import routers
import train_gpt as tg
from conftest import (
    REPO,
    assert_close_rel,
    cuda,
    grads,
    read_metrics,
    run_command,
    spread_gates,
    start_command,
    tiny,
    wait_for_line,
)

# ----------------------------------------------------------- CUDA (skipped without)


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
    import torch._dynamo

    torch.manual_seed(0)
    hp = tiny(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=4, max_seq_len=128, seq_len=128, attn_impl="flex"
    )
    eager = tg.GPT(hp).cuda()
    spread_gates(eager)
    compiled_raw = tg.GPT(hp).cuda()
    compiled_raw.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = tg.compile_model(compiled_raw)
    idx = torch.randint(0, 97, (4, 128), device="cuda")
    l0, g0 = cuda_step(eager, idx)
    torch._dynamo.utils.counters.clear()  # (eager's Flex is compiled too: its graphs not counted)
    l1, g1 = cuda_step(compiled, idx)
    # compiled it was (compile_model works in place: compiling nothing, eager would match eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # a block's, the readout's
    assert (l0 - l1).abs().item() < 1e-4
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_close_rel(g0[name], g1[name], 1e-3)


@cuda
def test_cuda_bf16_autocast_logits_are_close_to_fp32():
    # bf16 moves the logits (autocast took effect) by at most 6% of their largest magnitude: 1.9%
    # under CPU autocast, the same model and batch; logits collapsed to each row's mean would
    # move by 98% (the loss moved by less than its margin: a loss compared nothing)
    torch.manual_seed(0)
    model = tg.GPT(tiny(n_layers=4, dim=64, max_seq_len=128, seq_len=128)).cuda()
    spread_gates(model)
    idx = torch.randint(0, 97, (4, 128), device="cuda")
    with torch.no_grad():
        fp32 = model(idx).logits.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(idx).logits.float()
    moved = (bf16 - fp32).abs().max().item()
    assert 0 < moved <= 0.06 * fp32.abs().max().item(), (moved, fp32.abs().max().item())


@cuda
def test_cuda_compact_path_compiles_each_packed_length_once_and_never_syncs(strict_dynamo):
    # Inductor and Flex through the packed lengths the packing makes (every block at one unit
    # and at full length, a mixed vector and its lengths at other blocks, then each step's own
    # as train_step sets them): no crash, no graph break, one graph per length whatever the
    # vector (the blocks share it) and one of the readout, and once compiled a forward and
    # backward pass that never waits for the GPU (torch.cuda.set_sync_debug_mode: any sync an
    # error). Few lengths and steps, as each new length compiles a graph (with ten steps, 180 s
    # on an H200, records/2026-11-28_gpu_check_NVIDIA_H200)
    import torch._dynamo

    torch._dynamo.reset()  # (strict_dynamo: giving up fails)
    torch.manual_seed(0)
    T, unit = 256, 256 // routers.PACKS
    hp = tiny(
        n_layers=4, dim=256, n_heads=4, n_kv_heads=4, max_seq_len=T, seq_len=T, compact=True,
        attn_impl="flex",
    )  # fmt: skip
    raw = tg.GPT(hp).cuda()
    spread_gates(raw)
    model = tg.compile_model(raw)
    counts = torch._dynamo.utils.counters
    counts.clear()
    given = [[T] * 4, [unit] * 4, [unit, T, 2 * unit, T - unit], [T - unit, unit, T, 2 * unit]]
    lengths = set()
    for step in range(len(given) + 2):  # the given vectors, then each batch's own counts
        if step < len(given):
            raw.router.lengths = given[step]
        lengths.add(tuple(raw.router.lengths))
        idx = torch.randint(0, 97, (4, T), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, targets=torch.roll(idx, -1, 1))
        out.loss.backward()
        assert out.loss.isfinite()
        raw.router.lengths = routers.packed_lengths([routers.packed_counts(out.route).tolist()], T)
    shapes = {n for v in lengths for n in v}
    graphs = len(shapes) + 1  # a block's per packed length, the readout's
    assert counts["stats"]["unique_graphs"] == graphs, (dict(counts["stats"]), shapes)
    assert not counts["graph_break"], dict(counts["graph_break"])
    raw.router.lengths = given[2]  # compiled already, under autocast (a guard): training's graphs

    def bf16_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, targets=torch.roll(idx, -1, 1))
        out.loss.backward()

    bf16_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bf16_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert counts["stats"]["unique_graphs"] == graphs  # no new graph: the ones checked above


# ----------------------------------------------------- gpu_check.sh, dry-run on CPU


@pytest.mark.slow
def test_gpu_check_refuses_bad_input_before_writing_and_stops_on_a_signal(tmp_path):
    # bad input: one line, status 2, nothing written (a budget is read in bash arithmetic, where
    # a name or an expression runs); OUT is the caller's, new or the script's own, one call at a
    # time; Ctrl-C stops the stage in flight (in its own process group) and the call
    script, tmp = os.path.join(REPO, "gpu_check.sh"), tmp_path / "tmp"
    tmp.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("x")
    for name, make in (("pipe", os.mkfifo), ("dir", os.mkdir)):  # .gpu_check not a file: opening
        (tmp_path / name).mkdir()  # a pipe to write would wait for a reader
        make(tmp_path / name / ".gpu_check")
    kept = ["a_file", "dir", "mine", "pipe", "tmp"]  # (a refusal writes nothing)
    env = {"GPU_CHECK_DRY_RUN": "1", "OMP_NUM_THREADS": "2", "TMPDIR": str(tmp)}
    ran = tmp_path / "ran"
    for seconds, out, extra, said in (
        ("1.5", "new", {}, "GPU_CHECK_SECONDS=1.5: give a whole number"),
        ("0", "new", {}, "GPU_CHECK_SECONDS=0: give"),
        (f"tiny[$(touch {ran})0]", "new", {}, "GPU_CHECK_SECONDS=tiny"),
        ("60", "mine", {}, f"{mine} holds files this script did not write"),
        ("60", "a_file", {}, f"{tmp_path / 'a_file'} is not a folder"),
        ("60", "pipe", {}, f"{tmp_path / 'pipe' / '.gpu_check'} is not a file"),
        ("60", "dir", {}, f"{tmp_path / 'dir' / '.gpu_check'} is not a file"),
        ("60", "new", {"TMPDIR": str(tmp_path / "a_file")}, f"TMPDIR={tmp_path / 'a_file'} is not"),
        ("60", "--out", {}, "--out: no such option (usage: bash gpu_check.sh [OUT]; a folder"),
    ):
        r = run_command(  # (a refusal takes a second: a hang, as at a pipe, fails in 60)
            script,
            out,
            env={**env, "GPU_CHECK_SECONDS": seconds, **extra},
            cwd=tmp_path,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.startswith(f"error: {said}"), r.stderr
        assert r.stderr.count("\n") == 1 and r.stdout == "", r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == kept
        assert not list(tmp.iterdir()) and os.listdir(mine) == ["notes.txt"]
    for ask in ("-h", "--help"):  # its comments, as the Python commands' --help; nothing run
        r = run_command(script, ask, env=env, cwd=tmp_path)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert r.stdout.startswith("Every GPU check in one call") and "\n# " not in r.stdout
        assert r.stdout.endswith("(tests/test_gpu.py runs it so).\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    # a relative OUT and TMPDIR are the caller's; a second call on it while one runs is refused;
    # Ctrl-C, and the call to make again, quoted as a shell reads it (OUT holds a space)
    env = {**env, "GPU_CHECK_SECONDS": "300", "TMPDIR": "tmp"}
    proc = start_command(script, "rel out", env=env, cwd=tmp_path)
    try:
        wait_for_line(proc, "== paper_none", timeout=200)
        r = run_command(script, "rel out", env=env, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("error: another call is writing "), r
        time.sleep(3)  # (in its run)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    again = f"run 'bash gpu_check.sh {tmp_path}/rel\\ out' again"
    assert re.fullmatch(
        f"stopped by a signal in [0-9]+ s; {re.escape(again)}\n", proc.stderr.read()
    )
    assert (tmp_path / "rel out" / "env.done").exists() and not os.path.exists(
        os.path.join(REPO, "rel out")
    )
    assert not list(tmp.glob("gpu_check_runs_*"))  # the stage's run: removed by its TERM handler


@pytest.mark.slow
def test_gpu_check_dry_runs_every_stage_on_cpu_in_one_call_within_its_budget(tmp_path):
    # GPU_CHECK_DRY_RUN=1: gpu_check.sh on CPU at a tiny size. A call ends within its budget
    # (GPU_CHECK_SECONDS; a stage in flight is cut, its status not taken for a result, and no
    # other starts); the next call runs what is left; with room, one call runs every stage; a
    # failed stage is run again by the next call, which exits 1. OUT holds a space: the command
    # each call says to run again reads back as the same OUT
    out = tmp_path / "check out"
    (tmp_path / "tmp").mkdir()  # its runs' folders go here (TMPDIR), removed once used
    env = {"GPU_CHECK_DRY_RUN": "1", "OMP_NUM_THREADS": "2", "TMPDIR": str(tmp_path / "tmp")}

    def call(seconds, status=0):
        t0 = time.monotonic()
        r = run_command(
            os.path.join(REPO, "gpu_check.sh"),
            out,
            env={**env, "GPU_CHECK_SECONDS": str(seconds)},
            timeout=600,
        )
        assert r.returncode == status, r.stdout[-2000:] + r.stderr[-2000:]
        summary = (out / "summary.txt").read_text().splitlines()
        (out / "summary.txt").unlink()
        return r.stdout.rstrip().split("\n")[-1], summary, time.monotonic() - t0

    stages = ["env", "paper_none", "paper_skip_middle", "paper_masked", "paper_compact", "bench"]
    stages += ["tests"]
    said, first, took = call(8)  # the whole dry run takes far longer
    # the budget, a margin, and the time a cut stage's TERM handler took (the script allows 30 s)
    assert took < 8 + 10 + 5, took
    assert [line.split(":")[0] for line in first] == stages, said
    done = [line.split(":")[0] for line in first if re.match(r"\w+: exit 0, \d+ s", line)]
    left = [line for line in first if line.split(":")[0] not in done]
    assert left and all(re.search(r"cut at \d+ s|not run, the budget of 8 s", ln) for ln in left)
    assert sorted(p.stem for p in out.glob("*.done")) == sorted(done)
    assert said.startswith("stopped by the budget in "), said
    again = re.fullmatch(r".* left: run '(.*)' again", said)
    assert again and shlex.split(again[1]) == ["bash", "gpu_check.sh", str(out)], said
    assert said.split(", ")[1].split(" left:")[0].split() == stages[len(done) :], said
    said, second, _ = call(600)
    assert [line.split(":")[0] for line in second] == stages[len(done) :], said
    assert all(re.match(r"\w+: exit 0, \d+ s", line) for line in second), second
    assert said.startswith("done in "), said
    summary = dict(line.split(":", 1) for line in first[: len(done)] + second)
    assert re.search(r"redone: \d+ of 30 steps", summary["paper_compact"]), summary
    assert "redone: 0 of 30 steps" in summary["paper_none"], summary  # (dense: none redone)
    assert summary["bench"].count("(target ") == 3 and "FLOP ideal" in summary["bench"], summary
    # a table per sparsity, model and pass (forward, forward+backward), on CPU by host time alone
    assert (out / "bench" / "profile.md").read_text().count("## smoke at sparsity") == 4 * 2 * 2
    # the CUDA tests (skipped here) in one process, the compacted path's among them
    assert re.search(r"\d+ skipped, .* in [\d.]+s$", summary["tests"]), summary
    compact = test_cuda_compact_path_compiles_each_packed_length_once_and_never_syncs.__code__
    skipped = re.findall(r"SKIPPED \[1\] (\S+):", (out / "tests.txt").read_text())
    assert f"tests/test_gpu.py:{compact.co_firstlineno}" in skipped, skipped
    for n in stages[1:3]:  # the stage's learning check: a loss under one that blocks doing
        # nothing reach (9.47 at this size, by hand)
        val = [r["val_loss"] for r in read_metrics(out / n) if r["kind"] == "val"]
        assert (out / f"{n}.txt").read_text().splitlines()[-1] == (
            f"validation loss at step 0 {val[0]:.4f}, at the last step {val[-1]:.4f} (a run "
            f"that learns ends under 9.0)"
        )
        assert val[-1] < 9.0 < val[0]
    assert not list((tmp_path / "tmp").glob("gpu_check_runs_*"))  # the checkpoints: gone once used
    # paper_masked and paper_compact: one run from paper_skip_middle's weights, compact or not
    config = {n: json.loads((out / n / "config.json").read_text()) for n in stages[2:5]}
    assert [c["compact"] for c in config.values()] == [False, False, True]
    hp = {n: {f.name: c[f.name] for f in fields(tg.Hyperparameters)} for n, c in config.items()}
    assert hp["paper_masked"] == hp["paper_skip_middle"]
    assert hp["paper_compact"] == {**hp["paper_masked"], "compact": True}
    sources = {config[n]["job"]["init_from"] for n in stages[3:5]}
    assert len(sources) == 1 and sources.pop().endswith("/paper_skip_middle"), config
    val = {
        n: [r["val_loss"] for r in read_metrics(out / n) if r["kind"] == "val"] for n in stages[2:5]
    }
    for n in stages[3:5]:  # validation at step 0: the weights paper_skip_middle ended with
        assert abs(val[n][0] - val["paper_skip_middle"][-1]) < 1e-5, val
    said = (out / "paper_compact.txt").read_text().splitlines()[-1]  # the stage's comparison
    assert said == (
        f"validation loss at step 0: masked {val['paper_masked'][0]:.4f}, compact "
        f"{val['paper_compact'][0]:.4f}; at the last step: masked {val['paper_masked'][-1]:.4f}, "
        f"compact {val['paper_compact'][-1]:.4f}"
    )
    # the gates closed (gated=, the dry run's), so that compact packed, at step 0's validation
    # and at step 1 (the same weights) on tokens of every sequence
    train = [r for r in read_metrics(out / "paper_compact") if r["kind"] == "train"]
    assert routers.packed_length(int(min(train[0]["packed"])), 64) < 64, train[0]
    # a stage that fails is not done: the next call runs it again (paper_none, refused here by a
    # folder of its name that it did not make, left alone, as are the earlier call's logs, not
    # summarised), skips the others and exits 1
    cksum = subprocess.run(
        ["cksum"], input=f"{os.path.realpath(out)}\n", capture_output=True, text=True
    )
    key = cksum.stdout.split()[0]  # (gpu_check.sh's $work)
    blocker = tmp_path / "tmp" / f"gpu_check_runs_{key}" / "paper_none"
    blocker.mkdir(parents=True)
    (out / "paper_none.done").unlink()
    said, third, _ = call(600, status=1)
    assert len(third) == 1 and re.fullmatch(r"paper_none: exit 2, \d+ s", third[0]), third
    assert blocker.is_dir() and len(list((out / "paper_none").iterdir())) == 3, third
    assert said.startswith("failed in ") and " paper_none (" in said, said
    assert "is there, not made by this script" in (out / "paper_none.txt").read_text()
    assert not (out / "paper_none.done").exists()
