"""Replay two packed-length rules on this run's recorded counts, the first today's
routers.packed_lengths:

    python records/2026-11-26_smoke_compact_packed_cpu/replay.py [METRICS_JSONL]
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository

import routers  # noqa: E402

T = 128  # the smoke preset's seq_len
unit = T // routers.PACKS


def last_plus_unit(seen):  # the last step's counts rounded up, plus one unit of headroom
    return [min(T, (int(n) // unit + 2) * unit) for n in seen[-1]]


def replay(counts, rule):  # -> (steps redone, packed tokens / tokens needed), the first at T
    lengths, redone, packed = [T] * len(counts[0]), 0, 0
    for i, c in enumerate(counts):
        over = any(n > m for n, m in zip(c, lengths, strict=True))
        redone, packed = redone + over, packed + sum(lengths) + over * T * len(c)
        lengths = rule(counts[max(0, i + 1 - routers.PACK_STEPS) : i + 1])
    return redone, packed / sum(map(sum, counts))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("path", nargs="?", default=HERE / "metrics.jsonl", metavar="METRICS_JSONL")
    train = [r for r in map(json.loads, open(p.parse_args().path)) if r["kind"] == "train"]
    counts = [r["packed"] for r in train]
    print(f"{len(counts)} steps, {sum(r['redone'] for r in train)} redone in the run")
    for name, rule in (
        ("packed_lengths", lambda seen: routers.packed_lengths(seen, T)),
        ("last step + one unit", last_plus_unit),
    ):
        redone, ratio = replay(counts, rule)
        print(f"{name}: {redone} redone, packed / needed {ratio:.3f}")
