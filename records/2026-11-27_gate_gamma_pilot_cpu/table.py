"""The pilot's table from its runs: each folder's config.json and the last validation record of
its metrics.jsonl (runs/ keeps only those records; run.sh's OUT holds whole run folders).

    python records/2026-11-27_gate_gamma_pilot_cpu/table.py [RUNS]   # default: runs/ beside it
"""

import argparse
import glob
import json
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import train_gpt as tg  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="?", default=os.path.join(HERE, "runs"))
    rows = []
    for path in glob.glob(os.path.join(p.parse_args().runs, "*", "config.json")):
        config = json.load(open(path))
        records = [
            json.loads(line) for line in open(os.path.join(os.path.dirname(path), "metrics.jsonl"))
        ]
        val = [r for r in records if r["kind"] == "val"][-1]
        zero = [1 - a for a in val["block_active"]]
        hp = replace(
            tg.Hyperparameters(), **{k: config[k] for k in ("n_layers", "mu_start", "mu_end")}
        )
        target = [1 - m for m in tg.mean_targets(hp).tolist()]  # (Section 2.4)
        gap = max(abs(z - t) for z, t in zip(zero, target, strict=True))
        rows.append((-config["mu_end"], config["gamma"], config["seed"], val, zero, target, gap))
    print("| mu_end | gamma | seed | val CE (SE) | zero share per block | target | largest gap |")
    print("|---|---|---|---|---|---|---|")
    for mu_end, gamma, seed, val, zero, target, gap in sorted(rows, key=lambda r: r[:3]):
        print(
            f"| {-mu_end:g} | {gamma:g} | {seed} | {val['val_loss']:.4f} ({val['val_se']:.4f}) | "
            f"{' '.join(f'{z:.3f}' for z in zero)} | {' '.join(f'{t:.2f}' for t in target)} | "
            f"{gap:.3f} |"
        )
