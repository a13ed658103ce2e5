# Probe (not part of the project): one block's packed region, compiled static or dynamic, at
# several packed lengths: compile time per new length, run time, agreement with eager.
import os
import sys
import time
import traceback

import torch
from torch._dynamo.utils import compile_times

sys.path.insert(0, os.getcwd())
import train_gpt as tg  # noqa: E402

mode = sys.argv[1]  # static | dynamic
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
        y = f(x, gk, mask, n)
    y.float().square().mean().backward()
    sync()
    return y.detach().float()


for n in [int(a) * unit for a in sys.argv[2].split(",")]:
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
