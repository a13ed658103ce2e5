"""bench.py: masked against compacted blocks side by side, its target lines, its compiles and
its profile (sweep.py and the records' scripts: tests/test_sweep.py)."""

import json
import math
import os
import re
from functools import partial

import pytest
import torch

import fileio
import support
import train_gpt as tg
from conftest import TINY_RUN, load_command, run_main, signal_at_each_write


def test_bench_times_its_passes_side_by_side_each_by_its_median(monkeypatch):
    # bench.timed: each round calls every pass once, in turn (the models' figures from the same
    # stretch of the machine's time), and each pass's figure is the median of its own calls,
    # with the wait for the device (sync) and, host_, without
    bench = load_command("bench.py")
    now, calls = [0.0], []
    took = {"masked": iter([3.0, 1.0, 2.0]), "compact": iter([5.0, 4.0, 9.0])}
    waits = iter([0.125, 0.5, 0.0625, 0.25] * 3)  # before and after each call: device work

    def call(name):
        calls.append(name)
        now[0] += next(took[name])

    def sync():
        now[0] += next(waits)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    medians = bench.timed({n: partial(call, n) for n in took}, 3, sync)
    assert calls == ["masked", "compact"] * 3
    assert medians == {"masked": 2.5, "compact": 5.25, "host_masked": 2.0, "host_compact": 5.0}


def test_evaluation_time_is_each_models_median_per_token_in_ms(monkeypatch):
    # bench.timed's medians (seconds, fixed here) over a batch of 2 x 8 tokens: ms per token,
    # each model's its own, each model called once before (its warm-up; where compiled, its
    # compile)
    sweep, called = load_command("sweep.py"), []

    def timed(calls, repeats, sync):  # (after each model's warm-up)
        assert repeats == 3 and sorted(calls) == sorted(called) == ["compact", "masked"]
        return {"masked": 0.2, "compact": 0.1}

    monkeypatch.setattr(sweep.bench, "timed", timed)
    models = {k: (lambda idx, k=k: called.append(k)) for k in ("masked", "compact")}
    ms = sweep.eval_ms_per_token(models, torch.zeros(2, 8, dtype=torch.long))
    assert ms == pytest.approx({"masked": 1000 * 0.2 / 16, "compact": 1000 * 0.1 / 16})


def test_bench_target_lines_compare_each_target_and_give_the_mfu():
    bench = load_command("bench.py")
    rows = [
        dict(target=p, sparsity=p, fb_speedup=s, fb_eff=e, fb_mfu_masked=0.3614 if p == 0 else 0.5)
        for p, s, e in ((0.0, 0.96, 0.96), (0.25, 1.1, 0.9), (0.5, 1.3, 0.79), (0.75, 2.0, 0.84))
    ]
    assert bench.target_lines("paper", rows) == [
        "paper at sparsity 0.0: 0.96 speedup (masked / compact time) (target 0.95): met",
        "paper at sparsity 0.5: 0.79 of the FLOP ideal (target 0.8): not met",
        "paper at sparsity 0.75: 0.84 of the FLOP ideal (target 0.8): met",
        "paper: MFU of the masked model at sparsity 0, fwd+bwd: 36.1%",
    ]
    # a row whose forced sparsity missed its target (a batch of one token forces none) is not
    # judged, whatever its figure: a target is met only at its sparsity
    rows[2]["sparsity"], rows[3]["sparsity"] = 0.479, 0.771
    assert bench.target_lines("paper", rows)[1:3] == [
        "paper at sparsity 0.5: reached 0.479: not judged",
        "paper at sparsity 0.75: reached 0.771: not judged",
    ]
    rows[2]["sparsity"], rows[3]["sparsity"] = 0.481, 0.769  # (within 0.02: judged)
    assert bench.target_lines("paper", rows)[1:3] == [
        "paper at sparsity 0.5: 0.79 of the FLOP ideal (target 0.8): not met",
        "paper at sparsity 0.75: 0.84 of the FLOP ideal (target 0.8): met",
    ]


def test_bench_rows_fill_the_headers_columns_each_with_its_own_figure():
    # format_row against HEADER, column by column: times in ms (seconds x 1000), one decimal;
    # ratios two decimals; the sparsity three; compile seconds one
    bench = load_command("bench.py")
    row = dict(
        size="tiny",
        sparsity=0.5,
        fwd_masked=0.002,
        fwd_compact=0.001,
        fwd_speedup=2.0,
        fb_masked=0.006,
        fb_compact=0.004,
        fb_speedup=1.5,
        ideal=1.6,
        fwd_eff=1.25,
        fb_eff=0.9375,
        compile_masked=1.5,
        compile_compact=2.5,
        host_fwd_masked=0.0007,
        host_fwd_compact=0.0003,
        host_fb_masked=0.0031,
        host_fb_compact=0.0012,
    )
    header, rule = bench.HEADER.split("\n")
    names = [cell.strip() for cell in header.strip("| ").split("|")]
    cells = [cell.strip() for cell in bench.format_row(row).strip("| ").split("|")]
    assert len(rule.strip("|").split("|")) == len(names) == len(cells)
    assert dict(zip(names, cells, strict=True)) == {
        "size": "tiny",
        "sparsity": "0.500",
        "fwd masked ms": "2.0",
        "fwd compact ms": "1.0",
        "fwd speedup": "2.00",
        "fwd+bwd masked ms": "6.0",
        "fwd+bwd compact ms": "4.0",
        "fwd+bwd speedup": "1.50",
        "ideal (FLOPs)": "1.60",
        "fwd eff": "1.25",
        "fwd+bwd eff": "0.94",
        "compile s masked": "1.5",
        "compile s compact": "2.5",
        "fwd host ms masked / compact": "0.7 / 0.3",
        "fwd+bwd host ms masked / compact": "3.1 / 1.2",
    }


def test_bench_target_lines_count_a_figure_at_its_target_as_met():
    bench = load_command("bench.py")
    rows = [
        dict(target=p, sparsity=p, fb_speedup=s, fb_eff=e)
        for p, s, e in ((0.0, 0.95, 0.95), (0.25, 1.0, 0.5), (0.5, 1.6, 0.8), (0.75, 3.2, 0.8))
    ]
    assert [line.split(": ")[-1] for line in bench.target_lines("tiny", rows)] == ["met"] * 3


def test_bench_refuses_zero_repeats_before_anything_is_written(tmp_path, capsys):
    # a median of no timings does not exist: --repeats=0 is bad input, one line, no folder
    bench = load_command("bench.py")
    code, out, err = run_main(["--repeats=0", f"--out={tmp_path / 'b'}"], capsys, bench.main)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --repeats: expected int in [1, 1000], got '0'")
    assert not (tmp_path / "b").exists()


def test_benches_started_in_one_second_each_write_a_folder_of_their_own(monkeypatch):
    # the default folder (no --out): dated to the second, and a random part, so that the second
    # does not take the first's bench.md as its own and replace it
    bench, chosen = load_command("bench.py"), []

    def writable_dir(path, names, by):  # the folder each would write: then no further
        chosen.append(path)
        raise support.UserError("stop here")

    monkeypatch.setattr(bench.time, "strftime", lambda *args: "2026-11-30_093000")
    monkeypatch.setattr(bench.fileio, "writable_dir", writable_dir)
    for _ in range(2):
        with pytest.raises(support.UserError, match="stop here"):
            bench.main([])
    prefix = os.path.join("logs", "2026-11-30_093000_skip_bench_cpu_")
    assert all(p.startswith(prefix) for p in chosen) and len(set(chosen)) == 2, chosen


def test_bench_forces_each_sparsity_and_works_out_speedup_and_efficiency(monkeypatch, capsys):
    # a row per target p: the share of zero gates forced is p (a batch of 4 x 64 tokens, to
    # a token or two); the ideal is 1 at p = 0, else, a share s of the tokens skipping, above
    # 1 and at most 1 / (1 - s)^2 (attention's work falls with the square of the share run,
    # the rest with the share; a vocabulary of 256: the head's, which stays, is small); speedup
    # = masked / compact wall time and efficiency = speedup / ideal, from timed's medians (fixed
    # here: the compacted model 1.5x and 2x as fast; the host's times, the same for each); the
    # masked model's MFU from its own time, at a peak given; nothing compiled, so no warning
    bench = load_command("bench.py")
    size = dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=4, max_seq_len=64, seq_len=64)
    monkeypatch.setitem(bench.SIZES, "tiny", ({**size, "vocab_size": 256}, 4))
    monkeypatch.setattr(support, "peak_flops", lambda name: 1e12)
    medians = dict(fwd_masked=0.3, fwd_compact=0.2, fb_masked=0.8, fb_compact=0.4)
    calls = []

    def timed(fns, repeats, sync):
        calls.append((sorted(fns), repeats))
        return {**medians, **{f"host_{k}": 0.1 for k in medians}}

    monkeypatch.setattr(bench, "timed", timed)
    hp, batch, rows = bench.bench_size("tiny", "cpu", 3, False)
    assert batch == 4 and [r["target"] for r in rows] == list(bench.SPARSITY)
    mfu = 3 * tg.forward_flops(hp) * 4 / 0.8 / 1e12  # the batch's 3 F of work over its time
    assert calls == [(sorted(medians), 3)] * 4
    for r in rows:
        assert abs(r["sparsity"] - r["target"]) <= 2 / (4 * 64), r
        if r["target"] == 0:
            assert r["ideal"] == 1.0
        else:  # (forward_flops: FlopCounterMode's count, test_train.py)
            assert 1 < r["ideal"] <= 1 / (1 - r["sparsity"]) ** 2, r
            active = [1 - r["sparsity"]] * hp.n_layers  # (each block's share, to a token)
            ideal = tg.forward_flops(hp) / tg.forward_flops(hp, active)
            assert r["ideal"] == pytest.approx(ideal, rel=0.01)
        assert (r["fwd_speedup"], r["fb_speedup"]) == pytest.approx((1.5, 2.0))
        assert r["fwd_eff"] == pytest.approx(1.5 / r["ideal"])
        assert r["fb_eff"] == pytest.approx(2.0 / r["ideal"])
        assert r["fb_mfu_masked"] == pytest.approx(mfu, rel=1e-9)
        assert r["compile_masked"] == r["compile_compact"] == 0
    assert capsys.readouterr().err == ""


def test_a_signal_during_a_bench_s_writes_leaves_its_files_of_one_bench(
    tmp_path, monkeypatch, capsys
):
    # Ctrl-C as each file is written over an earlier bench's: held till the last is written,
    # then the command stops (130), bench.md and bench.json both the new bench's
    bench = load_command("bench.py")
    size = dict(n_layers=2, dim=32, n_heads=2, n_kv_heads=2, max_seq_len=32, seq_len=32)
    monkeypatch.setitem(bench.SIZES, "tiny", ({**size, "vocab_size": 256}, 2))
    argv = ["--size=tiny", "--repeats=1", f"--out={tmp_path}"]
    for compact, cli_code in ((0.4, 0), (0.2, 130)):  # the second: 2x and 4x where 1x, 2x
        medians = dict(fwd_masked=0.4, fwd_compact=compact, fb_masked=0.8, fb_compact=compact)
        times = {**medians, **{f"host_{k}": 0.1 for k in medians}}
        monkeypatch.setattr(bench, "timed", lambda fns, repeats, sync, times=times: times)
        if cli_code:
            signal_at_each_write(monkeypatch)
        assert run_main(argv, capsys, bench.main)[0] == cli_code
    rows = json.loads((tmp_path / "bench.json").read_text())["results"][0]["rows"]
    assert [(r["fwd_speedup"], r["fb_speedup"]) for r in rows] == [(2.0, 4.0)] * 4
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| 400.0 | 200.0 | 2.00 | 800.0 | 200.0 | 4.00 |") == 4, table  # its rows


@pytest.mark.slow
def test_bench_times_a_source_alone_at_its_own_batch_and_refuses_one_without_a_compact_path(
    tmp_path, capsys
):
    # --init_from alone: that model timed (no default size), at its device_batch_size, named
    # by its source in bench.json and bench.md; a dense model (no gates to skip by), or one
    # gated on the query axis: refused in one line before anything is written
    run = tmp_path / "run"
    code, _, err = run_main(TINY_RUN + ["--stop_step=1", f"--run_dir={run}"], capsys)
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    bench = load_command("bench.py")
    out = tmp_path / "bench out"  # (a space: its command is recorded as a shell reads it back)
    code, _, err = run_main(
        [f"--init_from={run}", "--repeats=1", f"--out={out}"], capsys, bench.main
    )
    assert code == 0, err
    record = json.loads((out / "bench.json").read_text())
    assert (record["repeats"], record["device"]) == (1, "cpu")
    assert [(r["size"], r["batch"]) for r in record["results"]] == [
        (str(run), config["device_batch_size"])
    ]
    page = (out / "bench.md").read_text()
    assert f"batch per size: {run}={config['device_batch_size']}; median of 1 " in page
    assert f"    python bench.py --init_from={run} --repeats=1 '--out={out}'\n" in page
    for setting, message in (  # a gate on the query axis: skipped tokens are still keys
        ("--router=none", "bench.py times skip_middle's compact path; this model's router is none"),
        ("--gate_axis=query", "needs the gate on the key axis; this model's is on the query"),
    ):
        source = tmp_path / setting[2:]
        code, _, err = run_main(
            TINY_RUN + [setting, "--stop_step=1", f"--run_dir={source}"], capsys
        )
        assert code == 0, err
        code, out, err = run_main(
            [f"--init_from={source}", f"--out={tmp_path / 'b'}"], capsys, bench.main
        )
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_bench_compiles_a_bounded_number_of_graphs_and_times_them(monkeypatch, strict_dynamo):
    # bench.py times a masked and a compacted model, their blocks compiled, at four sparsities:
    # per grad mode one graph for the masked model, one per packed length, shared by the
    # blocks and the sparsities, and the readout's (with targets, and without: fit_lengths'
    # forward), shared by both models; each row's compile columns hold the graphs its calls
    # compiled (the first row's, its forced gates and fitted lengths included), none where
    # none is new; profiled once every row is timed, at the timed lengths, compiling nothing.
    # On CPU through AOTAutograd, no Inductor, with SDPA: Dynamo's decisions are the same. No
    # CUDA case (84 s of gpu_check.sh's budget, records/2026-11-28_gpu_check_NVIDIA_H200): on a
    # GPU, bench.py fails rather than time a region past the graph limit, and the compacted
    # path's CUDA test counts the graphs per packed length under Flex, with gradients; bench's
    # no-grad passes and profile under Flex and Inductor have their graphs counted nowhere
    import torch._dynamo

    import runlog

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
    fitted, fit = [], bench.fit_lengths

    def fit_lengths(raw, idx):  # the packed lengths each sparsity is timed at
        fit(raw, idx)
        fitted.append(tuple(raw.router.lengths))

    monkeypatch.setattr(bench, "fit_lengths", fit_lengths)
    torch._dynamo.reset()
    torch.manual_seed(0)
    counts = torch._dynamo.utils.counters
    counts.clear()
    before = runlog.compile_ms()
    _, _, rows = bench.bench_size("tiny", "cpu", 1, True, profile=True)
    # each model's forward and forward+backward profiled (on CPU by host time alone)
    assert all(len(r["profiles"]) == 2 * 2 and all(t for _, t in r["profiles"]) for r in rows)
    columns = sum(r["compile_masked"] + r["compile_compact"] for r in rows)
    assert math.isclose(runlog.compile_ms() - before, 1000 * columns, abs_tol=1e-6)
    assert len(fitted) == 8 and fitted[4:] == fitted[:4]  # (timed, then profiled)
    fitted = fitted[:4]
    lengths = {n for v in fitted for n in v}
    assert len(lengths) < 4 * 4
    graphs = 1 + len(lengths) + 2  # the masked model's, one per packed length, the readout's
    assert counts["stats"]["unique_graphs"] <= 2 * graphs, dict(counts["stats"])
    assert not counts["graph_break"], dict(counts["graph_break"])
    assert rows[0]["compile_masked"] > 0 and rows[0]["compile_compact"] == 0
    assert all(r["compile_masked"] == 0 for r in rows[1:])  # its one shape: compiled once
    # a new length, a new graph; at sparsity 0 every block packs to every position (256) and
    # runs as masked, with masked's graphs: none new
    new = [bool(set(v) - {256}.union(*fitted[:i])) for i, v in enumerate(fitted)]
    assert [r["compile_compact"] > 0 for r in rows] == new


@pytest.mark.slow
def test_bench_profile_gives_each_rows_operators_per_model(tmp_path, monkeypatch, capsys):
    # --profile=1: profile.md, a table per row, model and pass (forward, forward+backward; on
    # CPU by host time alone), every operator here (PROFILE_ROWS), so that forward_compact's
    # scatter shows in each compacted table where tokens skip, and in no masked one: each
    # profiles its own model and pass (at sparsity 0 every compacted block runs at full length,
    # as masked: no packing; forward alone, no scatter's backward)
    bench = load_command("bench.py")
    size = dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=4, max_seq_len=64, seq_len=64)
    monkeypatch.setitem(bench.SIZES, "tiny", (size, 4))
    monkeypatch.setattr(bench, "PROFILE_ROWS", 1000)
    argv = ["--size=tiny", "--repeats=1", "--profile=1", f"--out={tmp_path}"]
    code, _, err = run_main(argv, capsys, bench.main)
    assert code == 0, err
    rows = json.loads((tmp_path / "bench.json").read_text())["results"][0]["rows"]
    assert not [k for r in rows for k in r if k.startswith("profile")]  # (figures only)
    sections = (tmp_path / "profile.md").read_text().split("## ")[1:]
    passes = ("fwd", "fwd+bwd")
    tables = [(r["sparsity"], m, kind) for r in rows for m in bench.MODELS for kind in passes]
    titles = [f"tiny at sparsity {p:.3f}, {m}, {kind}, by host time" for p, m, kind in tables]
    assert [s.split("\n")[0] for s in sections] == titles
    for section, (sparsity, model, kind) in zip(sections, tables, strict=True):
        packs = model == "compact" and sparsity > 0
        assert bool(re.search(r" aten::scatter ", section)) == packs, section
        assert bool(re.search(r" ScatterBackward", section)) == (packs and kind != "fwd")
    # rerun there without --profile: its profile.md, of other figures, is removed; a user's, kept
    for edit, kept in (("", False), ("mine", True)):
        if edit:
            (tmp_path / "profile.md").write_text(edit)
        assert run_main(argv[:2] + [f"--out={tmp_path}"], capsys, bench.main)[0] == 0
        assert (tmp_path / "profile.md").exists() == kept  # (and recorded as ours no more)
        assert "profile.md" not in fileio.written_outputs(str(tmp_path))
        assert "--profile" not in (tmp_path / "bench.md").read_text().split("\n")[0]
