"""The measurement harnesses: sweep.py (Figure 2's grid and its statistics) and the scripts
kept with the records (bench.py: tests/test_bench.py)."""

import json
import math
import re
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sources
import stats
import support
import train_gpt as tg
from conftest import (
    REPO,
    documents_by_hand,
    load_command,
    read_metrics,
    run_command,
    run_main,
    signal_at_each_write,
    write_shard,
)
from data import shards
from data.tokenize_corpus import shard_bytes

# --------------------------------------------- stats.py: the statistics of Figure 2


def test_student_t_and_holm_against_tables_and_closed_forms():
    for df, t975 in (
        (1, 12.706),
        (2, 4.303),
        (4, 2.776),
        (9, 2.262),
        (30, 2.042),
    ):  # printed tables
        assert stats.t_critical(0.05, df) == pytest.approx(t975, abs=6e-4)
        assert stats.t_tail(t975, df) == pytest.approx(0.05, abs=2e-4)
    assert stats.t_critical(0.4, 4) == pytest.approx(0.941, abs=6e-4)  # one-sided 0.80, df 4
    for t in (0.3, 1.0, 3.0, 20.0):  # closed forms: Cauchy (df 1) and df 2
        assert stats.t_tail(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-9)
        assert stats.t_tail(-t, 2) == pytest.approx(1 - t / math.sqrt(t * t + 2), abs=1e-9)
    for t in (1e3, 1e6, 1e9):  # small tails to their digits (1 - 2 atan(t) / pi would be 0)
        s = math.sqrt(t * t + 2)
        assert stats.t_tail(t, 1) == pytest.approx(2 * math.atan(1 / t) / math.pi, rel=1e-9, abs=0)
        assert stats.t_tail(t, 2) == pytest.approx(2 / (s * (s + t)), rel=1e-9, abs=0)
    # Holm by hand: sorted 0.005 0.01 0.03 0.04 times 4 3 2 1, then the running maximum
    assert stats.holm([0.01, 0.04, 0.03, None, 0.005]) == pytest.approx(
        [0.03, 0.06, 0.06, None, 0.02]
    )
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0]
    # differences equal up to rounding are not tested; ones a ten-millionth apart are (df 2)
    assert stats.paired([0.1 + 0.2, 0.3, 0.3])["p"] is None
    close = stats.paired([1.0, 1.0 + 1e-7, 1.0 + 2e-7])
    assert close["sd"] == pytest.approx(1e-7) and close["p"] < 1e-9


def summary_row(name, seed, flops, loss):
    """A runs.csv row as summarise reads it: timings in proportion to FLOPs (compact 2x faster)."""
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

    rows, a_losses = [], [3.40, 3.41, 3.39, 3.42, 3.38]
    for s in range(5):
        rows += [
            summary_row("dense_2", s, 1e6, 4.0 + 0.1 * s),
            summary_row("dense_4", s, 4e6, 3.0 + 0.1 * s),
        ]
    rows += [summary_row("gated_a", s, 2e6, loss + 0.1 * s) for s, loss in enumerate(a_losses)]
    rows += [
        summary_row("gated_b", s, 2e6, 3.5 + 0.1 * s + d)
        for s, d in enumerate([0.1, -0.1, 0.05, -0.05, 0])
    ]
    rows += [summary_row("gated_c", s, 8e6, 2.0) for s in range(5)]  # beyond the dense FLOPs range
    rows += [
        summary_row("dlo_control", s, 2e6, 3.5 + 0.1 * s + d)
        for s, d in enumerate([0.01, -0.01, 0.02, -0.02, 0])
    ]
    rows += [summary_row("dlo_rho0.5", s, 2e6, 3.6 + 0.1 * s + 0.001 * s) for s in range(5)]
    e_deltas = [0.05, 0.01, 0.03, 0.045, 0.005]  # raw p 0.036, not after Holm's correction
    rows += [summary_row("gated_e", s, 2e6, 3.5 + 0.1 * s + d) for s, d in enumerate(e_deltas)]
    rows += [
        summary_row("gated_f", s, 2e6, 3.55 + 0.1 * s) for s in range(5)
    ]  # the same in every seed
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows)}
    e = lines[("gated_e", "dense frontier")]
    # (scipy's ttest_1samp)
    assert e["p"] == pytest.approx(0.036167, abs=2e-6) and e["p_holm"] > 0.05
    # (its interval excludes 0, uncorrected, and says so: the corrected p finds nothing)
    assert e["verdict"] == "no detectable difference (uncorrected 95% CI [+0.003, +0.053])"
    assert e["detectable"] == pytest.approx(
        (stats.t_critical(0.05 / 6, 4) + 0.941) * e["sd"] / math.sqrt(5), rel=1e-3
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
    # Student's t with 4 df in closed form: P(|T| >= t) = 1 - sin(th) (1 + cos(th)^2 / 2),
    # th = atan(t / 2) (here t = -14.14, p = 1.45e-4, as scipy's ttest_1samp gives)
    theta = math.atan(abs(mean / (sd / math.sqrt(5))) / 2)
    p = 1 - math.sin(theta) * (1 + math.cos(theta) ** 2 / 2)
    assert a["p"] == pytest.approx(p, rel=1e-6) and a["verdict"] == "better than dense"
    b = lines[("gated_b", "dense frontier")]
    assert b["mean"] == pytest.approx(0, abs=1e-12) and b["p"] == pytest.approx(1.0)
    ci = f"[{b['lo']:+.3f}, {b['hi']:+.3f}]"
    assert b["verdict"] == f"no detectable difference (uncorrected 95% CI {ci})"
    assert lines[("gated_c", "dense frontier")]["verdict"] == "outside the dense FLOPs range"
    dlo = lines[("dlo_rho0.5", "dlo_control")]  # against its own control, seed by seed
    assert dlo["mean"] == pytest.approx(0.102) and dlo["verdict"] == "worse than dlo_control"
    assert lines[("dlo_control", "dense frontier")]["p"] == pytest.approx(1.0)
    tested = [ln for ln in lines.values() if ln.get("p") is not None]
    assert len(tested) == 6  # gated_a, gated_b, gated_e, dlo_control, dlo_rho0.5 twice
    holm = stats.holm([ln["p"] for ln in tested])
    assert [ln["p_holm"] for ln in tested] == pytest.approx(holm)
    assert lines[("dense_4", "")]["verdict"] == "frontier"
    assert a["dense_ms_at_equal_flops"] == pytest.approx(2.5e-3)  # (1e-3 + 4e-3) / 2, log midpoint
    text = sweep.verdict_text(list(lines.values()))
    assert text.startswith(
        "6 paired comparisons over 5 seeds, Holm-corrected: gated_a better than dense"
    )
    assert text.endswith(  # and what was not tested, with why
        ". Not tested: gated_c outside the dense FLOPs range; gated_f above (the same difference "
        "in every seed: no test)."
    )
    one_seed = sweep.summarise([r for r in rows if r["seed"] == 0])
    text = sweep.verdict_text(one_seed)
    assert text.startswith("no difference can be tested: gated_a below (one seed: no test); ")
    assert "gated_c outside the dense FLOPs range" in text
    # a run missing (dense_4's seed 0): each line says how many of the study's seeds it holds
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows[:1] + rows[2:])}
    assert lines[("dense_4", "")]["seeds"] == "4 of 5" and lines[("dense_2", "")]["seeds"] == 5
    assert lines[("gated_a", "dense frontier")]["seeds"] == "4 of 5"  # seed 0's frontier: none
    assert lines[("dlo_rho0.5", "dlo_control")]["seeds"] == 5
    # a seed with no dense run yet (a sweep part done): its other runs have no frontier
    some = [r for r in rows if r["seed"] or not r["name"].startswith("dense_")]
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(some)}
    a = lines[("gated_a", "dense frontier")]
    assert a["seeds"] == "4 of 5" and a["mean"] == pytest.approx(sum(deltas[1:]) / 4)
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows[:-1])}  # gated_f seed 4
    assert lines[("gated_f", "dense frontier")]["seeds"] == "4 of 5"
    equal = dict(mean=0.0, p_holm=None, n=5, vs="dense frontier")  # neither below nor above
    assert sweep.verdict(equal) == "equal (the same difference in every seed: no test)"


def test_each_seed_is_read_off_its_own_envelope_at_its_own_flops_by_hand():
    # three seeds; dense_6 no better than dense_4 (off the lower envelope, which stays flat to
    # 16e6); gated_x at other FLOPs in each seed: seed 0 a quarter of the way (in log FLOPs)
    # from dense_2 to dense_4, 3.75; seed 1 at 8e6, on the flat part, 3.1 (3.2 interpolated to
    # dense_6); seed 2 half way, 3.7. Its validation error: the largest of its seeds'
    sweep = load_command("sweep.py")
    rows = []
    for s in range(3):
        rows += [
            summary_row("dense_2", s, 1e6, 4.0 + 0.1 * s),
            summary_row("dense_4", s, 4e6, 3.0 + 0.1 * s),
            summary_row("dense_6", s, 16e6, 3.2 + 0.1 * s),
        ]
    for s, flops, loss, se in (
        (0, 1e6 * 4**0.25, 3.70, 0.01),
        (1, 8e6, 3.05, 0.03),
        (2, 2e6, 3.62, 0.02),
    ):
        rows.append({**summary_row("gated_x", s, flops, loss), "val_se": se})
    x = {ln["name"]: ln for ln in sweep.summarise(rows)}["gated_x"]
    deltas = [3.70 - 3.75, 3.05 - 3.1, 3.62 - 3.7]
    assert (x["n"], x["mean"]) == (3, pytest.approx(sum(deltas) / 3))
    assert x["sd"] == pytest.approx(math.sqrt((0.01**2 + 0.01**2 + 0.02**2) / 2))
    assert x["val_se"] == 0.03


def test_the_frontier_holds_exactly_its_slack_beyond_the_dense_range():
    sweep = load_command("sweep.py")
    at = sweep.frontier([(1e6, 4.0), (4e6, 3.0)])
    inside, outside = 0.0099, 0.0101  # in log FLOPs, either side of 1%: a gated model's gate
    # linears beyond the end dense point, not an extrapolation
    assert at(4e6 * math.exp(inside)) == 3.0 and at(1e6 * math.exp(-inside)) == 4.0
    assert at(4e6 * math.exp(outside)) is None and at(1e6 * math.exp(-outside)) is None


def test_the_statistics_and_the_frontier_at_their_edges_against_closed_forms():
    sweep = load_command("sweep.py")
    # a p-value is a probability even where t is huge (seeds that differ by a hair)
    for df in range(1, 10):
        for t in (1e4, 1e6, 1e9, 1e12):
            assert 0.0 <= stats.t_tail(t, df) <= 1.0, (t, df)
    # two seeds (df 1, Cauchy: P(|T| >= t) = 1 - 2 atan(t) / pi) and many tests (0.05 / 20)
    for tail in (0.05 / 8, 0.05 / 20, 1e-4):
        t = math.tan(math.pi / 2 * (1 - tail))
        assert stats.t_critical(tail, 1) == pytest.approx(t, rel=1e-6)
    # a small spread is still a spread: three seeds, df 2 (P(|T| >= t) = 1 - t / sqrt(t^2 + 2))
    deltas = [0.0200, 0.0205, 0.0210]
    mean = sum(deltas) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / 2)
    t = mean / (sd / math.sqrt(3))
    got = stats.paired(deltas)
    assert got["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-6)
    assert got["hi"] - got["mean"] == pytest.approx(4.303 * sd / math.sqrt(3), rel=1e-3)
    # no seed (every point outside the frontier's range) or one: a mean at most, no test
    assert stats.paired([]) == dict(n=0, mean=None, sd=None, lo=None, hi=None, p=None)
    assert stats.paired([0.5]) == dict(n=1, mean=0.5, sd=None, lo=None, hi=None, p=None)
    # Holm by hand: 0.6 x 2 = 1.2 is capped at 1, then 0.9 x 1 below the running maximum
    assert stats.holm([0.6, 0.9, None]) == [1.0, 1.0, None]
    # a dense point only as good as a cheaper one is no step of the envelope either
    env = sweep.frontier([(1e6, 4.0), (2e6, 4.0), (4e6, 3.0)])
    assert env(2e6) == pytest.approx(3.5)  # half way in log FLOPs from 4.0 at 1e6 to 3.0 at 4e6


def test_the_verdict_words_follow_holm_p_below_005_and_name_only_the_differences_found():
    sweep = load_command("sweep.py")
    found = dict(name="a", vs="dense frontier", n=5, mean=-0.0213, lo=-0.0301, hi=-0.0127)
    found.update(p=0.0021, p_holm=0.0063)
    assert sweep.verdict(found) == "better than dense"
    # p < 0.05, strictly: a Holm p of 0.05 finds nothing
    at = dict(found, p=0.0125, p_holm=0.05)
    assert sweep.verdict(at) == "no detectable difference (uncorrected 95% CI [-0.030, -0.013])"
    two = dict(mean=0.01, p_holm=None, n=2, vs="dense frontier")  # two seeds are not one
    assert sweep.verdict(two) == "above (the same difference in every seed: no test)"
    none = dict(name="b", vs="dense frontier", n=4, mean=0.0040, lo=-0.0100, hi=0.0180)
    none.update(p=0.41, p_holm=0.82, verdict="no detectable difference (uncorrected 95% CI [...])")
    lines = [
        dict(name="dense_2", vs="", n=5, verdict="frontier"),
        dict(found, verdict="better than dense"),
        none,
        dict(
            name="c",
            vs="dense frontier",
            n=1,
            mean=0.01,
            p_holm=None,
            verdict="above (one seed: no test)",
        ),
    ]
    # the differences found, each with its Holm p (not its raw p); the most seeds any test had
    assert sweep.verdict_text(lines) == (
        "2 paired comparisons over 5 seeds, Holm-corrected: a better than dense (-0.021, "
        "uncorrected 95% CI [-0.030, -0.013], Holm p = 0.0063). Not tested: c above (one seed: "
        "no test)."
    )
    assert sweep.verdict_text(lines[:1] + [none]) == (
        "1 paired comparison over 4 seeds, Holm-corrected: no detectable difference in any."
    )
    assert sweep.fmt(0.0) == "0.0000" and sweep.fmt(None) == ""  # a zero is no empty cell


def test_each_dlo_and_mor_point_of_a_grid_is_paired_with_its_control_in_that_grid():
    sweep = load_command("sweep.py")
    for grid in sweep.GRIDS.values():
        names = [name for name, *_ in grid["runs"]]
        for name in names:
            if name.startswith(("dlo_rho", "mor_")):  # DLO its dense expansion, MoR recursion
                assert sweep.control_of(name) in names, name
            else:
                assert sweep.control_of(name) is None, name

    rows = []
    for s in range(3):
        rows += [summary_row("dense_2", s, 1e6, 4.0), summary_row("dense_4", s, 4e6, 3.0)]
        rows += [summary_row("mor_r2", s, 2e6, 3.40 + 0.01 * s)]
    rows += [summary_row("recursive_r2", s, 2e6, 3.45) for s in (0, 1)]  # none for seed 2
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows)}
    mor = lines[("mor_r2", "recursive_r2")]  # seeds 0 and 1 only: -0.05 and -0.04
    assert (mor["seeds"], mor["n"]) == ("2 of 3", 2) and mor["mean"] == pytest.approx(-0.045)
    # tested on its two seeds (df 1, Cauchy's closed forms: t = -9), its smallest detectable
    # difference at Holm's first level over the grid's 2 tests (MoR against dense too)
    sd, quantile = 0.01 / math.sqrt(2), lambda tail: math.tan(math.pi / 2 * (1 - tail))
    assert mor["sd"] == pytest.approx(sd) and mor["p"] == pytest.approx(
        1 - 2 * math.atan(9) / math.pi, abs=1e-9
    )
    assert mor["hi"] - mor["mean"] == pytest.approx(quantile(0.05) * sd / math.sqrt(2), rel=1e-6)
    assert mor["detectable"] == pytest.approx(
        (quantile(0.05 / 2) + quantile(0.4)) * sd / math.sqrt(2), rel=1e-6
    )
    # a control in the grid, but for none of its seeds: not tested, and why
    alone = [r for r in rows if r["name"] != "recursive_r2" and r["seed"] < 2]
    alone += [summary_row("recursive_r2", 2, 2e6, 3.45)]
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(alone)}
    assert lines[("mor_r2", "recursive_r2")]["verdict"] == "no control run"
    assert "Not tested: mor_r2 no control run" in sweep.verdict_text(list(lines.values()))
    # a control not in the grid at all: no line against it
    lines = sweep.summarise([r for r in rows if r["name"] != "recursive_r2"])
    assert [(ln["name"], ln["vs"]) for ln in lines if ln["name"] == "mor_r2"] == [
        ("mor_r2", "dense frontier")
    ]
    # none for seed 0: seeds 1 and 2 each against its own, 3.41 - 3.47 and 3.42 - 3.49
    rows = [r for r in rows if r["name"] != "recursive_r2"]
    rows += [summary_row("recursive_r2", s, 2e6, 3.45 + 0.02 * s) for s in (1, 2)]
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows)}
    mor = lines[("mor_r2", "recursive_r2")]
    assert (mor["seeds"], mor["n"]) == ("2 of 3", 2) and mor["mean"] == pytest.approx(-0.065)
    # the SD over seeds of a configuration's loss, from two seeds on
    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(rows[:6])}
    assert lines[("mor_r2", "dense frontier")]["val_loss_sd"] == pytest.approx(0.01 / math.sqrt(2))


@pytest.mark.slow
def test_each_record_regenerates_its_table_to_the_byte_and_its_figure_draws_that_table(
    tmp_path, monkeypatch, capsys
):
    # a record's table comes from its committed runs.csv by the record's own command, cell for
    # cell (p beside Holm p, the largest val SE over seeds, ...); its figure draws that table:
    # left, each tested comparison at its row, its difference and 95% interval, labelled with
    # the Holm p its verdict follows, hollow against a control; right, each configuration at
    # its FLOPs and mean loss with the SD over seeds, in its left colour, the dense means joined
    # in FLOPs order (all read back from the table's rounded cells)
    import matplotlib.axes

    sweep, drawn = load_command("sweep.py"), []
    originals = {m: getattr(matplotlib.axes.Axes, m) for m in ("set_yticks", "errorbar", "plot")}

    def recorder(method):
        def recorded(self, *args, **kwargs):
            drawn.append((method, args, kwargs))
            return originals[method](self, *args, **kwargs)

        return recorded

    for method in originals:
        monkeypatch.setattr(matplotlib.axes.Axes, method, recorder(method))
    records = sorted(Path(REPO, "records").glob("*/runs.csv"))
    assert len(records) >= 3
    tested_in_all = 0
    for csv_path in records:
        out, drawn[:] = tmp_path / csv_path.parent.name, []
        out.mkdir()
        shutil.copy(csv_path, out / "runs.csv")
        code, _, err = run_main([f"--report={out / 'runs.csv'}"], capsys, sweep.main)
        assert code == 0, err
        table = (out / "table.md").read_text()
        assert table == (csv_path.parent / "table.md").read_text(), csv_path
        rows = table_rows(table, "| run | vs |")
        tested = [r for r in rows if r["vs"] and r["Holm p"]]
        routed = [
            r
            for r in rows
            if not r["run"].startswith("dense_") and r["vs"] in ("dense frontier", "")
        ]
        dense = sorted(
            (float(r["fwd MFLOPs/token"]), float(r["val CE (mean ± SD)"].split(" ± ")[0]))
            for r in rows
            if r["run"].startswith("dense_")
        )
        assert [a[1] for m, a, k in drawn if m == "set_yticks"] == [
            [f"{r['run']} - {r['vs']}\nHolm p = {float(r['Holm p']):.2g}" for r in tested]
        ]
        bars = [(a, k) for m, a, k in drawn if m == "errorbar"]
        left, right = bars[: len(tested)], bars[len(tested) :]
        colour = {}
        for y, (r, (a, k)) in enumerate(zip(tested, left, strict=True)):
            lo, hi = (float(c) for c in r["95% CI"].strip("[]").split(", "))
            (below,), (above,) = k["xerr"]
            assert a[1] == y and a[0] == pytest.approx(float(r["difference"]), abs=5e-5)
            assert (a[0] - below, a[0] + above) == pytest.approx((lo, hi), abs=5e-5)
            assert (k["mfc"] == "white") == (r["vs"] != "dense frontier")
            assert colour.setdefault(r["run"], k["color"]) == k["color"]
        assert len(right) == len(routed)
        for r, (a, k) in zip(routed, right, strict=True):
            mean, sd = (float(c) for c in r["val CE (mean ± SD)"].split(" ± "))
            assert k["label"] == r["run"] and a[0] / 1e6 == pytest.approx(
                float(r["fwd MFLOPs/token"]), abs=5e-4
            )
            assert (a[1], k["yerr"]) == pytest.approx((mean, sd), abs=5e-5)
            assert colour.setdefault(r["run"], k["color"]) == k["color"]
        assert len(set(colour.values())) == len(colour)  # (at most 18 configurations here)
        ((x, y, style),) = [a for m, a, k in drawn if m == "plot"]
        assert [f / 1e6 for f in x] == pytest.approx([f for f, _ in dense], abs=5e-4)
        assert list(y) == pytest.approx([v for _, v in dense], abs=5e-5)
        tested_in_all += len(tested)
    assert tested_in_all >= 18


def test_a_run_named_with_a_pipe_or_a_line_break_keeps_its_table_rows_whole(tmp_path, capsys):
    # a name is any text of runs.csv: a pipe is escaped and a line break is a space, so that every
    # row of both tables holds its columns (a row with one more cell fails table_rows' zip)
    sweep = load_command("sweep.py")
    record = Path(REPO, "records", "2026-11-26_figure2_bytes_core_5seeds_v3_cpu", "runs.csv")
    text = record.read_text()
    assert text.count("\ngated_mu0.5,") == 5
    (tmp_path / "runs.csv").write_text(text.replace("\ngated_mu0.5,", '\n"gated|mu\n0.5",'))
    code, _, err = run_main([f"--report={tmp_path / 'runs.csv'}"], capsys, sweep.main)
    assert code == 0, err
    table = (tmp_path / "table.md").read_text()
    for header, column, n in (("| run | vs |", "run", 1), ("| run | seed |", "run", 5)):
        rows = table_rows(table, header)
        assert [r[column] for r in rows].count("gated\\|mu 0.5") == n, header
    assert "gated_mu0.5" not in table


@pytest.mark.slow
def test_a_signal_during_a_report_leaves_the_table_and_figure_of_one_runs_csv(
    tmp_path, monkeypatch, capsys
):
    # Ctrl-C as each file of a report is written over another record's: held till the last is
    # written, then the command stops (130), table.md and figure.png both the new runs.csv's
    sweep = load_command("sweep.py")
    old, new = (
        Path(REPO, "records", f"2026-11-26_figure2_bytes_core_5seeds_{v}_cpu", "runs.csv")
        for v in ("v2", "v3")
    )
    for folder, csv_path in (("out", old), ("whole", new)):
        (tmp_path / folder).mkdir()
        shutil.copy(csv_path, tmp_path / folder / "runs.csv")
        code, _, err = run_main([f"--report={tmp_path / folder / 'runs.csv'}"], capsys, sweep.main)
        assert code == 0, err
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    shutil.copy(new, tmp_path / "out" / "runs.csv")
    signal_at_each_write(monkeypatch)
    code, _, err = run_main([f"--report={tmp_path / 'out' / 'runs.csv'}"], capsys, sweep.main)
    assert code == 130, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == whole


def table_rows(text: str, header: str) -> list:
    """The rows of the markdown table in text whose header line starts with header, each a dict
    by column name (cells stripped; an escaped pipe is a cell's own)."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    names = [c.strip() for c in lines[at].strip("|").split("|")]
    rows = []
    for ln in lines[at + 2 :]:
        if not ln.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", ln.strip("|"))
        rows.append(dict(zip(names, (c.strip() for c in cells), strict=True)))
    return rows


# ------------------------------------------------------------------ sweep.py: grids


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


def test_a_run_is_done_only_at_its_last_validation_and_its_logs_are_read_leniently(tmp_path):
    sweep = load_command("sweep.py")
    run = tmp_path / "run"
    run.mkdir()
    assert sweep.run_state(str(run)) == "fresh"  # a folder, nothing in it
    config = {"num_steps": 6, "run_id": "ab"}
    (run / "config.json").write_text("\ufeff" + json.dumps(config))  # an editor's BOM
    notes = ["my note", "[1, 2]", "[" * 100000, json.dumps({"step": 4})]  # a user's, no kind
    notes += [
        json.dumps({"kind": "val", "note": "re-check"}),
        json.dumps({"kind": "val", "step": 1.0}),
    ]
    records = [{"kind": "val", "step": 3}, *notes, {"kind": "train", "step": 5}]
    (run / "metrics.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    )
    assert sweep.runlog.run_records(str(run), "val") == [{"kind": "val", "step": 3}]
    assert sweep.run_state(str(run)) == "fresh"  # validated mid-way, no checkpoint
    (run / "checkpoint.pt").write_bytes(b"")
    assert sweep.run_state(str(run)) == "resume"
    # done at the last step, not the one before, once its checkpoint is of that step too (the
    # trainer's rule): killed between its final validation and its final save, a run goes on
    # from its checkpoint of an earlier step; one of another run is not its own
    for step, saved, state in ((5, 4, "resume"), (6, 4, "resume"), (6, 6, "done")):
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "val", "step": step}) + "\n")
        torch.save({"run_id": "ab", "step": saved}, run / "checkpoint.pt")
        assert sweep.run_state(str(run)) == state, (step, saved)
    # a finished run whose checkpoint is gone (a user's, to save space), damaged, a link or
    # another run's: measure would find no weights of its own; refused before any run starts
    (tmp_path / "elsewhere.pt").write_bytes((run / "checkpoint.pt").read_bytes())
    for make in (
        lambda p: p.unlink(),
        lambda p: p.write_bytes(b"damaged"),
        lambda p: torch.save({"run_id": "cd", "step": 6}, p),
        lambda p: (p.unlink(), p.symlink_to(tmp_path / "elsewhere.pt")),
    ):
        shutil.copy(tmp_path / "elsewhere.pt", run / "checkpoint.pt")  # (done, as above)
        make(run / "checkpoint.pt")
        with pytest.raises(support.UserError, match="run: a finished run without a checkpoint.pt"):
            sweep.run_state(str(run))
        (run / "checkpoint.pt").unlink(missing_ok=True)
    (run / "checkpoint.pt").write_bytes(b"")
    huge = json.dumps({"num_steps": 6, "pad": " " * (1 << 20)})  # over the cap: not a run's
    for text in ("[6]", "not json", "{", huge):  # no JSON object: no settings
        (run / "config.json").write_text(text)
        assert sweep.runlog.json_object(str(run / "config.json")) == {}, text
    assert sweep.run_state(str(run)) == "resume"


def test_a_resume_keeps_the_job_settings_of_the_grid_and_of_its_preset(tmp_path, monkeypatch):
    # a resume takes no --preset: the preset's job settings (smoke's compile=False) are given
    # as such, then the grid's own (a resumed run compiled where the fresh one ran eagerly would
    # not reproduce its digits on a GPU)
    sweep = load_command("sweep.py")
    planned = []
    monkeypatch.setattr(sweep.launch, "run_plans", lambda plans, *_: planned.extend(plans))
    grid = dict(base=TINY_GRID + ["--untimed_steps=3"], runs=[sweep.dlo(0.5, "dense_2", 2, 1)])
    done = sweep.run_grid(grid, str(tmp_path), range(1), 1)
    resume = planned[0].steps[1]
    assert resume == (
        "train_gpt.py",
        [f"--resume={tmp_path / 'dlo_rho0.5_s0'}", "--compile=False", "--untimed_steps=3"],
    )
    assert done[0][3].endswith(" && python train_gpt.py " + shlex.join(resume[1]))


def test_a_run_s_settings_are_compared_with_the_grid_s_as_its_docstring_says(tmp_path):
    sweep = load_command("sweep.py")
    run = tmp_path / "dense_2_s0"
    run.mkdir()
    argv = TINY_GRID + ["--router=none", "--n_layers=2", "--seed=0", f"--run_dir={run}"]
    saved = asdict(tg.resolve(tg.parse_overrides(argv)))  # as train_gpt.py's config.json

    def check(**there):
        (run / "config.json").write_text(json.dumps({**saved, **there}))
        sweep.check_settings(str(run), [("train_gpt.py", argv)])

    check()
    with pytest.raises(support.UserError, match=r"\(n_layers=4 there, 2 here\)"):
        check(n_layers=4)
    # how a step is computed: compared where the grid sets it (device_batch_size), else free
    with pytest.raises(support.UserError, match=r"\(device_batch_size=4 there, 8 here\)"):
        check(device_batch_size=4)
    check(loss_rows=saved["loss_rows"] // 2, compact=not saved["compact"])
    # the data's paths (the repository moved) and a field an older run's config.json lacks
    check(train_files="/elsewhere/train_*.bin", val_files="/elsewhere/val_*.bin")
    del saved["encoding"]
    check()


@pytest.mark.slow
def test_the_gpu_byte_grid_dry_runs_at_a_tiny_size_two_at_once(tmp_path, monkeypatch, capsys):
    # bytes_gpu, its configurations as one GPU call runs them (--jobs), on CPU at a tiny size
    # and on a tiny byte corpus (this README's bytes), two seeds: every run trains, the record
    # compares each routed run with its seed's frontier or control, and says how far each gated
    # block's zero share ended from its target
    sweep = load_command("sweep.py")
    text = np.frombuffer((Path(REPO) / "README.md").read_bytes(), np.uint8)
    for split, part in (("train", text[: len(text) // 2]), ("val", text[len(text) // 2 :])):
        (tmp_path / f"b_{split}_000000.bin").write_bytes(shard_bytes(part, "bytes"))
    grid, tokens = sweep.GRIDS["bytes_gpu"], 8 * 4 * 32  # 8 steps of 4 x 32 bytes
    tiny = [f"--train_files={tmp_path}/b_train_*.bin", f"--val_files={tmp_path}/b_val_*.bin"]
    tiny += [f"--train_tokens={tokens}", "--val_tokens=1024", "--save_every=4"]
    tiny += ["--dim=32", "--n_heads=2", "--n_kv_heads=2", "--max_seq_len=32", "--seq_len=32"]
    tiny += ["--batch_size=4", "--device_batch_size=4", "--untimed_steps=0", "--compile=false"]
    full = [a for a in grid["base"] if a.startswith("--train_tokens=")][-1].split("=")[1]
    half = f"--train_tokens={int(full) // 2}"  # DLO's source and its expansions: half each
    halved = [
        (n, [f"--train_tokens={tokens // 2}" if a == half else a for a in r], *e)
        for n, r, *e in grid["runs"]
    ]
    assert sum(half in r for _, r, *_ in grid["runs"]) == 3  # dlo_source_3, dlo_rho0.5, control
    monkeypatch.setitem(sweep.GRIDS, "bytes_gpu", dict(grid, base=grid["base"] + tiny, runs=halved))
    times = {"masked": 2.0, "compact": 1.0}  # (each model's own, for its own columns)
    monkeypatch.setattr(sweep, "eval_ms_per_token", lambda models, _: {k: times[k] for k in models})
    out = tmp_path / "out"
    argv = [
        "--grid=bytes_gpu",
        "--seeds=2",
        "--jobs=2",
        f"--runs={tmp_path / 'runs'}",
        f"--out={out}",
    ]
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 0, err
    rows = sweep.read_runs(str(out / "runs.csv"))
    assert sorted((r["name"], r["seed"]) for r in rows) == sorted(
        (n, s) for n, *_ in grid["runs"] for s in (0, 1)
    )
    for r in rows:  # (dense models and the recursive baseline skip nothing: their one time twice)
        compact = 2.0 if r["router"] == "none" or r["name"].startswith("recursive_") else 1.0
        assert (r["ms_per_token_masked"], r["ms_per_token_compact"]) == (2.0, compact), r
    share = sweep.launch.share_of_cpus(2)["OMP_NUM_THREADS"]  # each run's threads, as its log says
    for log in (tmp_path / "runs").glob("*/train.log"):
        assert f"  threads {share}\n" in log.read_text(), log
    lines = {(ln["name"], ln["vs"]) for ln in sweep.summarise(rows)}
    for name in ("gated_mu0.5", "gated_mu0.25", "dlo_rho0.5", "mod_c0.125", "mor_r3"):
        assert (name, "dense frontier") in lines, lines
    assert ("dlo_rho0.5", "dlo_control") in lines and ("mor_r3", "recursive_r3") in lines
    for r in rows:  # each run its own seed's; an expansion from its own seed's source
        folder = tmp_path / "runs" / f"{r['name']}_s{r['seed']}"
        assert json.loads((folder / "config.json").read_text())["seed"] == r["seed"], folder
        if r["name"].startswith(("dlo_rho", "dlo_control")):
            source = json.loads((folder / "expand.json").read_text())["expanded_from"]
            assert source == str(tmp_path / "runs" / f"dlo_source_3_s{r['seed']}")
        if r["name"].startswith("dense_"):  # the blocks and the two norms (not embed, head)
            blocks = sources.load_model(str(folder)).blocks.parameters()
            assert r["params"] == sum(p.numel() for p in blocks) + 2 * 32, folder
    gated = [r for r in rows if r["name"].startswith("gated")]
    for r in gated:
        folder = tmp_path / "runs" / f"{r['name']}_s{r['seed']}"
        config = json.loads((folder / "config.json").read_text())
        assert config["gamma"] == float(sweep.BYTES_GATE_GAMMA) and config["dim"] == 32
        assert (config["lr"], config["encoding"], config["n_layers"]) == (1e-3, "bytes", 6)
        active = [m for m in read_metrics(folder) if m["kind"] == "val"][-1]["block_active"]
        assert r["gate_zero"] == " ".join(f"{1 - a:.4f}" for a in active)  # the zero share
    table = (out / "table.md").read_text()
    # each gated run's largest gap from the zero shares mu_start 1 -> mu_end aims at (Section
    # 2.4, 6 layers: linear over blocks 0-2, mirrored), written out here
    targets = {
        "gated_mu0.5": [0, 0.25, 0.5, 0.5, 0.25, 0],
        "gated_mu0.25": [0, 0.375, 0.75, 0.75, 0.375, 0],
    }
    for r in gated:
        zero = [float(z) for z in r["gate_zero"].split()]
        gap = max(abs(z - t) for z, t in zip(zero, targets[r["name"]], strict=True))
        assert f"| {gap:.4f} |" in table.split(f"| {r['name']} | {r['seed']} |")[1].split("\n")[0]


@pytest.mark.slow
def test_a_failed_run_starts_no_other_and_lets_the_one_in_flight_finish(
    tmp_path, monkeypatch, capsys
):
    # --jobs=2: the sweep learns of a run refused by the trainer (no training file: settings the
    # sweep checks beforehand pass) while another trains; that one runs to its end, the next is
    # not started, and the refusal is the sweep's one error line. The second starts once the
    # refusal has exited, so the sweep sees the refusal first however fast the other run is (it
    # looks at its trainers in order)
    sweep = load_command("sweep.py")
    runs = [
        ("bad", ["--router=none", "--n_layers=2", "--train_files={runs}/none_*.bin"]),
        sweep.dense(2),
        sweep.dense(4),
    ]
    monkeypatch.setitem(sweep.GRIDS, "tiny", dict(base=TINY_GRID, runs=runs))
    start = sweep.launch.Trainers.start

    def after_those_in_flight(self, plan, step, nproc):
        for proc in self.live:
            proc.wait(timeout=60)
        start(self, plan, step, nproc)

    monkeypatch.setattr(sweep.launch.Trainers, "start", after_those_in_flight)
    argv = ["--grid=tiny", f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}", "--jobs=2"]
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {tmp_path / 'runs' / 'bad_s0'}: train_gpt.py exited 2: error: ")
    assert sweep.run_state(str(tmp_path / "runs" / "dense_2_s0")) == "done"
    assert not (tmp_path / "runs" / "dense_4_s0").exists()
    assert not (tmp_path / "out" / "runs.csv").exists()


@pytest.mark.slow
def test_a_run_refused_under_torchrun_is_said_by_its_ranks_error_line(
    tmp_path, monkeypatch, capsys
):
    # torchrun turns its ranks' status 2 into 1 and ends with a banner, which the sweep quoted
    sweep = load_command("sweep.py")
    bad = ["--router=none", "--device_batch_size=4", "--train_files={runs}/none_*.bin"]
    monkeypatch.setitem(sweep.GRIDS, "tiny", dict(base=TINY_GRID, runs=[("bad", bad)]))
    out = [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"]
    code, _, err = run_main(["--grid=tiny", "--nproc_per_node=2", *out], capsys, sweep.main)
    assert code == 1 and err.count("\n") == 1, err
    assert f"bad_s0: train_gpt.py exited 1: error: no shards match {tmp_path / 'runs'}/" in err, err


def test_a_finished_run_whose_final_record_was_edited_is_refused_before_any_run_starts(
    tmp_path, monkeypatch, capsys
):
    # measure reads each run's final validation record once the grid has trained: an edited one
    # (a figure dropped, or of another type or range than runs.csv takes) was a traceback there
    sweep = load_command("sweep.py")
    monkeypatch.setitem(sweep.GRIDS, "tiny", dict(base=TINY_GRID, runs=[sweep.dense(2)]))
    runs, out = tmp_path / "runs", tmp_path / "out"
    done = runs / "dense_2_s0"
    done.mkdir(parents=True)
    argv = TINY_GRID + ["--router=none", "--n_layers=2", "--seed=0", f"--run_dir={done}"]
    config = {**asdict(tg.resolve(tg.parse_overrides(argv))), "num_steps": 5, "run_id": "ab"}
    (done / "config.json").write_text(json.dumps(config))
    shares = dict(sparsity=0.25, fwd_flops_per_token=1e5, block_active=[1.0, 0.5])
    record = dict(kind="val", step=5, val_loss=3.5, val_se=0.1, val_docs=7, **shares)
    torch.save({"run_id": config["run_id"], "step": 5}, done / "checkpoint.pt")
    for edit, said in (
        (dict(val_loss=None), "val_loss is empty"),
        (dict(val_loss="3.5"), "val_loss='3.5'"),
        (dict(val_loss=math.inf), "val_loss=inf"),
        (dict(val_docs=7.5), "val_docs=7.5"),
        (dict(val_docs=True), "val_docs=True"),
        (dict(val_se=-0.1), "val_se=-0.1"),
        (dict(sparsity=1.5), "sparsity=1.5"),
        (dict(fwd_flops_per_token=0), "fwd_flops_per_token=0"),
        (dict(block_active=[1.0]), "block_active=[1.0] is not a share for each of its 2 "),
        (dict(block_active=[1.0, "1"]), "block_active=[1.0, '1']"),
        (dict(block_active=[1.0, 1.5]), "block_active=[1.0, 1.5]"),
    ):
        (done / "metrics.jsonl").write_text(json.dumps({**record, **edit}) + "\n")
        assert sweep.run_state(str(done)) == "done"
        argv = [f"--runs={runs}", f"--out={out}", "--grid=tiny", "--seeds=2"]
        code, _, err = run_main(argv, capsys, sweep.main)
        assert code == 2 and err.count("\n") == 1 and said in err, err
        assert "metrics.jsonl: in its final validation record, " in err
        assert [p.name for p in runs.iterdir()] == ["dense_2_s0"] and not out.exists()  # no run
        assert sorted(p.name for p in done.iterdir()) == [
            "checkpoint.pt",
            "config.json",
            "metrics.jsonl",
        ]
    for written in (record, {**record, "val_se": None, "val_docs": None}):  # (older: no docs)
        (done / "metrics.jsonl").write_text(json.dumps(written) + "\n")
        assert sweep.final_validation(str(done)) == written


def test_settings_a_run_would_refuse_are_refused_before_any_run_starts(
    tmp_path, monkeypatch, capsys
):
    # the trainer's check of its settings, with the world size: under torchrun each rank's line
    # came after runs had started, and the launcher's status (1) and last line (a banner) were
    # all the sweep said; and of its folder (a user's file where a later run's would be, or a
    # user's log in that folder)
    sweep = load_command("sweep.py")
    runs = [sweep.dense(2), ("bad", ["--router=none", "--n_layers=2", "--n_heads=3"])]
    monkeypatch.setitem(sweep.GRIDS, "tiny", dict(base=TINY_GRID, runs=runs))
    monkeypatch.setitem(sweep.GRIDS, "tiny_ok", dict(base=TINY_GRID, runs=runs[:1]))
    out = [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"]
    mine = tmp_path / "runs" / "dense_2_s1"  # where the second seed's run would be

    def a_file():
        mine.write_text("my notes")

    def my_log():
        mine.mkdir()
        (mine / "train.log").write_text("my notes")

    for argv, said, make in (
        (["--grid=cpu", "--nproc_per_node=3"], "_s0: val_tokens=4096 is not a whole number", None),
        (["--grid=tiny"], "bad_s0: need dim (32) divisible by n_heads (3)", None),
        (["--grid=tiny_ok", "--seeds=2"], f"{mine} is a file, not a folder", a_file),
        (
            ["--grid=tiny_ok", "--seeds=2"],
            f"{mine} holds train.log, not a run's of this project (no config",
            my_log,
        ),
    ):
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        if make:
            mine.parent.mkdir()
            make()
        before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        code, _, err = run_main(argv + out, capsys, sweep.main)
        assert code == 2 and err.count("\n") == 1 and said in err, err
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_a_tiny_grid_runs_end_to_end_two_at_once_and_a_killed_one_resumes(
    tmp_path, monkeypatch, capsys
):
    sweep = load_command("sweep.py")
    # (its val_tokens overrides the base's, as dlo_source's train_tokens does in the real grids)
    gated = sweep.gated("gated_mu0.5", "--n_layers=4", "--mu_end=0.5", "--val_tokens=256")
    grid = dict(
        base=TINY_GRID,
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
    stopped = TINY_GRID + gated[1] + ["--seed=0", f"--run_dir={runs / 'gated_mu0.5_s0'}"]
    sweep.launch.run_plans(
        [sweep.launch.Plan("gated", [("train_gpt.py", stopped + ["--stop_step=2"])])], 1
    )
    assert sweep.run_state(str(runs / "gated_mu0.5_s0")) == "resume"

    events, start, ended = [], sweep.launch.Trainers.start, sweep.launch.Trainers.ended

    def started(self, plan, step, nproc):  # what the sweep starts and sees end, in order
        start(self, plan, step, nproc)
        events.append(("start", plan.label, plan.steps[step][0], len(self.live)))

    def finished(self):
        trainer, *rest = ended(self)
        plan = trainer.plan
        events.append(("end", plan.label, plan.steps[trainer.step][0], len(self.live)))
        return trainer, *rest

    monkeypatch.setattr(sweep.launch.Trainers, "start", started)
    monkeypatch.setattr(sweep.launch.Trainers, "ended", finished)
    argv = ["--grid=tiny", f"--runs={runs}", f"--out={out}", "--jobs=2"]
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 0, err
    # --jobs=2: two processes side by side, never more; a DLO run's expansion after its source
    assert max(n for kind, *_, n in events if kind == "start") == 2, events
    source = ("end", str(runs / "dense_2_s0"), "train_gpt.py")
    source_end = next(i for i, e in enumerate(events) if e[:3] == source)
    for name in ("dlo_rho0.5", "dlo_control"):
        first = next(e for e in events if e[1] == str(runs / f"{name}_s0"))
        assert first[:3] == ("start", str(runs / f"{name}_s0"), "expand.py")
        assert events.index(first) > source_end, events
    assert "resumed at step 2" in (runs / "gated_mu0.5_s0" / "train.log").read_text()
    names = ["dense_2", "dense_4", "gated_mu0.5", "dlo_rho0.5", "dlo_control", "mor_r2"]
    for name in names:
        assert sweep.run_state(str(runs / f"{name}_s0")) == "done"
    assert {p.name for p in out.iterdir()} >= {"table.md", "runs.csv", "figure.png", "README.md"}
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (out / "README.md").read_text()
    assert "Verdict: no difference can be tested: dense_4 frontier" not in readme
    assert "Verdict: no difference can be tested: " in readme and "(one seed: no test)" in readme
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
    # a row's command run alone gives its run's validation to the last digit: side by side,
    # the runs did not touch each other
    command = shlex.split(table["dense_4"]["command"])
    assert command[:2] == ["python", "train_gpt.py"], command
    args = [a for a in command[2:] if not a.startswith("--run_dir=")]
    alone = run_command("train_gpt.py", *args, f"--run_dir={tmp_path / 'alone'}", threads=1)
    assert alone.returncode == 0, alone.stderr[-2000:]
    val = [
        [m for m in read_metrics(d) if m["kind"] == "val"][-1]
        for d in (runs / "dense_4_s0", tmp_path / "alone")
    ]
    assert val[0]["val_loss"] == val[1]["val_loss"], val
    for name, r in table.items():  # the table holds each run's own final validation
        last = [m for m in read_metrics(runs / f"{name}_s0") if m["kind"] == "val"][-1]
        assert r["val_loss"] == pytest.approx(last["val_loss"])
        assert r["flops_per_token"] == pytest.approx(last["fwd_flops_per_token"])
        assert r["ms_per_token_masked"] > 0 and r["ms_per_token_compact"] > 0
        assert (r["steps"], r["tokens"]) == (last["step"], last["step"] * 8 * 32)
    # the standard error over documents, by hand from the dense model's per-token losses
    model = sources.load_model(str(runs / "dense_4_s0")).eval()
    hp = model.hp
    stream = torch.from_numpy(
        shards.read_shard(shards.find_shards(hp.val_files)[0], hp.vocab_size)[
            : hp.val_tokens + 1
        ].astype(np.int64)
    )
    with torch.no_grad():
        logits = model(stream[:-1].view(-1, hp.seq_len)).logits.flatten(0, 1)
    losses = F.cross_entropy(logits, stream[1:], reduction="none").tolist()
    docs, _, se = documents_by_hand(losses, stream[1:].tolist(), shards.EOT)
    assert (table["dense_4"]["val_docs"], table["dense_4"]["val_se"]) == (
        len(docs),
        pytest.approx(se),
    )
    # the table and figure again from runs.csv alone, by the record's own command
    before = (out / "table.md").read_text()
    (out / "table.md").unlink()
    code, _, err = run_main([f"--report={out / 'runs.csv'}"], capsys, sweep.main)
    assert code == 0, err
    assert (out / "table.md").read_text() == before and "| dlo_rho0.5 | dlo_control | 1 |" in before
    d2, d4 = (table[n] for n in ("dense_2", "dense_4"))

    def x(r):
        return math.log(r["flops_per_token"])

    def front(r):  # the two dense points' lower envelope, by hand (None: out of their range)
        if not x(d2) - sweep.SLACK <= x(r) <= x(d4) + sweep.SLACK:
            return None
        if d4["val_loss"] >= d2["val_loss"]:  # dense_4 no better: dense_2's value holds
            return d2["val_loss"]
        w = min(1, max(0, (x(r) - x(d2)) / (x(d4) - x(d2))))
        return d2["val_loss"] + w * (d4["val_loss"] - d2["val_loss"])

    lines = {(ln["name"], ln["vs"]): ln for ln in sweep.summarise(list(table.values()))}
    assert any(front(table[n]) is not None for n in ("gated_mu0.5", "dlo_rho0.5"))
    for name in ("gated_mu0.5", "dlo_rho0.5"):
        r, mean = table[name], lines[(name, "dense frontier")]["mean"]
        if front(r) is None:
            assert mean is None
        else:
            assert mean == pytest.approx(r["val_loss"] - front(r), abs=1e-9)
    # run again: nothing is trained, no run directory changes (a user's notes in a log included)
    with open(runs / "dense_2_s0" / "metrics.jsonl", "a") as f:
        f.write("my note\n[1, 2]\n")
    before = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    code, printed, err = run_main(argv, capsys, sweep.main)
    assert code == 0, err
    assert printed.count(": done") == 6 and "trained" not in printed
    assert before == {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    # the grid edited (a longer budget): its finished runs are not taken as the new grid's
    monkeypatch.setitem(grid, "base", [a.replace("=1280", "=2560") for a in TINY_GRID])
    code, _, err = run_main(argv, capsys, sweep.main)
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
        code, _, err = run_main(argv, capsys, sweep.main)
        assert code == 2 and f"{entry[0]}_s0 was trained with other settings ({said})" in err, err
    monkeypatch.setitem(grid, "runs", runs_of)
    assert before == {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    # a file the sweep did not write (or changed since) is never replaced: refused before any run
    (out / "README.md").write_text("my notes")
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 2 and err.startswith(
        f"error: {out / 'README.md'} is there (a file) and this command did not write it"
    ), err
    (out / "table.md").unlink()
    (out / "table.md").mkdir()
    code, _, err = run_main([f"--report={out / 'runs.csv'}"], capsys, sweep.main)
    assert code == 2 and "table.md is there (a folder)" in err and err.count("\n") == 1, err
    assert (out / "README.md").read_text() == "my notes" and before == {
        p: p.read_bytes() for p in runs.rglob("*") if p.is_file()
    }


def test_a_grid_is_not_measured_where_a_training_shard_a_run_read_changed(
    tmp_path, monkeypatch, capsys
):
    # a row's corpus_sha256 hashes the shards there when it is measured: one the run read that
    # changed since would credit the run with a corpus it never saw. Refused before any run is
    # measured, and nothing written
    sweep = load_command("sweep.py")
    tokens = np.random.default_rng(0).integers(0, 50257, 2000)
    write_shard(tmp_path / "train_0.bin", tokens)
    base = TINY_GRID + [f"--train_files={tmp_path}/train_*.bin"]
    monkeypatch.setitem(sweep.GRIDS, "one", dict(base=base, runs=[sweep.dense(2)]))
    argv = ["--grid=one", f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"]
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    write_shard(tmp_path / "train_0.bin", tokens[::-1])  # the same size, other tokens
    code, _, err = run_main(argv, capsys, sweep.main)
    assert code == 2, err
    assert err.startswith(f"error: {tmp_path / 'runs' / 'dense_2_s0'}: the run had read train_0")
    assert err.endswith(": measure it on the shards it trained on\n") and err.count("\n") == 1
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}


@pytest.mark.slow
def test_a_grid_split_over_commands_does_not_lose_the_record_of_another(
    tmp_path, monkeypatch, capsys
):
    # --first_seed splits a grid over commands that share --runs: one whose record would drop
    # the rows of another's (the same --out) is refused before it trains; measuring every seed
    # at once replaces it, each run measured again
    sweep = load_command("sweep.py")
    monkeypatch.setitem(sweep.GRIDS, "one", dict(base=TINY_GRID, runs=[sweep.dense(2)]))
    common = ["--grid=one", f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"]
    code, _, err = run_main(common, capsys, sweep.main)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    code, _, err = run_main(common + ["--seeds=2", "--first_seed=1"], capsys, sweep.main)
    assert code == 2, err
    assert (
        err.startswith(
            f"error: {tmp_path / 'out' / 'runs.csv'} holds runs that this command does not measure "
            f"(dense_2 seed 0: not among this grid's runs and seeds), and would lose them: give "
            f"another --out, or one command that measures them all"
        )
        and err.count("\n") == 1
    ), err
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert not (tmp_path / "runs" / "dense_2_s1").exists()  # nothing trained
    # a command beside it that wrote its record into the same --out while this one trained
    # (its own --out given, empty at the start): checked again before the record is written
    run_grid = sweep.run_grid

    def beside(*args):
        done = run_grid(*args)
        shutil.copytree(tmp_path / "out", tmp_path / "later", dirs_exist_ok=True)
        return done

    monkeypatch.setattr(sweep, "run_grid", beside)
    later = [a for a in common if not a.startswith("--out=")] + [f"--out={tmp_path / 'later'}"]
    code, _, err = run_main(later + ["--seeds=2", "--first_seed=1"], capsys, sweep.main)
    assert code == 2 and "holds runs that this command does not measure (dense_2 seed 0" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "later").iterdir()} == before
    monkeypatch.setattr(sweep, "run_grid", run_grid)
    code, _, err = run_main(common + ["--seeds=2"], capsys, sweep.main)
    assert code == 0, err
    rows = sweep.read_runs(str(tmp_path / "out" / "runs.csv"))
    assert [(r["name"], r["seed"]) for r in rows] == [("dense_2", 0), ("dense_2", 1)]


@pytest.mark.slow
def test_a_sweep_started_outside_the_repository_keeps_its_runs_where_it_was_told(
    tmp_path, monkeypatch, capsys
):
    sweep = load_command("sweep.py")  # (its trainers run in the repository: the paths must agree)
    monkeypatch.setitem(sweep.GRIDS, "one", dict(base=TINY_GRID, runs=[sweep.dense(2)]))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["--grid=one", "--runs=runs", "--out=out"], capsys, sweep.main)
    assert code == 0, err
    assert sweep.run_state(str(tmp_path / "runs" / "dense_2_s0")) == "done"
    row = sweep.read_runs(str(tmp_path / "out" / "runs.csv"))[0]
    assert f"--run_dir={tmp_path / 'runs' / 'dense_2_s0'}" in row["command"]


# ------------------------------------------------------------------------- records/


@pytest.mark.slow
def test_every_script_under_records_runs_on_todays_code(tmp_path):
    scripts = sorted(Path(REPO).glob("records/*/*.py"), key=lambda p: (p.name, str(p)))
    names = ["compile_time.py", "memory_step.py", "probe.py", "replay.py", "table.py", "table.py"]
    assert [p.name for p in scripts] == names  # a new one: run it here
    for script in scripts:  # each answers --help with its docstring
        r = run_command(script, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage: "), (script, r.stderr[-500:])
    for script, rows in zip(scripts[4:], (10, 19), strict=True):  # each record's table, from
        r = run_command(script)  # its runs, as its README shows it
        readme = (script.parent / "README.md").read_text()
        assert r.returncode == 0 and r.stdout.count("\n") == rows and r.stdout in readme, r.stdout
    r = run_command(  # CPU Inductor, a new cache: a block's graph and the readout's compiled,
        scripts[0], REPO, "--compact=0", "--steps=2", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    )  # then reused
    assert r.returncode == 0, r.stderr[-2000:]
    timed = json.loads(r.stdout)
    assert timed["graphs"] == 2 and timed["steps"][0]["compile_s"] > 0, timed
    assert timed["steps"][1]["compile_s"] == 0 < timed["steps"][1]["wall_s"], timed
    r = run_command(  # one block's packed region, compiled static at a packed length, as eager
        scripts[2], "static", "4", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "probe")}
    )
    assert r.returncode == 0, r.stderr[-2000:]
    first = re.fullmatch(
        r"length 16: first call [\d.]+ s, then [\d.]+ ms, vs eager (\S+)", r.stdout.splitlines()[1]
    )
    assert first and float(first[1]) < 1e-5 and "compile_fx_inner" in r.stdout, r.stdout
    r = run_command(  # today's packed_lengths on the recorded counts: the run's own redos
        scripts[3], timeout=120
    )
    assert r.returncode == 0 and r.stdout.splitlines()[:2] == [
        "300 steps, 12 redone in the run",
        "packed_lengths: 12 redone, packed / needed 1.285",
    ], r.stdout + r.stderr[-2000:]
    assert "packed_lengths over 4 steps: 43 redone, packed / needed 1.316" in r.stdout, r.stdout
    h200 = Path(REPO, "records/2026-11-27_gpu_check_NVIDIA_H200/paper_compact/metrics.jsonl")
    r = run_command(scripts[3], h200, timeout=120)  # the H200 record's figures, as it quotes them
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == (
        "steps 31-40: active 0.236, fullest row 0.311, ran 0.911 of the blocks' positions"
    ), r.stdout + r.stderr[-2000:]
    for said in (
        "over 4 steps: 2 redone, packed / needed 1.239",
        "over 16 steps: 2 redone, packed / needed 1.477",
    ):
        assert f"packed_lengths {said}" in r.stdout, r.stdout
    r = run_command(scripts[1], REPO, "1", "1", threads=1, timeout=300)
    assert r.returncode == 0 and re.fullmatch(
        r"device_batch=1 x 1024 n_layers=1: peak RSS "
        r"[\d.]+ GiB \(after building the model [\d.]+ GiB\), "
        r"step [\d.]+ s\n",
        r.stdout,
    ), r.stderr[-2000:]
