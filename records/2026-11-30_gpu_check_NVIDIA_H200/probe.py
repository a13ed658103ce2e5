"""One block's `packed` region (train_gpt.Block.packed) compiled static or with symbolic shapes
(torch.compile's dynamic=True), forward and backward, at packed lengths given in units of
seq_len / 16, in turn: each length's first call (its compile, if any, and the run), the fastest
of five calls after it, and the largest difference from the eager region (on CPU, at a tiny
size under SDPA; on CUDA, the paper's size under Flex, where the column compares the output
with itself: no eager reference is run). Then Dynamo's table of compile times.

    python probe.py static|dynamic UNITS     # from a checkout's root; UNITS: 4,5,8,12,1,3

Run it with TORCHINDUCTOR_CACHE_DIR set to a new folder: a cold compile.
"""

import argparse
import os
import sys
import time
import traceback

import torch
from torch._dynamo.utils import compile_times

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
p.add_argument("mode", choices=("static", "dynamic"))
p.add_argument("units", help="packed lengths in units of seq_len / 16, comma-separated")
args = p.parse_args()
sys.path.insert(0, os.getcwd())
import train_gpt as tg  # noqa: E402

mode = args.mode
cuda = torch.cuda.is_available()
dev = "cuda" if cuda else "cpu"
if cuda:
    hp, B = tg.Hyperparameters(compact=True, attn_impl="flex"), 32
else:
    hp, B = (
        tg.Hyperparameters(
            n_layers=2, dim=64, n_heads=2, n_kv_heads=2, max_seq_len=64, seq_len=64,
            compact=True, attn_impl="sdpa",
        ),
        2,
    )  # fmt: skip
T, unit = hp.seq_len, hp.seq_len // 16
torch.manual_seed(0)
block = tg.Block(hp).to(dev)
fn = torch.compile(block.packed, dynamic=(mode == "dynamic"))
sync = torch.cuda.synchronize if cuda else (lambda: None)
print(mode, torch.__version__, dev, flush=True)


def step(f, x, gk, mask, n):
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
        y = f(x, gk, mask, n, True)  # keys_grad: the keys learn, as g (66a3cb6 had no such flag)
    y.float().square().mean().backward()
    sync()
    return y.detach().float()


for n in [int(a) * unit for a in args.units.split(",")]:
    x = torch.randn(B, T, hp.dim, device=dev, requires_grad=True)
    keep = torch.rand(B, T, device=dev).argsort(dim=1)[:, :n]  # n active tokens a sequence
    g = torch.zeros(B, T, device=dev).scatter(1, keep, torch.rand(B, n, device=dev) * 0.9 + 0.1)
    gk = torch.stack((g, g), dim=-1).requires_grad_()
    mask = tg.causal_block_mask(n, dev) if hp.attn_impl == "flex" else None
    try:
        t0 = time.perf_counter()
        y = step(fn, x, gk, mask, n)
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            step(fn, x, gk, mask, n)
            times.append(time.perf_counter() - t0)
        ref = step(block.packed, x, gk, mask, n) if not (cuda and hp.attn_impl == "flex") else y
        print(
            f"length {n}: first call {first:.2f} s, then {1e3 * min(times):.2f} ms,"
            f" vs eager {float((y - ref).abs().max()):.3g}",
            flush=True,
        )
    except Exception:
        print(f"length {n}: FAILED", flush=True)
        traceback.print_exc(limit=3)
        break
print(compile_times(repr="str", aggregate=True))
