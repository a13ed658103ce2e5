"""Replay two packed-length rules on a compacted run's recorded counts (metrics.jsonl's
"packed"), the first today's routers.packed_lengths; then today's rule over windows of other
lengths than PACK_STEPS; then, over the run's last quarter, the share of the blocks' positions
that its gates left (block_active), that each row packed to the fullest row's count needs
(rounded as packed_length rounds; "needed" in the ratios is that count unrounded), and that the
lengths replayed at PACK_STEPS ran (a redone step at full length, again):

    python records/2026-11-26_smoke_compact_packed_cpu/replay.py [METRICS_JSONL]

The run's seq_len is read from the config.json beside METRICS_JSONL.
"""

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository

import routers  # noqa: E402


def replay(counts, rule, T, window=routers.PACK_STEPS):
    """-> (steps redone, packed tokens / tokens needed, per step the positions run): the first
    step at full length T, each next one at rule(the counts of the last `window` steps)."""
    lengths, redone, ran = [T] * len(counts[0]), 0, []
    for i, c in enumerate(counts):
        over = any(n > m for n, m in zip(c, lengths, strict=True))
        redone += over
        ran.append(sum(lengths) + over * T * len(c))
        lengths = rule(counts[max(0, i + 1 - window) : i + 1])
    return redone, sum(ran) / sum(map(sum, counts)), ran


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", nargs="?", default=HERE / "metrics.jsonl", metavar="METRICS_JSONL")
    path = Path(p.parse_args().path)
    T = json.loads((path.parent / "config.json").read_text())["seq_len"]
    train = [r for r in map(json.loads, open(path)) if r["kind"] == "train"]
    counts = [r["packed"] for r in train]
    unit = math.ceil(T / routers.PACKS)  # (as packed_length rounds)

    def today(seen):
        return routers.packed_lengths(seen, T)

    def last_plus_unit(seen):  # the last step's counts rounded up, plus one unit of headroom
        return [min(T, (int(n) // unit + 2) * unit) for n in seen[-1]]

    print(f"{len(counts)} steps, {sum(r['redone'] for r in train)} redone in the run")
    for name, rule in (("packed_lengths", today), ("last step + one unit", last_plus_unit)):
        redone, ratio, _ = replay(counts, rule, T)
        print(f"{name}: {redone} redone, packed / needed {ratio:.3f}")
    for window in (1, 2, 4, 8, 16):
        redone, ratio, _ = replay(counts, today, T, window)
        print(f"packed_lengths over {window} steps: {redone} redone, packed / needed {ratio:.3f}")
    last = len(counts) - max(1, len(counts) // 4)  # (the last quarter's first step, from 0)
    ran = replay(counts, today, T)[2][last:]
    share = len(ran) * len(counts[0]) * T
    active = sum(sum(r["block_active"]) * T for r in train[last:]) / share
    fullest = sum(routers.packed_length(int(n), T) for c in counts[last:] for n in c) / share
    print(
        f"steps {last + 1}-{len(counts)}: active {active:.3f}, fullest row {fullest:.3f}, "
        f"ran {sum(ran) / share:.3f} of the blocks' positions"
    )
