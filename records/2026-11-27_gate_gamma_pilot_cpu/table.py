"""The pilot's table from runs/*/ (config.json, val.jsonl: the final validation record).

python records/2026-11-27_gate_gamma_pilot_cpu/table.py
"""

import argparse
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    print("| gamma | val CE (SE) | zero share per block | target | largest gap |")
    print("|---|---|---|---|---|")
    rows = []
    for run in glob.glob(os.path.join(HERE, "runs", "*")):
        config = json.load(open(os.path.join(run, "config.json")))
        val = [json.loads(line) for line in open(os.path.join(run, "val.jsonl"))][-1]
        zero = [1 - a for a in val["block_active"]]
        half = (
            config["n_layers"] // 2
        )  # mu: linspace(mu_start, mu_end) over the first half, mirrored
        step = (config["mu_end"] - config["mu_start"]) / (half - 1)
        mu = [config["mu_start"] + i * step for i in range(half)]
        target = [1 - m for m in mu + mu[::-1]]
        gap = max(abs(z - t) for z, t in zip(zero, target, strict=True))
        rows.append((config["gamma"], val, zero, target, gap))
    for gamma, val, zero, target, gap in sorted(rows, key=lambda r: r[0]):
        print(
            f"| {gamma:g} | {val['val_loss']:.4f} ({val['val_se']:.4f}) | "
            f"{' '.join(f'{z:.3f}' for z in zero)} | {' '.join(f'{t:.2f}' for t in target)} | "
            f"{gap:.3f} |"
        )
