"""Replay two packed-length rules on this run's recorded counts: python replay.py metrics.jsonl"""

import json
import sys

T = 128  # the smoke preset's seq_len
unit = T // 16  # train_gpt.PACKS
train = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "train"]
counts = [r["packed"] for r in train]


def replay(rule):  # -> (steps redone, packed tokens / tokens needed), the first step at T
    lengths, redone, packed = [T] * len(counts[0]), 0, 0
    for i, c in enumerate(counts):
        over = any(n > m for n, m in zip(c, lengths, strict=True))
        redone, packed = redone + over, packed + sum(lengths) + over * T * len(c)
        lengths = rule(counts[max(0, i + 1 - 16) : i + 1], c)
    return redone, packed / sum(map(sum, counts))


def window(seen, c):  # train_gpt.packed_lengths: the most of the last 16 steps, in units
    return [min(T, -(-max(1, int(max(s))) // unit) * unit) for s in zip(*seen, strict=True)]


def last_plus_unit(seen, c):  # the last step's counts rounded up, plus one unit of headroom
    return [min(T, (int(n) // unit + 2) * unit) for n in c]


print("steps", len(counts), "redone in the run", sum(r["redone"] for r in train))
for name, rule in (("16-step window", window), ("last step + one unit", last_plus_unit)):
    redone, ratio = replay(rule)
    print(f"{name}: {redone} redone, packed / needed {ratio:.3f}")
